"""`python bench/io.py VAULT [options]` == `smoe bench io VAULT [options]` (prints JSON)."""

import sys

from smoe.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "io", *sys.argv[1:]]))
