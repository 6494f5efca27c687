"""The plan of a conversion: which source parameters go where, and how each is encoded.

``ConversionPlan`` looks at an opened source checkpoint once, before anything is written:
which linear layers are routers, which backbone modules --backbone-bits quantizes, how an
MLX source packs its experts. It then hands out each layer's expert tensors and the
backbone's, encoded as asked but still lazy (smoe.vault.convert evaluates and writes them),
and says what the vault's config.json and manifest record about the encoding.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from smoe.errors import SmoeError
from smoe.models.checkpoint import SourceCheckpoint
from smoe.vault.convert_options import ConvertOptions


def _float_dtype(name: str | None) -> mx.Dtype | None:
    return None if name is None else getattr(mx, name)


def _cast(a: mx.array, dtype: mx.Dtype | None) -> mx.array:
    if dtype is not None and mx.issubdtype(a.dtype, mx.floating) and a.dtype != dtype:
        return a.astype(dtype)
    return a


class ConversionPlan:
    """Which source parameters go where, and how each is encoded (all still lazy).

    ``bits`` and ``group_size`` are the experts' packing, already checked against the
    options and the source (16 bits: float weights); ``opts`` gives the rest.
    """

    def __init__(
        self, ck: SourceCheckpoint, opts: ConvertOptions, bits: int, group_size: int
    ) -> None:
        self.ck = ck
        self.opts = opts
        self.source_q = ck.quantization
        self.bits, self.group_size = bits, group_size
        self.dtype = _float_dtype(opts.dtype)
        # mlx-lm's cast_predicate, read while the model is here (convert drops it early)
        self.castable = getattr(ck.model, "cast_predicate", None)
        self.prefixes = [m.path + "." for m in ck.experts]
        self.router_gates = self._router_gates()
        self.quantizable = self._quantizable_backbone()
        # e.g. {"model.layers.1.mlp.switch_mlp": ["down_proj", "gate_proj", "up_proj"]}
        self.projections = {
            m.path: sorted(
                {
                    k[len(m.path) + 1 :].rsplit(".", 1)[0]
                    for k in ck.params
                    if k.startswith(m.path + ".")
                }
            )
            for m in ck.experts
        }
        # How an MLX source packs each expert projection (None: float), checked to be the
        # same in every MoE layer: records share one layout.
        self.source_packing = self._source_packing() if self.source_q is not None else {}

    def _source_packing(self) -> dict[str, dict[str, Any] | None]:
        """{projection: {'mode', 'bits', 'group_size'} or None} of the source's experts, as
        mlx-lm's loader quantized them (per-path entries, else inferred from the shapes)."""
        modules = dict(self.ck.model.named_modules())

        def packing(path: str) -> dict[str, Any] | None:
            m = modules.get(path)
            if m is None or getattr(m, "bits", None) is None:
                return None
            return {
                "mode": getattr(m, "mode", "affine"),
                "bits": m.bits,
                "group_size": m.group_size,
            }

        def describe(p: dict[str, Any] | None) -> str:
            return "float" if p is None else f"{p['bits']} bits, group {p['group_size']}"

        first: dict[str, dict[str, Any] | None] | None = None
        first_path = ""
        for m in self.ck.experts:
            layer = {proj: packing(f"{m.path}.{proj}") for proj in self.projections[m.path]}
            if first is None:
                first, first_path = layer, m.path
                continue
            for proj, p in layer.items():
                if p != first.get(proj):
                    raise SmoeError(
                        f"the MLX source packs its experts differently from layer to layer "
                        f"({first_path}.{proj}: {describe(first.get(proj))}; {m.path}.{proj}: "
                        f"{describe(p)}), as mixed recipes like mixed_3_6 do, and a vault needs "
                        "one expert layout: convert the float checkpoint instead "
                        "(smoe convert HF_DIR VAULT --bits N), or a model quantized uniformly"
                    )
        return first or {}

    def _router_gates(self) -> set[str]:
        """Linear layers beside the experts whose outputs are one per expert: the routers."""
        n = self.ck.topology.num_experts
        gates = set()
        for m in self.ck.experts:
            parent = m.path.rsplit(".", 1)[0] + "."
            for name, a in self.ck.params.items():
                if (
                    name.startswith(parent)
                    and name.endswith(".weight")
                    and not any(name.startswith(p) for p in self.prefixes)
                    and a.ndim == 2
                    and a.shape[0] == n
                ):
                    gates.add(name[: -len(".weight")])
        return gates

    def _quantizable_backbone(self) -> set[str]:
        """Backbone modules that --backbone-bits quantizes (never routers or experts)."""
        if self.opts.backbone_bits is None:
            return set()
        gs = self.opts.backbone_group_size
        found = set()
        for name, module in self.ck.model.named_modules():
            w = self.ck.params.get(f"{name}.weight")
            if (
                hasattr(module, "to_quantized")
                and w is not None
                and w.ndim == 2
                and w.shape[-1] % gs == 0
                and f"{name}.scales" not in self.ck.params
                and name not in self.router_gates
                and not any((name + ".").startswith(p) for p in self.prefixes)
            ):
                found.add(name)
        return found

    def expert_tensors(self, module_path: str) -> dict[str, mx.array]:
        """One layer's expert components, stacked [E, ...], popped from the source (lazy)."""
        prefix = module_path + "."
        names = [k for k in self.ck.params if k.startswith(prefix)]
        out: dict[str, mx.array] = {}
        for name in names:
            a = self.ck.params.pop(name)
            short = name[len(prefix) :]
            if self.source_q is not None or self.bits == 16 or not short.endswith(".weight"):
                out[short] = _cast(a, self.dtype)  # an MLX source's packing is kept as is
                continue
            base = short[: -len(".weight")]
            try:
                w, scales, biases = mx.quantize(_cast(a, self.dtype), self.group_size, self.bits)
            except ValueError as e:
                raise SmoeError(
                    f"cannot quantize {name} {tuple(a.shape)} with group size "
                    f"{self.group_size}: {e}; pick another --group-size"
                ) from None
            out[f"{base}.weight"], out[f"{base}.scales"], out[f"{base}.biases"] = w, scales, biases
        return out

    def backbone_tensors(self) -> dict[str, mx.array]:
        """Every non-expert parameter, encoded as asked (lazy)."""
        out: dict[str, mx.array] = {}
        bb, gs = self.opts.backbone_bits, self.opts.backbone_group_size
        for name, a in self.ck.params.items():
            if any(name.startswith(p) for p in self.prefixes):
                continue
            module = name.rsplit(".", 1)[0]
            if name.endswith(".weight") and module in self.quantizable:
                w, s, b = mx.quantize(_cast(a, self.dtype), gs, bb)
                out[name], out[f"{module}.scales"], out[f"{module}.biases"] = w, s, b
            else:
                out[name] = _cast(a, self._dtype_of(name))
        return out

    def _dtype_of(self, name: str) -> mx.Dtype | None:
        """--dtype for a backbone tensor, unless mlx-lm's model never casts it (its
        ``cast_predicate``, as ``mlx_lm.convert --dtype`` honours: DeepSeek's
        e_score_correction_bias stays as stored)."""
        return self.dtype if self.castable is None or self.castable(name) else None

    def backbone_bytes(self) -> int:
        """backbone.safetensors as backbone_tensors() will write it: cast to --dtype, the
        --backbone-bits modules packed, the experts (still in ``ck.params``) left out."""
        total = 8
        bits, gs = self.opts.backbone_bits, self.opts.backbone_group_size
        for name, a in self.ck.params.items():
            if any(name.startswith(p) for p in self.prefixes):
                continue
            floating = mx.issubdtype(a.dtype, mx.floating)
            cast = self._dtype_of(name)
            item = cast.size if floating and cast is not None else a.dtype.size
            module = name.rsplit(".", 1)[0]
            if bits is not None and name.endswith(".weight") and module in self.quantizable:
                rows = a.size // a.shape[-1]
                # packed uint32 words, then scales and biases per group (3 header entries)
                total += rows * a.shape[-1] * bits // 8 + 2 * rows * (a.shape[-1] // gs) * item
                total += 3 * (len(name) + 96)
            else:
                total += a.size * item + len(name) + 96  # data, then its header entry
        return total

    def vault_config(self) -> dict[str, Any]:
        """config.json for the vault: mlx-lm-ready, with a 'quantization' entry that says
        how every quantized module was packed (so mlx-lm itself can load the weights)."""
        config = dict(self.ck.config)
        if self.source_q is not None:
            # Each expert projection's packing made explicit: mlx-lm's converter names only
            # the modules its predicate set apart, and the records are the rest's only trace.
            explicit = dict(self.source_q)
            for path in self.projections:
                for proj, packing in self.source_packing.items():
                    explicit[f"{path}.{proj}"] = dict(packing) if packing else False
            config["quantization"] = explicit
            if "quantization_config" in config:  # mlx-lm's copy for HF tooling
                config["quantization_config"] = explicit
            return config
        config.pop("quantization", None)
        config.pop("quantization_config", None)
        experts_q = self.bits != 16
        if not experts_q and not self.quantizable:
            return config
        if self.quantizable:
            q: dict[str, Any] = {
                "group_size": self.opts.backbone_group_size,
                "bits": self.opts.backbone_bits,
                "mode": "affine",
            }
        else:
            q = {"group_size": self.group_size, "bits": self.bits, "mode": "affine"}
        per_expert = (
            {"group_size": self.group_size, "bits": self.bits, "mode": "affine"}
            if experts_q
            else False
        )
        for path, projections in self.projections.items():
            for proj in projections:
                q[f"{path}.{proj}"] = per_expert
        for gate in self.router_gates:
            q.setdefault(gate, False)
        config["quantization"] = q
        return config

    def _source_experts_summary(self) -> dict[str, Any] | None:
        """The MLX source's expert packing: one setting, or each projection's (mixed)."""
        packs = list(self.source_packing.values())
        quantized = [p for p in packs if p is not None]
        if not quantized:
            return None
        if len(quantized) == len(packs) and all(p == quantized[0] for p in packs):
            return {**quantized[0], "copied_from_source": True}

        bits = {p["bits"] for p in quantized} | ({16} if len(quantized) < len(packs) else set())
        return {
            "mode": quantized[0]["mode"],
            "bits": "/".join(str(b) for b in sorted(bits)),  # e.g. "4/8" (16: float)
            "group_size": "/".join(str(g) for g in sorted({p["group_size"] for p in quantized})),
            "projections": dict(self.source_packing),
            "copied_from_source": True,
        }

    def quantization_summary(self) -> dict[str, Any]:
        if self.source_q is not None:
            experts: dict[str, Any] | None = self._source_experts_summary()
        elif self.bits == 16:
            experts = None
        else:
            experts = {"mode": "affine", "bits": self.bits, "group_size": self.group_size}
        backbone = (
            {
                "mode": "affine",
                "bits": self.opts.backbone_bits,
                "group_size": self.opts.backbone_group_size,
                "modules": len(self.quantizable),
            }
            if self.quantizable
            # the top-level setting; per-module entries stay in config.json
            else (
                {
                    **{k: v for k, v in self.source_q.items() if not isinstance(v, dict | bool)},
                    "copied_from_source": True,
                }
                if self.source_q
                else None
            )
        )
        return {"experts": experts, "backbone": backbone, "float_dtype": self.opts.dtype}
