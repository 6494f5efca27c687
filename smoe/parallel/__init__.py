"""Expert parallelism over ``mx.distributed`` (docs/distributed.md): which rank owns which
expert (``assignment``), the group's collectives (``group``), rank 0's doorbell before each
announcement (``doorbell``), the watchdog over collectives (``watchdog``) and ``smoe
shard``'s cut of one rank's experts (``cut``)."""

# mx.distributed's backends ("any": whichever the launcher set up).
BACKENDS = ("any", "ring", "mpi", "nccl", "jaccl")
