"""MLX's CPU matmuls through our C kernels (smoe._cpu_kernels): the same bits, every core.

On a Linux x86-64 CPU, MLX 0.32 computes its quantized matmuls with a scalar loop and its
float32 matmuls with a bundled reference BLAS, one core each (docs/performance.md, "CPU
arithmetic"). ``csrc/cpu_kernels.c`` performs the same operations in the same order, with
SIMD lanes across outputs or rows and threads across outputs, so each output's bits are
MLX's. This module is where the engine meets it:

- ``Native``: what runs here (the kernels and their instruction set, or why MLX's own);
- ``linear`` / ``quantized`` / ``gather``: ``x @ W.T (+ b)``, ``quantized_matmul`` and
  ``gather_qmm``/``gather_mm`` as MLX computes them on the CPU, for evaluated arrays;
- ``NativeLinear``, ``NativeEmbedding``, ``NativeSwitchLinear``: mlx-lm's layers with their
  matmul through the kernels where ``Native.accepts`` the call, else the layer's own;
- ``install_native``: wraps a model's layers (on the compute thread, after loading).

Each kind of call (float32, or a dtype x bits x group of the affine quantization) is
checked against MLX's own kernel on random data the first time it is met, in this
process: a kind whose bits differ (another MLX, another BLAS under ``SMOE_CPU_BLAS``) runs
MLX's kernel from then on, and ``Native.describe`` says so. The wrappers are exact only
where MLX computes on the CPU; the engine installs them for the CPU device only.
Errors: a kernel that cannot run a call (memory) raises MemoryError, as MLX would.
"""

from __future__ import annotations

import functools
import math
import os
import platform
import sys
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

# The instruction sets' names as the extension gives them.
ISAS = ("avx512", "avx2", "scalar")
QUANT_BITS = (2, 3, 4, 5, 6, 8)
QUANT_GROUPS = (32, 64, 128)
# Calls of fewer multiply-adds run MLX's own kernel (``Native.worth``): below ~2^18 the
# graph evaluation a hand-over costs exceeds the time saved (measured on 2 cores).
MIN_MACS = 1 << 18


def _load_extension() -> tuple[Any, str | None]:
    """The extension module, or None and why it cannot run here."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return (
            None,
            f"MLX's own kernels (ours reproduce its Linux x86-64 loops; this is {sys.platform} {platform.machine()})",
        )
    if os.environ.get("SMOE_CPU_KERNELS", "").lower() in ("0", "mlx", "off"):
        return None, "MLX's own kernels (SMOE_CPU_KERNELS=mlx)"
    try:
        from smoe import _cpu_kernels
    except ImportError:
        return (
            None,
            "MLX's own kernels (smoe._cpu_kernels was not built: reinstall with a C compiler)",
        )
    return _cpu_kernels, None


@dataclass
class Native:
    """The kernels of this process (one per process: ``Native.here()``)."""

    ext: Any  # smoe._cpu_kernels, or None
    why_not: str | None  # why MLX's own kernels run, where ext is None
    verified: dict[tuple[Any, ...], bool] = field(default_factory=dict)

    @staticmethod
    @functools.cache
    def here() -> Native:
        ext, why = _load_extension()
        return Native(ext, why)

    @property
    def on(self) -> bool:
        return self.ext is not None

    def isa(self) -> str | None:
        return None if self.ext is None else str(self.ext.isa())

    def describe(self) -> str:
        """For the start line: which arithmetic runs the matmuls on the CPU."""
        if self.ext is None:
            return str(self.why_not)
        failed = sorted(_kind_name(k) for k, ok in self.verified.items() if not ok)
        text = f"S-MoE's {self.isa()} kernels on {self.ext.threads()} cores, MLX's bits"
        if failed:
            text += f" (MLX's own for {', '.join(failed)}: bits differed here)"
        return text

    # ------------------------------------------------------------ which calls
    @staticmethod
    def worth(x: mx.array, n: int, rows: int | None = None) -> bool:
        """Whether a call of ``rows`` (default: x's) by ``n`` outputs is large enough for
        the kernels: handing one over evaluates MLX's graph up to it (~0.1 ms), which a
        small call's saving does not repay (the demo's decode measured 0.7x with every
        call handed over). Either way the bits are MLX's."""
        rows = math.prod(x.shape[:-1]) if rows is None else rows
        return rows * n * x.shape[-1] >= MIN_MACS

    def accepts_float(self, x: mx.array, w: mx.array, rows: int | None = None) -> bool:
        return (
            self.ext is not None
            and self.worth(x, w.shape[-2], rows)
            and x.dtype == mx.float32
            and w.dtype == mx.float32
            and self._verified(("float32",))
        )

    def accepts_quantized(
        self, x: mx.array, scales: mx.array, module: Any, rows: int | None = None
    ) -> bool:
        mode = getattr(module, "mode", "affine")
        bits, group = getattr(module, "bits", 0), getattr(module, "group_size", 0)
        return (
            self.ext is not None
            and self.worth(x, module["weight"].shape[-2], rows)
            and mode == "affine"
            and bits in QUANT_BITS
            and group in QUANT_GROUPS
            and x.dtype == scales.dtype
            and x.dtype in (mx.float32, mx.bfloat16)
            and "biases" in module
            and getattr(module, "global_scale", None) is None
            and self._verified(("quantized", str(x.dtype), bits, group))
        )

    def _verified(self, kind: tuple[Any, ...]) -> bool:
        ok = self.verified.get(kind)
        if ok is None:
            ok = self.verified[kind] = _matches_mlx(self.ext, kind)
        return ok


