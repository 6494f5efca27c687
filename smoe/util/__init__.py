"""Small helpers every layer may use (of S-MoE they import only its errors):

- ``files``: the one way S-MoE replaces files and directories (temp name, fsync,
  rename), crash recovery of replaced directories, file locks;
- ``sizes``: byte sizes parsed and printed ("6GB", "1.2 GiB");
- ``loop``: the event loop (uvloop where installed) and ``run``;
- ``fdlimit``: mlx-lm's import kept from breaking or lowering the open-file limit;
- ``allocator``: what malloc and MLX's cache may keep, bounded under ``--memory``;
- ``blas``: an optional faster BLAS under MLX's CPU matmuls (``SMOE_CPU_BLAS``);
- ``cache``: where S-MoE keeps what it can make again (demo vaults, probe figures);
- ``provenance``: the command, commit and machine stamped on every benchmark report;
- ``tokens``: token-list helpers shared by the compute thread and the servers.
"""
