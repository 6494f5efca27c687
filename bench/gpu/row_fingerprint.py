"""Which MLX ops give a row other bits when other rows share the call (issue 26).

For every op a decode step uses, row r is computed alone (the shape a solo decode step
gives it) and then among 1-16 others, in each form the engine can call it: a batch of
sequences, a chunk of one sequence's tokens, a part of a call (a wave, a bank), split into
pieces, padded. Each form's rows are compared bit for bit with the same rows alone. MLX
only (no S-MoE), so the table describes the kernels, on whatever device runs it:

    python bench/gpu/row_fingerprint.py [--quick] > fingerprint.json

Prints JSON: per op and geometry, per form, the rows that differ from alone (0 = the
form is row-invariant there) and the largest difference.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from typing import Any

import mlx.core as mx
import numpy as np

GEOMETRIES = {
    # D: hidden, F: an expert's inner size, E: experts, K: top-k, V: vocabulary
    "demo": dict(D=256, F=128, E=32, K=4, V=4096),
    "q30": dict(D=2048, F=768, E=128, K=8, V=32768),
}
BATCHES = [1, 2, 3, 4, 6, 7, 8, 9, 12, 16]


def differ(a: mx.array, b: mx.array) -> tuple[int, float]:
    """(rows of a that are not bitwise b's, the largest |a - b|); rows: the first axis."""
    a32, b32 = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
    a2, b2 = a32.reshape(a32.shape[0], -1), b32.reshape(b32.shape[0], -1)
    rows = int(np.sum(np.any(a2 != b2, axis=1)))
    return rows, float(np.max(np.abs(a2 - b2))) if a2.size else 0.0


def form_result(name: str, got: mx.array, alone: mx.array, table: dict[str, Any]) -> None:
    rows, worst = differ(got, alone)
    table[name] = {"rows_differing": rows, "of": int(got.shape[0]), "max_abs": worst}


def rand(shape: tuple[int, ...], dtype: mx.Dtype, key: int) -> mx.array:
    return (mx.random.normal(shape, key=mx.random.key(key)) * 0.5).astype(dtype)


# ------------------------------------------------------------------------- dense matmuls
def dense_op(bits: int | None, D: int, N: int, dtype: mx.Dtype):
    """y = x @ W.T for a [N, D] weight: quantized (bits) or float."""
    w = rand((N, D), dtype, 1)
    if bits is None:
        wt = w.T

        def f(x: mx.array) -> mx.array:
            return x @ wt

        return f
    wq, s, b = mx.quantize(w, group_size=64, bits=bits)

    def g(x: mx.array) -> mx.array:
        return mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64, bits=bits)

    return g


def probe_dense(f, D: int, dtype: mx.Dtype, n: int) -> dict[str, Any]:
    x = rand((n, 1, D), dtype, 2)  # n sequences' rows
    alone = mx.concatenate([f(x[i : i + 1]) for i in range(n)], axis=0)  # [n, 1, N]
    mx.eval(alone)
    table: dict[str, Any] = {}
    for b in BATCHES:
        if b > n:
            continue
        form_result(f"batch{b}", f(x[:b]), alone[:b], table)  # [b, 1, D]: b sequences
        chunk = f(x[:b].reshape(1, b, D)).reshape(b, 1, -1)  # [1, b, D]: b tokens of one
        form_result(f"chunk{b}", chunk, alone[:b], table)
    for piece in (1, 7):
        parts = [f(x[i : i + piece]) for i in range(0, n, piece)]
        form_result(f"pieces{piece}_of{n}", mx.concatenate(parts, axis=0), alone, table)
    return table


# ------------------------------------------------------------------------- gathered experts
def gather_op(bits: int | None, E: int, N: int, D: int, dtype: mx.Dtype):
    """mlx-lm's SwitchLinear call: y[t, r] = x[t] @ W[idx[t, r]].T (quantized or float)."""
    w = rand((E, N, D), dtype, 3)
    if bits is None:
        wt = w.swapaxes(-1, -2)

        def f(x: mx.array, idx: mx.array, sort: bool = False) -> mx.array:
            return mx.gather_mm(x, wt, rhs_indices=idx, sorted_indices=sort)

        return f
    wq, s, b = mx.quantize(w, group_size=64, bits=bits)

    def g(x: mx.array, idx: mx.array, sort: bool = False) -> mx.array:
        return mx.gather_qmm(
            x,
            wq,
            s,
            b,
            rhs_indices=idx,
            transpose=True,
            group_size=64,
            bits=bits,
            sorted_indices=sort,
        )

    return g