def _kind_name(kind: tuple[Any, ...]) -> str:
    if kind[0] == "float32":
        return "float32 matmul"
    _, dtype, bits, group = kind
    return f"{bits}-bit group {group} {str(dtype).split('.')[-1]}"


# ---------------------------------------------------------------- the calls
def _host(a: mx.array) -> np.ndarray:
    """An evaluated array's memory as numpy (bfloat16 as its uint16 bits), no copy."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    mx.eval(a)
    return np.asarray(a)


def _result(out: np.ndarray, bf16: bool) -> mx.array:
    y = mx.array(out)
    return y.view(mx.bfloat16) if bf16 else y


def linear(
    ext: Any, x: mx.array, w: mx.array, bias: mx.array | None = None, isa: str | None = None
) -> mx.array:
    """``x @ w.T`` (+ ``bias`` as ``mx.addmm`` adds it), float32: x [..., K], w [N, K].
    ``isa``: the instruction set to use (tests; None: the best this CPU has)."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = math.prod(lead)
    out = np.empty((rows, w.shape[0]), np.float32)
    ext.matmul(_host(x.reshape(rows, k)), _host(w), out, bias=None if bias is None else _host(bias))
    return mx.array(out).reshape(*lead, w.shape[0])


def quantized(ext: Any, x: mx.array, module: Any, isa: str | None = None) -> mx.array:
    """``mx.quantized_matmul(x, weight, scales, biases, transpose=True)`` of ``module``'s
    parameters (an affine QuantizedLinear or QuantizedEmbedding): x [..., K] -> [..., N]."""
    w, scales = module["weight"], module["scales"]
    lead, k = x.shape[:-1], x.shape[-1]
    rows, n = math.prod(lead), w.shape[0]
    bf16 = x.dtype == mx.bfloat16
    out = np.empty((rows, n), np.uint16 if bf16 else np.float32)
    ext.matmul(
        _host(x.reshape(rows, k)),
        _host(w),
        out,
        scales=_host(scales),
        biases=_host(module["biases"]),
        bits=module.bits,
        group=module.group_size,
        bf16=bf16,
        isa=isa,
    )
    return _result(out, bf16).reshape(*lead, n)


