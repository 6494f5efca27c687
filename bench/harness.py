"""What every bench/ script shares: the arguments several of them take, spelled and
explained once, and one way to finish, a JSON report stamped with its provenance.

    import harness

    p = harness.parser(__doc__)        # the docstring as --help's text; --out PATH
    harness.vault(p)                   # VAULT
    harness.memory(p, required=True)   # --memory (ring=True: the ring's budget alone)
    harness.device(p)                  # --device {cpu,gpu}
    harness.rounds(p, default=3)       # --rounds N
    harness.workers(p, default=4)      # --workers N
    args = p.parse_args()
    ...
    harness.report({"benchmark": "name", ...}, args)

Each helper passes its keywords (default, type, required, nargs, action) to
``add_argument``; the help text is the harness's. ``report`` adds the command, commit,
machine and date (smoe.util.provenance) and prints the JSON, or with ``--out PATH``
writes it there atomically (a temporary name, fsync, rename: a file is whole or absent).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# `python bench/NAME.py` puts bench/, not the checkout, on sys.path: the checkout goes first
# so that `smoe` and `tests` (some scripts use its helpers, e.g. tests/cgroup.py) are its own.
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from smoe.commands.options import add_device  # noqa: E402
from smoe.util.files import write_json_atomic  # noqa: E402
from smoe.util.provenance import stamp  # noqa: E402


def parser(doc: str | None = None) -> argparse.ArgumentParser:
    """An ArgumentParser showing ``doc`` (the script's docstring) as written, with --out."""
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--out",
        dest="json_out",  # not "out": some scripts have an OUT positional of their own
        type=Path,
        default=None,
        metavar="PATH",
        help="write the JSON report to PATH (atomically) instead of printing it",
    )
    return p


def vault(p: argparse.ArgumentParser, demo: bool = False, **kw: Any) -> None:
    """The VAULT positional; ``demo``: optional, the script falling back to the demo's."""
    if demo:
        kw |= {"nargs": "?", "default": None}
    more = " (default: the demo's, built if missing)" if demo else ""
    p.add_argument("vault", metavar="VAULT", help=f"a vault `smoe convert` wrote{more}", **kw)


_MEMORY = {
    False: "the whole process's memory budget, as `smoe generate --memory` takes it",
    True: "the expert ring's budget alone: a size (of expert records), a share like 25%%, "
    "min, half or all",
}


def memory(p: argparse.ArgumentParser, ring: bool = False, **kw: Any) -> None:
    """--memory: the whole process's budget, as `smoe generate --memory` takes it, or with
    ``ring`` the expert ring's alone (smoe.bench.generate.budget_slots)."""
    text = _MEMORY[ring]
    if kw.get("action") == "append":
        text += " (repeatable)"
    p.add_argument("--memory", help=text, **kw)


def device(p: argparse.ArgumentParser) -> None:
    """--device {cpu,gpu}, default MLX's: the same option as the smoe commands'."""
    add_device(p)


def rounds(p: argparse.ArgumentParser, **kw: Any) -> None:
    """--rounds N: how many times the measurement repeats (alternating what it compares)."""
    p.add_argument("--rounds", type=int, help="measured rounds (default %(default)s)", **kw)


def workers(p: argparse.ArgumentParser, **kw: Any) -> None:
    """--workers: the I/O threads."""
    kw.setdefault("type", int)
    p.add_argument("--workers", help="I/O threads (default %(default)s)", **kw)


def report(data: dict[str, Any], args: argparse.Namespace | None = None) -> dict[str, Any]:
    """Stamp ``data`` with its provenance and print it as indented JSON, or write it to
    ``--out`` (``args.json_out``). Returns the stamped report."""
    stamped = stamp(data)
    out = getattr(args, "json_out", None)
    if out is None:
        print(json.dumps(stamped, indent=1), flush=True)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out, stamped)
    return stamped
