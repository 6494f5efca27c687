"""Is mlx-lm's own answer repeatable on the GPU? gpt_oss at 16 bits missed mlx-lm's first
token on some prompts and not others, and which prompts changed from run to run
(docs/gpu.md, "One greedy request, one answer"); the prompts that missed were those whose
chunk routes 64 or more (token, expert) pairs, where mlx-lm's SwitchGLU sorts them and
calls ``gather_mm`` with ``sorted_indices``. This runs, in one process: ``gather_mm`` on
the same bfloat16 inputs again and again, sorted and not; then mlx-lm's prefill of each
test prompt again and again. Prints one JSON report: how many distinct results each gave.
With ``--processes N`` it also runs each prompt's prefill once in each of N fresh
processes (a process's first call is what a fresh server makes), and counts the distinct
results across them.

    python bench/gpu/sort_determinism.py [--arch gpt_oss] [--bits 16] [--repeats 8] [--processes 8]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402


def digest(a: mx.array) -> str:
    mx.eval(a)
    return hashlib.sha1(np.array(a.astype(mx.float32)).tobytes()).hexdigest()[:12]


def gather_mm_repeats(rows: int, repeats: int, sort: bool) -> int:
    """Distinct results of one gather_mm over ``rows`` routed rows, ``repeats`` times."""
    rng = np.random.default_rng(0)
    experts, d, f = 8, 256, 512
    x = mx.array(rng.standard_normal((rows, 1, d)), dtype=mx.bfloat16)
    w = mx.array(rng.standard_normal((experts, d, f)) * 0.05, dtype=mx.bfloat16)
    idx = mx.array(rng.integers(0, experts, rows).astype(np.uint32))
    if sort:
        order = mx.argsort(idx)
        x, idx = x[order], idx[order]
    seen = {
        digest(mx.gather_mm(x, w, rhs_indices=idx, sorted_indices=sort)) for _ in range(repeats)
    }
    return len(seen)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="gpt_oss")
    p.add_argument("--bits", type=int, default=16)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--processes", type=int, default=0, help="fresh processes (0: none)")
    p.add_argument("--child", nargs=2, metavar=("MODEL", "PROMPTS"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:  # one fresh process: each prompt's prefill once, digests on stdout
        print(json.dumps(prefill_digests(a.child[0], json.loads(a.child[1]), 1)))
        return
    report: dict = {"device": str(mx.default_device()), "gather_mm": {}}
    for rows in (16, 64, 92, 256):
        for sort in (False, True):
            key = f"rows {rows}, sorted {sort}"
            try:
                report["gather_mm"][key] = gather_mm_repeats(rows, a.repeats, sort)
            except RuntimeError as e:  # (the CPU's gather_mm is float32 only)
                report["gather_mm"][key] = str(e)
    from smoe.synth import synthesize
    from smoe.vault.convert import ConvertOptions, convert
    from smoe.vault.export import export_mlx

    root = Path(tempfile.mkdtemp())
    src = synthesize(root / "hf", arch=a.arch, preset="demo", seed=1)
    vault = convert(src, root / "v", ConvertOptions(bits=a.bits))
    exported = export_mlx(vault, root / "mlx")
    vocab = min(4000, int(vault.config()["vocab_size"]))
    prompts = [
        np.random.default_rng(20 + i).integers(10, vocab, 5 + 9 * i).tolist() for i in range(8)
    ]
    names = [f"prompt {i} ({len(p)} tokens)" for i, p in enumerate(prompts)]
    runs = prefill_digests(str(exported), prompts, a.repeats)
    report["prefill"] = {n: len(set(d)) for n, d in zip(names, runs, strict=True)}
    if a.processes:
        fresh: list[set[str]] = [set() for _ in prompts]
        for _ in range(a.processes):
            child = [sys.executable, __file__, "--child", str(exported), json.dumps(prompts)]
            out = subprocess.run(child, check=True, capture_output=True, text=True).stdout
            for seen, (d,) in zip(fresh, json.loads(out), strict=True):
                seen.add(d)
        report["prefill_across_processes"] = {
            n: len(seen) for n, seen in zip(names, fresh, strict=True)
        }
        report["processes"] = a.processes
    print(json.dumps({"arch": a.arch, "bits": a.bits, "repeats": a.repeats, **report}, indent=1))


def prefill_digests(model_path: str, prompts: list[list[int]], repeats: int) -> list[list[str]]:
    """mlx-lm's last-position logits of each prompt's prefill, ``repeats`` times each, as
    digests (a fresh KV cache each time)."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(model_path))
    runs = []
    for prompt in prompts:
        seen = []
        for _ in range(repeats):
            cache = make_prompt_cache(model)
            seen.append(digest(model(mx.array(prompt)[None], cache=cache)[0, -1]))
        runs.append(seen)
    return runs


if __name__ == "__main__":
    main()