def gather(
    ext: Any, x: mx.array, module: Any, indices: mx.array, isa: str | None = None
) -> mx.array:
    """``gather_qmm`` (an affine QuantizedSwitchLinear) or ``gather_mm`` (a float
    SwitchLinear) of ``module``'s stacked weights [E, N, ...], as mlx-lm calls them: x
    [*xb, M, K] broadcast with indices [*ib] -> [*batch, M, N] (no bias added)."""
    w = module["weight"]
    m, k = x.shape[-2], x.shape[-1]
    n = w.shape[-2]
    xb = tuple(x.shape[:-2])
    idx = _host(indices)
    batch = np.broadcast_shapes(xb, idx.shape)
    if m == 1 and xb[:-1] == idx.shape[:-1] and xb[-1:] == (1,) and batch == idx.shape:
        # mlx-lm's unsorted call: x [..., T, 1, 1, K], indices [..., T, k]: row t, k times
        rows = np.repeat(np.arange(math.prod(xb), dtype=np.int32), idx.shape[-1])
    else:
        which = np.broadcast_to(np.arange(math.prod(xb)).reshape(xb), batch).reshape(-1)
        rows = (which[:, None] * m + np.arange(m)).reshape(-1).astype(np.int32)
    owners = np.repeat(np.broadcast_to(idx, batch).reshape(-1), m).astype(np.int32)
    quant = "scales" in module
    bf16 = x.dtype == mx.bfloat16
    out = np.empty((rows.size, n), np.uint16 if bf16 else np.float32)
    extra: dict[str, Any] = {}
    if quant:
        extra = dict(
            scales=_host(module["scales"]),
            biases=_host(module["biases"]),
            bits=module.bits,
            group=module.group_size,
            bf16=bf16,
        )
    ext.matmul(_host(x.reshape(-1, k)), _host(w), out, rows=rows, experts=owners, isa=isa, **extra)
    return _result(out, bf16).reshape(*batch, m, n)


