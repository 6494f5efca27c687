"""`smoe plan`'s forecast: what a model will cost on this machine before it loads.

- ``speed``: the speed model (pure): tokens per second from the plan, the disk and compute
  rates and the routing curves;
- ``probe``: the compute probe (a few timed expert calls, cached per device);
- ``subject``: what is planned for (a vault, a download, a `--bits` preview) and the
  budget's parts beside the ring for it;
- ``planner``: the assembly behind `smoe plan` (``make_plan``): the plan (smoe.plan), the
  probes and the speed model, as one JSON-able report.

Below the CLI and beside the engine: it imports smoe.plan, smoe.io and smoe.vault, never
smoe.engine (tests/unit/test_layers.py).
"""
