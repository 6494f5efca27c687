"""The model on the compute thread (every MLX call runs there; smoe.compute.worker is the
thread and its bridge to the event loop).

- the model: ``model`` (mlx-lm's model over the ring: the backbone resident, the experts
  streamed), ``streaming`` and ``switch`` (the MoE layer that asks for its experts' slots
  and computes on ring banks), ``source_backbone`` (a download's backbone from its shards),
  ``sharded`` (one rank's part of a layer);
- the passes: ``runner`` (``Runner``: prefill and decode steps, built ahead where it can),
  ``sequence`` (a generation's state), ``prefill``, ``prompt_pass`` and ``prompt_layer``
  (layer-major prefill over a whole prompt), ``draft`` and ``draft_step`` (prompt-lookup
  drafts and their verified step), ``sampler``, ``logprobs``, ``kv_cache``;
- exactness and speed: ``solo_rows`` and ``row_gemv`` (every row of a batch gets its solo
  bits), ``rowwise`` (batched decode of different lengths), ``native`` (S-MoE's CPU
  kernels, MLX's bits), ``cpu_split`` (large CPU calls split by rows);
- what the layers report: ``tracing`` (routing, popularity, hints), ``speculation`` (the
  router's guesses), ``timeline`` (where a step's host time goes).
"""