# ---------------------------------------------------------------- checked against MLX
def _matches_mlx(ext: Any, kind: tuple[Any, ...]) -> bool:
    """Whether the kernels give MLX's CPU bits for this kind of call: few rows and many
    (both kernels), an output count with a tail, dense and gathered."""
    rng = np.random.default_rng(7)
    with mx.stream(mx.cpu):
        if kind[0] == "float32":
            for rows, n, k in ((1, 40, 300), (3, 33, 129), (20, 70, 256)):
                w = mx.array(rng.standard_normal((n, k)).astype(np.float32))
                x = mx.array(rng.standard_normal((rows, k)).astype(np.float32))
                b = mx.array(rng.standard_normal(n).astype(np.float32))
                if not (
                    _same(linear(ext, x, w), x @ w.T)
                    and _same(linear(ext, x, w, b), mx.addmm(b, x, w.T))
                ):
                    return False
            return True
        _, dtype_name, bits, group = kind
        dtype = getattr(mx, dtype_name.split(".")[-1])
        for rows, n, k in ((1, 40, 2 * group), (2, 33, 4 * group), (20, 70, 2 * group)):
            lin = nn.QuantizedLinear(k, n, bias=False, group_size=group, bits=bits)  # type: ignore[attr-defined]
            lin.update(
                {
                    "weight": mx.quantize(
                        mx.array(rng.standard_normal((n, k)).astype(np.float32)).astype(dtype),
                        group_size=group,
                        bits=bits,
                    )[0],
                    "scales": (mx.array(rng.uniform(0.01, 0.1, (n, k // group))).astype(dtype)),
                    "biases": (mx.array(rng.uniform(-0.5, 0.5, (n, k // group))).astype(dtype)),
                }
            )
            x = mx.array(rng.standard_normal((rows, k)).astype(np.float32)).astype(dtype)
            if not _same(quantized(ext, x, lin), lin(x)):
                return False
        return True


def _same(a: mx.array, b: mx.array) -> bool:
    mx.eval(a, b)
    return bool(mx.array_equal(a, b, equal_nan=True).item())


# ---------------------------------------------------------------- the layers
class NativeLinear(nn.Module):  # type: ignore[misc, name-defined]  # mlx.nn: untyped
    """An nn.Linear or affine nn.QuantizedLinear computed by the kernels (its own call
    where they do not take it)."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner
        object.__setattr__(self, "_native", Native.here())

    @property
    def weight(self) -> mx.array:  # what others find a linear layer by
        return self.inner["weight"]  # type: ignore[no-any-return]

    def __call__(self, x: mx.array) -> mx.array:
        native, inner = self._native, self.inner
        if "scales" in inner:
            if not native.accepts_quantized(x, inner["scales"], inner):
                return inner(x)  # type: ignore[no-any-return]
            y = quantized(native.ext, x, inner)
            return y + inner["bias"] if "bias" in inner else y
        if not native.accepts_float(x, inner["weight"]):
            return inner(x)  # type: ignore[no-any-return]
        return linear(native.ext, x, inner["weight"], inner.get("bias"))


class NativeEmbedding(nn.Module):  # type: ignore[misc, name-defined]
    """An embedding whose ``as_linear`` (a tied LM head) is computed by the kernels; its
    lookup is the embedding's own."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner
        object.__setattr__(self, "_native", Native.here())

    @property
    def weight(self) -> mx.array:
        return self.inner["weight"]  # type: ignore[no-any-return]

    def __call__(self, x: mx.array) -> mx.array:
        return self.inner(x)  # type: ignore[no-any-return]

    def as_linear(self, x: mx.array) -> mx.array:
        native, inner = self._native, self.inner
        if "scales" in inner:
            if native.accepts_quantized(x, inner["scales"], inner):
                return quantized(native.ext, x, inner)
        elif native.accepts_float(x, inner["weight"]):
            return linear(native.ext, x, inner["weight"])
        return inner.as_linear(x)  # type: ignore[no-any-return]


class NativeSwitchLinear(nn.Module):  # type: ignore[misc, name-defined]
    """mlx-lm's SwitchLinear / affine QuantizedSwitchLinear (one projection of the
    experts) computed by the kernels; the same call signature and result."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner
        object.__setattr__(self, "_native", Native.here())

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        native, inner = self._native, self.inner
        rows = indices.size * x.shape[-2]  # (token, expert) pairs times the rows of each
        if "scales" in inner:
            ok = native.accepts_quantized(x, inner["scales"], inner, rows)
        else:
            ok = native.accepts_float(x, inner["weight"], rows)
        if not ok:
            return inner(x, indices, sorted_indices=sorted_indices)  # type: ignore[no-any-return]
        y = gather(native.ext, x, inner, indices)
        if "bias" in inner:
            y = y + mx.expand_dims(inner["bias"][indices], -2)
        return y


def arithmetic(device: Any, installed: bool, asked_mlx: bool) -> str:
    """Whose kernels run the matmuls, for the start line: ``installed`` where the engine
    wrapped its layers (install_native), ``asked_mlx`` where --cpu-kernels mlx said so."""
    if device != mx.cpu:
        return f"MLX's kernels on the {str(device).split('(')[-1].split(',')[0]}"
    if installed:
        return Native.here().describe()
    if asked_mlx:
        return "MLX's own kernels (--cpu-kernels mlx)"
    return Native.here().describe()


def is_native(module: Any) -> bool:
    """Whether ``module`` (an expert MLP) computes its projections by the kernels."""
    return any(isinstance(c, NativeSwitchLinear) for c in module.children().values())


def install_native(model: Any, skip: Any = None) -> int:
    """Wrap ``model``'s linear layers, embeddings (for a tied head) and expert projections
    in the Native* layers, unless ``skip(path, parent)``. Call after the weights are loaded
    (the wrap changes parameter paths). Returns how many were wrapped; 0 where the kernels
    do not run here."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    if not Native.here().on:
        return 0
    kinds: list[tuple[tuple[type, ...], type]] = [
        ((nn.Linear, nn.QuantizedLinear), NativeLinear),  # type: ignore[attr-defined]
        ((nn.Embedding, nn.QuantizedEmbedding), NativeEmbedding),  # type: ignore[attr-defined]
        ((SwitchLinear, QuantizedSwitchLinear), NativeSwitchLinear),
    ]
    wrapped = 0
    for path, module in list(model.named_modules()):
        wrapper = next((w for k, w in kinds if type(module) in k), None)
        if wrapper is None:
            continue
        parent: Any = model
        parts = path.split(".")
        for part in parts[:-1]:
            parent = parent[int(part)] if part.isdigit() else getattr(parent, part)
        if skip is not None and skip(path, parent):
            continue
        if parts[-1].isdigit():
            parent[int(parts[-1])] = wrapper(module)
        else:
            setattr(parent, parts[-1], wrapper(module))
        wrapped += 1
    return wrapped


__all__ = [
    "Native",
    "arithmetic",
    "NativeEmbedding",
    "NativeLinear",
    "NativeSwitchLinear",
    "gather",
    "install_native",
    "is_native",
    "linear",
    "quantized",
]
