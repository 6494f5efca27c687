"""How a vault's expert projections are packed, and the check that the records hold that.

A packing is ``(bits, group_size, mode)`` for quantized weights, or None for float ones.
``quant_entry`` reads one from a quantization entry (manifest.json or config.json);
``declared_packing`` says what manifest.json's quantization.experts declares for each
projection; ``projection_packing`` checks a record layout's components against mlx-lm's
expert module and that declaration, and returns what the components hold. Every failure is
a VaultError naming the field and the fix. This module imports no MLX.
"""

from __future__ import annotations

from typing import Any, NoReturn

from smoe.vault.checks import Check, show
from smoe.vault.layout import Component, RecordLayout

QUANT_BITS = (2, 3, 4, 5, 6, 8)
QUANT_MODES = ("affine", "mxfp4", "nvfp4", "mxfp8")
FLOAT_DTYPES = ("float16", "bfloat16", "float32")
# The parameters of mlx-lm's expert modules: a component is '<projection>.<part>'.
PROJECTIONS = {"SwitchGLU": ("gate_proj", "up_proj", "down_proj"), "SwitchMLP": ("fc1", "fc2")}
PARTS = ("weight", "scales", "biases", "bias", "global_scale")

Packing = tuple[int, int, str]  # (bits, group_size, mode)


def quant_entry(c: Check, value: Any, name: str) -> Packing:
    """A quantization entry ({"bits", "group_size", "mode"}): (bits, group_size, mode)."""
    e = c.obj(value, name)
    bits = c.key(e, "bits", name)
    if type(bits) is not int or bits not in QUANT_BITS:
        c.fail(
            f"{name}.bits", f"must be one of {', '.join(map(str, QUANT_BITS))}, not {show(bits)}"
        )
    group = c.int_(c.key(e, "group_size", name), f"{name}.group_size", 1, 1 << 16)
    mode = c.str_(e.get("mode", "affine"), f"{name}.mode", choices=QUANT_MODES)
    if "copied_from_source" in e:
        c.bool_(e["copied_from_source"], f"{name}.copied_from_source")
    return bits, group, mode


def declared_packing(
    experts: dict[str, Any] | None, projs: tuple[str, ...]
) -> dict[str, tuple[Packing | None, bool]]:
    """{projection: ((bits, group_size, mode) or None for float, exact)} as
    quantization.experts declares it (already validated). ``exact``: the records
    must hold exactly that. Vaults copied from an MLX source before "projections" was
    recorded state only the source's default packing, which its experts may override:
    config.json's entries are checked for those instead."""
    if experts is None:
        return {p: (None, True) for p in projs}
    per = experts.get("projections")
    if isinstance(per, dict):
        return {p: (None if per.get(p) is None else _packing(per[p]), True) for p in projs}
    exact = not experts.get("copied_from_source", False)
    return {p: (_packing(experts), exact) for p in projs}


def _packing(e: dict[str, Any]) -> Packing:
    return e["bits"], e["group_size"], e.get("mode", "affine")


def projection_packing(
    c: Check, record: RecordLayout, topology: dict[str, Any], quantization: dict[str, Any]
) -> dict[str, Packing | None]:
    """Check that the record's components are exactly the parameters of mlx-lm's expert
    module (topology.expert_kind), each projection packed as quantization.experts says,
    with shapes that fit each other and topology.expert_hidden_size, in one float dtype.
    Returns each projection's (bits, group_size, mode) as the shapes hold it, or None for
    float weights. Raises VaultError through ``c`` at the first problem."""
    kind = topology["expert_kind"]
    declared = declared_packing(quantization["experts"], PROJECTIONS[kind])
    check = _RecordCheck(c, record, kind)
    dims = check.dims(topology["expert_hidden_size"])
    held = {p: check.projection(p, *dims[p], *declared[p]) for p in check.projs}
    check.one_float_dtype(quantization.get("float_dtype"))
    return held


