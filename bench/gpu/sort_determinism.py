"""Is mlx-lm's own answer repeatable on the GPU? gpt_oss at 16 bits missed mlx-lm's first
token on some prompts and not others, and which prompts changed from run to run
(docs/gpu.md, "One greedy request, one answer"); the prompts that missed were those whose
chunk routes 64 or more (token, expert) pairs, where mlx-lm's SwitchGLU sorts them and
calls ``gather_mm`` with ``sorted_indices``. This runs, in one process: ``gather_mm`` on
the same bfloat16 inputs again and again, sorted and not; then mlx-lm's prefill of each
test prompt again and again. Prints one JSON report: how many distinct results each gave.

    python bench/gpu/sort_determinism.py [--arch gpt_oss] [--bits 16] [--repeats 8]
"""

from __future__ import annotations

import argparse
import hashlib
import json
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
    a = p.parse_args()
    report: dict = {"device": str(mx.default_device()), "gather_mm": {}}
    for rows in (16, 64, 92, 256):
        for sort in (False, True):
            key = f"rows {rows}, sorted {sort}"
            try:
                report["gather_mm"][key] = gather_mm_repeats(rows, a.repeats, sort)
            except RuntimeError as e:  # (the CPU's gather_mm is float32 only)
                report["gather_mm"][key] = str(e)
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    from smoe.synth import synthesize
    from smoe.vault.convert import ConvertOptions, convert
    from smoe.vault.export import export_mlx

    root = Path(tempfile.mkdtemp())
    src = synthesize(root / "hf", arch=a.arch, preset="demo", seed=1)
    vault = convert(src, root / "v", ConvertOptions(bits=a.bits))
    model, _ = load_model(export_mlx(vault, root / "mlx"))
    vocab = min(4000, int(vault.config()["vocab_size"]))
    prompts = [
        np.random.default_rng(20 + i).integers(10, vocab, 5 + 9 * i).tolist() for i in range(8)
    ]
    report["prefill"] = {}
    for i, prompt in enumerate(prompts):
        seen = set()
        for _ in range(a.repeats):
            cache = make_prompt_cache(model)
            logits = model(mx.array(prompt)[None], cache=cache)[0, -1]
            seen.add(digest(logits))
        report["prefill"][f"prompt {i} ({len(prompt)} tokens)"] = len(seen)
    print(json.dumps({"arch": a.arch, "bits": a.bits, "repeats": a.repeats, **report}, indent=1))


if __name__ == "__main__":
    main()
