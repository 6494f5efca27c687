"""Everything decided before an engine starts anything: the device and dtype, the kernel
rules, the batch, the context, the ring's kind and size, and how a whole-process memory
budget divides. ``plan.assess`` is the one call (the Plan, fitting or not); the engine
makes it through ``plan.plan`` (which refuses a budget too small), `smoe plan` directly.

    options.py  EngineOptions: every knob, frozen, checked once
    budget.py   the whole process's memory, part by part (pure arithmetic)
    memory.py   the memory this process may still take (system and cgroups)
    ring.py     the ring's kind and slots, the device's facts, the default budget
    host_tier.py  how many expert images a GPU ring's host tier keeps (--host-memory)
    plan.py     Plan, assess() and plan(): the above, in order, for one model

No module here starts a thread, reads a record or makes an MLX array (``choose_device``
sets MLX's default device, the one side effect).
"""
