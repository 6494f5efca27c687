"""Small helpers every layer may use (of S-MoE they import only its errors):

- ``files``: the one way S-MoE replaces files and directories (temp name, fsync,
  rename), crash recovery of replaced directories, file locks;
- ``sizes``: byte sizes parsed and printed ("6GB", "1.2 GiB");
- ``loop``: the event loop (uvloop where installed) and ``run``;
- ``fdlimit``: mlx-lm's import kept from breaking or lowering the open-file limit.
"""
