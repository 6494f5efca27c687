"""Expert parallelism over ``mx.distributed``: which rank owns which expert
(``assignment``) and the group's collectives (``group``); docs/distributed.md."""

# mx.distributed's backends ("any": whichever the launcher set up).
BACKENDS = ("any", "ring", "mpi", "nccl", "jaccl")
