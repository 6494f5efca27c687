"""`smoe plan`'s forecast: what a model will cost on this machine before it loads.

- ``speed``: the speed model (pure): tokens per second from the plan, the disk and compute
  rates and the routing curves;
- ``probe``: the compute probe (an engine on the vault decodes a few short requests after
  a warm-up; recorded per device, dtype, ring and host in the vault's stats);
- ``workload``: what the probes and benchmarks run (a random prompt, a filled ring);
- ``subject``: what is planned for (a vault, a download, a `--bits` preview) and the
  budget's parts beside the ring for it;
- ``planner``: the assembly behind `smoe plan` (``make_plan``): the plan (smoe.plan), the
  probes and the speed model, as one JSON-able report.

Below the CLI and beside the engine: it imports smoe.plan, smoe.io and smoe.vault, never
smoe.engine (tests/unit/test_layers.py).
"""
