"""The `smoe` subcommands, one module per group: each holds its commands' `cmd_*`
functions beside the `add_*` parser builders that wire them up, and imports the heavy
libraries (MLX, torch, tqdm) only inside the command that needs them, so `smoe --help`
stays fast. smoe.cli assembles the parser and runs the chosen command.
"""
