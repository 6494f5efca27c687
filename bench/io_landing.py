"""Does the landing memory explain `bench io`'s gap? The raw baseline with 1 landing buffer
per thread (as `bench io` runs it) and with a ring of them (as the streamer lands reads),
beside the streamer, alternating, on one vault. Prints JSON.

    python bench/io_landing.py VAULT [--workers 1,8] [--repeats 4] [--reads 160] [--slots 64]
"""

from __future__ import annotations

import json
import random
import statistics
import sys

import harness

from smoe.bench.io import streamer_run
from smoe.io.disk_probe import baseline_run, drop_file_cache
from smoe.vault.format import Vault


def main() -> None:
    ap = harness.parser(__doc__)
    harness.vault(ap)
    harness.workers(ap, type=str, default="1,8", metavar="N1,N2,...")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--reads", type=int, default=160)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--path", default="unified")
    args = ap.parse_args()
    vault = Vault.open(args.vault)
    m = vault.manifest
    rng = random.Random(0)
    streamer_run(vault, rng.sample(range(m.num_records), 8), 2, args.slots, 8, args.path)
    rows = []
    for w in [int(x) for x in args.workers.split(",")]:
        runs: dict[str, list[float]] = {"one_buffer": [], "ring_buffers": [], "streamer": []}
        for _ in range(args.repeats):
            for kind in runs:
                sample = rng.sample(range(m.num_records), args.reads)
                drop_file_cache(vault.experts_path)
                if kind == "streamer":
                    r = streamer_run(vault, sample, w, args.slots, 8, args.path)
                else:
                    bufs = 1 if kind == "one_buffer" else max(1, args.slots // w)
                    r = baseline_run(vault.experts_path, m.record.stride, sample, w, bufs)
                runs[kind].append(r.gbps)
        row = {"workers": w, **{k: round(statistics.median(v), 3) for k, v in runs.items()}}
        row["streamer_vs_one"] = round(row["streamer"] / row["one_buffer"], 3)
        row["streamer_vs_ring"] = round(row["streamer"] / row["ring_buffers"], 3)
        row["runs"] = {k: [round(x, 3) for x in v] for k, v in runs.items()}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)  # progress
    harness.report(
        {
            "benchmark": "io_landing",
            "vault": args.vault,
            "slots": args.slots,
            "reads": args.reads,
            "path": args.path,
            "rows": rows,
        },
        args,
    )


if __name__ == "__main__":
    main()