class _RecordCheck:
    """One record layout's components grouped by projection of mlx-lm's expert module
    ``kind``, checked one projection at a time; collects the float dtypes they hold."""

    def __init__(self, c: Check, record: RecordLayout, kind: str) -> None:
        self.c = c
        self.projs = PROJECTIONS[kind]
        self.floats: set[str] = set()
        self.labels = {
            comp.name: f"record.components[{i}] ({comp.name})"
            for i, comp in enumerate(record.components)
        }
        self.parts: dict[str, dict[str, Component]] = {p: {} for p in self.projs}
        for i, comp in enumerate(record.components):
            proj, _, part = comp.name.rpartition(".")
            if proj not in self.parts or part not in PARTS:
                c.fail(
                    f"record.components[{i}].name",
                    f"is {show(comp.name)}, not a parameter of mlx-lm's {kind} "
                    f"({', '.join(self.projs)} with {', '.join(PARTS)})",
                )
            self.parts[proj][part] = comp

    def bad(self, comp: Component, problem: str) -> NoReturn:
        self.c.fail(self.labels[comp.name], problem)

    def dims(self, expert_hidden_size: int) -> dict[str, tuple[int, int]]:
        """Each projection's weight [rows, cols], from the weights' rows: they chain
        hidden -> inner (gate/up, fc1) -> hidden (down, fc2)."""
        projs, parts = self.projs, self.parts
        for p in projs:
            if "weight" not in parts[p]:
                self.c.fail("record.components", f"lack {p}.weight")
            if len(parts[p]["weight"].shape) != 2:
                self.bad(
                    parts[p]["weight"], f"has shape {list(parts[p]['weight'].shape)}, not [out, in]"
                )
        out = {p: parts[p]["weight"].shape[0] for p in projs}
        hidden, inner = out[projs[-1]], out[projs[0]]
        if inner != expert_hidden_size:
            self.c.fail(
                "topology.expert_hidden_size",
                f"is {expert_hidden_size}, but {projs[0]}.weight has {inner} rows",
            )
        return {p: (hidden, inner) if p == projs[-1] else (inner, hidden) for p in projs}

    def projection(
        self, p: str, rows: int, cols: int, spec: Packing | None, exact: bool
    ) -> Packing | None:
        """Projection ``p``'s components against its declared packing ``spec`` (None:
        float): the parts it needs and no others, a [rows, cols] weight, its optional bias
        and global scale. Returns the packing its components hold."""
        parts = self.parts[p]
        mode = None if spec is None else spec[2]
        what = "float experts" if spec is None else f"{mode}-quantized experts"
        required = {"weight"} | ({"scales"} if spec else set())
        required |= {"biases"} if mode == "affine" else set()
        missing = sorted(required - set(parts))
        if missing:
            self.c.fail("record.components", f"lack {p}.{missing[0]}, which {what} have")
        allowed = required | {"bias"} | ({"global_scale"} if mode == "nvfp4" else set())
        for part, comp in parts.items():
            if part not in allowed:
                self.bad(comp, f"is not a parameter of {what}")
        w = parts["weight"]
        if w.shape[0] != rows:
            self.bad(w, f"has {w.shape[0]} rows, {rows} expected")
        held = None
        if spec is None:
            if w.dtype not in FLOAT_DTYPES or w.shape[1] != cols:
                self.bad(w, f"is {w.dtype}{list(w.shape)}; {what} have a float [{rows}, {cols}]")
            self.floats.add(w.dtype)
        else:
            held = self._quantized(p, rows, cols, spec, exact)
        self._bias_and_global_scale(parts, rows)
        return held

    def _quantized(self, p: str, rows: int, cols: int, spec: Packing, exact: bool) -> Packing:
        """A quantized projection: weights packed in uint32 words, scales (and, affine,
        biases) per group; returns (bits, group_size, mode) as their shapes say."""
        parts, mode = self.parts[p], spec[2]
        w, s = parts["weight"], parts["scales"]
        packed = w.shape[1] * 32
        if w.dtype != "uint32" or packed % cols or packed // cols not in QUANT_BITS:
            self.bad(w, f"is {w.dtype}{list(w.shape)}, not {cols} inputs packed in uint32 words")
        if len(s.shape) != 2 or s.shape[0] != rows or cols % s.shape[1]:
            self.bad(s, f"has shape {list(s.shape)}, not [{rows}, {cols} / group size]")
        if mode == "affine":
            b = parts["biases"]
            if s.dtype not in FLOAT_DTYPES or (b.dtype, b.shape) != (s.dtype, s.shape):
                self.bad(b, f"is {b.dtype}{list(b.shape)}, unlike scales {s.dtype}{list(s.shape)}")
            self.floats.add(s.dtype)
        elif s.dtype != "uint8":
            self.bad(s, f"is {s.dtype}; {mode} scales are uint8")
        got = (packed // cols, cols // s.shape[1], str(mode))
        if exact and got != spec:
            self.c.fail(
                "quantization.experts",
                "says {}-bit, group {} {} for {}, but the records hold {}-bit, group {} {}".format(
                    *spec, p, *got
                ),
            )
        return got

    def _bias_and_global_scale(self, parts: dict[str, Component], rows: int) -> None:
        if "bias" in parts:
            b = parts["bias"]
            if b.dtype not in FLOAT_DTYPES or b.shape != (rows,):
                self.bad(b, f"is {b.dtype}{list(b.shape)}, not a float [{rows}]")
            self.floats.add(b.dtype)
        if "global_scale" in parts:
            g = parts["global_scale"]
            if (g.dtype, g.shape) != ("float32", ()):
                self.bad(g, f"is {g.dtype}{list(g.shape)}, not one float32")

    def one_float_dtype(self, wanted: str | None) -> None:
        """The float components share one dtype: quantization.float_dtype where stated."""
        if len(self.floats) > 1:
            self.c.fail("record.components", f"mix float dtypes ({', '.join(sorted(self.floats))})")
        if wanted is not None and self.floats and self.floats != {wanted}:
            self.c.fail(
                "quantization.float_dtype",
                f"is {wanted}, the records hold {', '.join(self.floats)}",
            )