def probe_gather(f, D: int, E: int, K: int, dtype: mx.Dtype, n: int) -> dict[str, Any]:
    """n tokens, each routed to K experts; rows are (token, rank) pairs."""
    x = rand((n, D), dtype, 4)
    rng = np.random.default_rng(5)
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(n)]).astype(np.uint32)
    # Alone: each token as a solo decode step calls it ([1,1,1,1,D], [1,1,K]).
    alone = mx.concatenate(
        [f(x[t][None, None, None, None], mx.array(idx[t][None, None])) for t in range(n)]
    ).reshape(n * K, -1)  # [(t, r), N]
    mx.eval(alone)
    table: dict[str, Any] = {}
    for b in BATCHES:
        if b > n:
            continue
        got = f(x[:b][:, None, None, None], mx.array(idx[:b][:, None]))  # b sequences
        form_result(f"batch{b}", got.reshape(b * K, -1), alone[: b * K], table)
        # mlx-lm's sorted path (it sorts from 64 pairs up): rows [P, 1, D], idx [P]
        flat = idx[:b].reshape(-1)
        order = np.argsort(flat, kind="stable")
        xs = x[:b][mx.array(order // K)][:, None]
        got = f(xs, mx.array(flat[order]), sort=True)[:, 0]
        back = mx.zeros_like(got)
        back[mx.array(order)] = got
        form_result(f"sorted{b}", back, alone[: b * K], table)
    # Parts (waves, banks): the pairs of some experts, one row each ([P,1,1,D], [P,1]).
    pairs = n * K
    flat_x = mx.repeat(x, K, axis=0)  # [(t, r), D]
    flat_i = idx.reshape(-1)
    for p in (1, 3, 7, 8, 9, 16):
        if p > pairs:
            continue
        got = f(flat_x[:p][:, None, None], mx.array(flat_i[:p][:, None]))
        form_result(f"part{p}", got.reshape(p, -1), alone[:p], table)
        if p < 8:  # padded to 8 rows by repeating the last: the extra rows are dropped
            pad = [*range(p), *([p - 1] * (8 - p))]
            got = f(flat_x[mx.array(pad)][:, None, None], mx.array(flat_i[pad][:, None]))
            form_result(f"part{p}_padded8", got.reshape(8, -1)[:p], alone[:p], table)
    for piece in (K, 7):
        parts = [
            f(flat_x[s : s + piece][:, None, None], mx.array(flat_i[s : s + piece][:, None]))
            for s in range(0, pairs, piece)
        ]
        got = mx.concatenate(parts).reshape(pairs, -1)
        form_result(f"pieces{piece}_of{pairs}", got, alone, table)
    return table


# ------------------------------------------------------------------------- row-wise ops
def probe_rowwise(D: int, E: int, K: int, dtype: mx.Dtype, n: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    x = rand((n, 1, D), dtype, 6)
    wn = rand((D,), dtype, 7)
    gates = rand((n, 1, E), dtype, 8)
    y = rand((n, 1, K, D), dtype, 9)
    s = mx.softmax(rand((n, 1, K), mx.float32, 10), axis=-1).astype(dtype)

    ops = {
        "rms_norm": lambda a: mx.fast.rms_norm(a, wn, 1e-6),
        "softmax_precise": lambda a: mx.softmax(a, axis=-1, precise=True),
        "argpartition_topk": lambda a: mx.argpartition(a, kth=-K, axis=-1)[..., -K:],
        "sum_last": lambda a: a.sum(axis=-1, keepdims=True),
        "logsumexp": lambda a: mx.logsumexp(a, axis=-1, keepdims=True),
    }
    inputs = {
        "rms_norm": x,
        "softmax_precise": gates,
        "argpartition_topk": gates,
        "sum_last": gates,
        "logsumexp": gates,
    }
    for name, op in ops.items():
        a = inputs[name]
        alone = mx.concatenate([op(a[i : i + 1]) for i in range(n)])
        mx.eval(alone)
        t: dict[str, Any] = {}
        for b in BATCHES:
            if b <= n:
                form_result(f"batch{b}", op(a[:b]), alone[:b], t)
                ch = op(a[:b].reshape(1, b, *a.shape[2:])).reshape(b, *alone.shape[1:])
                form_result(f"chunk{b}", ch, alone[:b], t)
        out[name] = t

    def combine(yy: mx.array, ss: mx.array) -> mx.array:  # mlx-lm's MoE combination
        return (yy * ss[..., None]).sum(axis=-2)

    alone = mx.concatenate([combine(y[i : i + 1], s[i : i + 1]) for i in range(n)])
    t = {}
    for b in BATCHES:
        if b <= n:
            form_result(f"batch{b}", combine(y[:b], s[:b]), alone[:b], t)
    out["moe_combine"] = t
    return out


def probe_attention(dtype: mx.Dtype, H: int = 16, Hkv: int = 4, hd: int = 128, T: int = 37):
    """A verify pass (L query rows against the cache and each other, causal) against L
    decode steps (one row each, its keys/values appended first), and RoPE likewise."""
    out: dict[str, Any] = {}
    keys = rand((1, Hkv, T, hd), dtype, 11)
    values = rand((1, Hkv, T, hd), dtype, 12)
    scale = hd**-0.5
    t_attn: dict[str, Any] = {}
    t_rope: dict[str, Any] = {}
    for L in (2, 3, 5, 8):
        q = rand((1, H, L, hd), dtype, 13)
        k = rand((1, Hkv, L, hd), dtype, 14)
        v = rand((1, Hkv, L, hd), dtype, 15)
        K_all = mx.concatenate([keys, k], axis=2)
        V_all = mx.concatenate([values, v], axis=2)
        full = mx.fast.scaled_dot_product_attention(q, K_all, V_all, scale=scale, mask="causal")
        rows = [
            mx.fast.scaled_dot_product_attention(
                q[:, :, j : j + 1],
                K_all[:, :, : T + j + 1],
                V_all[:, :, : T + j + 1],
                scale=scale,
            )
            for j in range(L)
        ]
        alone = mx.concatenate(rows, axis=2)
        form_result(f"verify{L}", full.transpose(2, 0, 1, 3), alone.transpose(2, 0, 1, 3), t_attn)
        r_full = mx.fast.rope(q, hd, traditional=False, base=1e6, scale=1.0, offset=T)
        r_rows = mx.concatenate(
            [
                mx.fast.rope(
                    q[:, :, j : j + 1], hd, traditional=False, base=1e6, scale=1.0, offset=T + j
                )
                for j in range(L)
            ],
            axis=2,
        )
        form_result(f"chunk{L}", r_full.transpose(2, 0, 1, 3), r_rows.transpose(2, 0, 1, 3), t_rope)
    out["sdpa"] = t_attn
    out["rope"] = t_rope
    return out


def _pad(a: mx.array, length: int, side: str) -> mx.array:
    """[1, H, n, D] -> [1, H, length, D], zeros after (right) or before (left) the keys."""
    extra = length - a.shape[2]
    return mx.pad(a, [(0, 0), (0, 0), (0, extra) if side == "right" else (extra, 0), (0, 0)])


def probe_batched_attention(dtype: mx.Dtype, H: int = 16, Hkv: int = 4, hd: int = 128):
    """Decode rows of different lengths (each its own cache) in one call, against each row
    alone (no mask, its own keys): RoPE with each row's offset as an array, and attention
    over the rows' keys padded to the longest (right: each row's keys where its own cache
    has them; left: mlx-lm's batch cache) with a boolean or an additive mask."""
    scale = hd**-0.5
    t_attn: dict[str, Any] = {}
    t_rope: dict[str, Any] = {}
    for lengths in (
        (5, 37, 150, 300),
        (37, 700, 1500, 3000),
        (100, 101, 130, 255, 256, 257, 511, 999),
    ):
        B, Lmax = len(lengths), max(lengths)
        q = rand((B, H, 1, hd), dtype, 21)
        keys = [rand((1, Hkv, n, hd), dtype, 22 + i) for i, n in enumerate(lengths)]
        values = [rand((1, Hkv, n, hd), dtype, 42 + i) for i, n in enumerate(lengths)]
        alone = mx.concatenate(
            [
                mx.fast.scaled_dot_product_attention(q[i : i + 1], k, v, scale=scale)
                for i, (k, v) in enumerate(zip(keys, values, strict=True))
            ]
        )
        name = "x".join(map(str, lengths))
        for side in ("right", "left"):
            K = mx.concatenate([_pad(k, Lmax, side) for k in keys])
            V = mx.concatenate([_pad(v, Lmax, side) for v in values])
            pos = mx.arange(Lmax)[None, :]
            n_ = mx.array(lengths)[:, None]
            valid = pos < n_ if side == "right" else pos >= (Lmax - n_)  # [B, Lmax]
            boolean = valid[:, None, None, :]
            additive = mx.where(boolean, 0.0, -mx.inf).astype(dtype)
            for mname, mask in (("bool", boolean), ("additive", additive)):
                got = mx.fast.scaled_dot_product_attention(q, K, V, scale=scale, mask=mask)
                form_result(f"{side}_{mname}_{name}", got, alone, t_attn)
        offsets = [n - 1 for n in lengths]
        r_alone = mx.concatenate(
            [
                mx.fast.rope(q[i : i + 1], hd, traditional=False, base=1e6, scale=1.0, offset=o)
                for i, o in enumerate(offsets)
            ]
        )
        r_batch = mx.fast.rope(
            q, hd, traditional=False, base=1e6, scale=1.0, offset=mx.array(offsets)
        )
        form_result(f"offsets_{name}", r_batch, r_alone, t_rope)
    return {"sdpa": t_attn, "rope": t_rope}


def timed(fn, repeats: int = 30) -> float:
    """Median seconds of ``fn()`` evaluated, after a warm-up."""
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _rows_apart(f, x: mx.array) -> mx.array:
    return mx.concatenate([f(x[i : i + 1]) for i in range(x.shape[0])])


def _tokens_apart(g, x: mx.array, idx: mx.array) -> mx.array:
    return mx.concatenate([g(x[i : i + 1], idx[i : i + 1]) for i in range(x.shape[0])])


def probe_costs(dtype: mx.Dtype) -> dict[str, Any]:
    """What splitting costs at Qwen3-235B's sizes (D 4096, experts [1536, 4096], top-8,
    vocabulary 151936): one call for B rows against the pieces a solo row's kernel needs."""
    D, F, E, K, V = 4096, 1536, 128, 8, 151936
    out: dict[str, Any] = {}
    rng = np.random.default_rng(21)
    g = gather_op(4, E, F, D, dtype)
    denses = {
        "lmhead_float": dense_op(None, D, V, dtype),
        "lmhead_4bit": dense_op(4, D, V, dtype),
        "router_float": dense_op(None, D, E, dtype),
    }
    for B in (1, 4, 8):
        x = rand((B, 1, D), dtype, 20)
        for name, f in denses.items():
            out[f"{name}_B{B}_one_call_us"] = round(1e6 * timed(partial(f, x)), 1)
            out[f"{name}_B{B}_per_row_us"] = round(1e6 * timed(partial(_rows_apart, f, x)), 1)
        chosen = np.stack([rng.choice(E, K, replace=False) for _ in range(B)])
        idx = mx.array(chosen.astype(np.uint32))[:, None]  # [B, 1, K]
        xx = x[:, None, None]  # [B, 1, 1, 1, D]
        out[f"gather4_up_B{B}_one_call_us"] = round(1e6 * timed(partial(g, xx, idx)), 1)
        out[f"gather4_up_B{B}_per_token_us"] = round(
            1e6 * timed(partial(_tokens_apart, g, xx, idx)), 1
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the demo geometry only")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--costs", action="store_true", help="also time one call against pieces")
    ap.add_argument(
        "--attention-only", action="store_true", help="only the attention and RoPE probes"
    )
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    report: dict[str, Any] = {
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "dtype": args.dtype,
    }
    started = time.perf_counter()
    geos = {"demo": GEOMETRIES["demo"]} if args.quick else GEOMETRIES
    if args.attention_only:
        geos = {}
    for gname, g in geos.items():
        D, F, E, K, V = g["D"], g["F"], g["E"], g["K"], g["V"]
        n = 16
        r: dict[str, Any] = {}
        for bits in (4, 8, None):
            label = f"{bits}bit" if bits else "float"
            r[f"dense_{label}_N{F}"] = probe_dense(dense_op(bits, D, F, dtype), D, dtype, n)
            r[f"dense_{label}_router_N{E}"] = probe_dense(dense_op(bits, D, E, dtype), D, dtype, n)
            r[f"dense_{label}_lmhead_N{V}"] = probe_dense(dense_op(bits, D, V, dtype), D, dtype, n)
            try:
                r[f"gather_{label}_up"] = probe_gather(
                    gather_op(bits, E, F, D, dtype), D, E, K, dtype, n
                )
                r[f"gather_{label}_down"] = probe_gather(
                    gather_op(bits, E, D, F, dtype), F, E, K, dtype, n
                )
            except (RuntimeError, ValueError) as e:  # e.g. CPU gather_mm: float32 only
                r[f"gather_{label}"] = {"error": str(e).splitlines()[0]}
        r.update(probe_rowwise(D, E, K, dtype, n))
        report[gname] = r
        print(f"{gname}: done in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    report["attention"] = probe_attention(dtype)
    report["batched_attention"] = probe_batched_attention(dtype)
    if args.costs:
        report["costs"] = probe_costs(dtype)
    report["seconds"] = round(time.perf_counter() - started, 1)
    json.dump(report, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
