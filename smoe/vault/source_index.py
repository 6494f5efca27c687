"""Where each expert's bytes lie in a downloaded checkpoint: the source index.

``SourceIndex.build`` reads every shard's header (``smoe.vault.source_header``, validated),
finds the routed experts' tensors by name, and gives each (MoE layer, expert) the record
layout a vault converted without re-quantization would use (``smoe convert --bits 16`` for
a float source, the copied-as-is packing for an MLX-quantized one) and the list of file
extents that fill it. Extents adjacent in one file are merged, so an expert is as few
reads as the layout allows: a Hugging Face shard stores one expert's three projections
side by side (one read); an mlx-community shard stacks each component over the experts
(one read per component). Names understood (mlx-lm's ``sanitize`` stacks the first two):

    <prefix>.experts.<e>.<proj>.<part>       per expert (Qwen, OLMoE, DeepSeek; Mixtral's
                                             w1/w2/w3 are gate/down/up)
    <prefix>.switch_mlp.<proj>.<part>        stacked [E, ...] (mlx-community, mlx-lm's own)

Anything else that holds experts (fused gate_up tensors, gpt-oss, FP8 blocks) is refused
naming ``smoe convert``. No MLX import.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from smoe.errors import CheckpointError, UnsupportedModelError
from smoe.models.topology import EXPERT_COUNT_KEYS, layer_of
from smoe.util.files import NotRegularFile, open_regular
from smoe.vault.layout import ITEMSIZE, RecordLayout
from smoe.vault.manifest import ExpertLayer
from smoe.vault.source_header import DTYPES, REDOWNLOAD, TensorEntry, read_header

CONVERT = "convert it instead: smoe convert SRC VAULT"
INDEX_FILE = "model.safetensors.index.json"
MAX_INDEX_BYTES = 64 << 20

# Architectures whose mlx-lm sanitize only renames and stacks per-expert tensors, which an
# index can express (each entry: source projection name -> mlx-lm's).
_GLU = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
STREAMABLE: dict[str, dict[str, str]] = {
    "qwen3_moe": _GLU,
    "qwen2_moe": _GLU,
    "olmoe": _GLU,
    "deepseek_v2": _GLU,
    "mixtral": {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"},
}
PROJ_ORDER = ("gate_proj", "up_proj", "down_proj")  # mlx-lm's SwitchGLU, as convert writes
PART_ORDER = ("weight", "scales", "biases", "bias")
SAFETENSORS_NAME = {ours: code for code, (ours, _) in DTYPES.items()}  # bfloat16 -> BF16
_PER_EXPERT = re.compile(r"^(.+)\.experts\.(\d+)\.([A-Za-z0-9_]+)\.(weight|scales|biases|bias)$")
_STACKED = re.compile(r"^(.+\.switch_mlp)\.([A-Za-z0-9_]+)\.(weight|scales|biases|bias)$")


@dataclass(frozen=True)
class Piece:
    """Bytes [src, src + nbytes) of an extent go to record offset ``dst``."""

    src: int
    dst: int
    nbytes: int


@dataclass(frozen=True)
class Extent:
    """One read: ``length`` bytes of file ``file`` (an index into ``SourceIndex.files``)
    from ``offset``, scattered into the record by its pieces."""

    file: int
    offset: int
    length: int
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class _Slice:
    """One component of one expert: where its bytes are, its dtype and shape."""

    file: Path
    start: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


@dataclass
class SourceIndex:
    """The experts of a checkpoint folder as records: one layout, extents per record
    (layer-major, as a vault orders them), and the shards they come from."""

    files: tuple[Path, ...]
    layout: RecordLayout
    layers: tuple[ExpertLayer, ...]
    num_experts: int
    extents: list[tuple[Extent, ...]]
    stacked: bool  # the experts are stacked per component (mlx-community layout)
    expert_bytes: int  # bytes of expert tensors in the shards
    total_bytes: int  # bytes of all tensors in the shards
    # The non-expert tensors of every shard, as a safetensors header lists them
    # ({name: {"dtype": "BF16", "shape": [...]}}): what the backbone is sized from.
    backbone_header: dict[str, dict[str, Any]]

    def reads_per_expert(self) -> float:
        """Mean extents (reads) per record."""
        return sum(len(e) for e in self.extents) / max(1, len(self.extents))

    @classmethod
    def build(cls, folder: Path, config: dict[str, Any]) -> SourceIndex:
        """Index ``folder`` (see the module docstring); ``config`` is its config.json.
        Raises CheckpointError for missing or damaged files, UnsupportedModelError for
        experts the index cannot express (both naming the fix)."""
        model_type = str(config.get("model_type"))
        files, weight_map = shard_files(folder)
        tensors: dict[str, TensorEntry] = {}
        for f in files:
            for name, entry in read_header(f).tensors.items():
                if name in tensors:
                    raise CheckpointError(
                        f"{f}: tensor {name[:120]!a} is also in {tensors[name].file.name}; "
                        f"{REDOWNLOAD}"
                    )
                tensors[name] = entry
        for name, shard in (weight_map or {}).items():
            if name not in tensors or tensors[name].file.name != shard:
                raise CheckpointError(
                    f"{folder / shard} lacks tensor {name[:120]!a} that {INDEX_FILE} places "
                    f"there; {REDOWNLOAD}"
                )
        layers = _expert_slices(folder, model_type, tensors)
        n = _expert_count(folder, config, layers)
        layout, modules = _one_layout(folder, layers)
        index = {f: i for i, f in enumerate(files)}
        extents = [_merge(index, layout, layers[module][e]) for module in modules for e in range(n)]
        expert_bytes = sum(s.nbytes for m in modules for per in layers[m] for s in per.values())
        return cls(
            files=tuple(files),
            layout=layout,
            layers=tuple(ExpertLayer(layer_of(m), m) for m in modules),
            num_experts=n,
            extents=extents,
            stacked=any(_STACKED.match(name) for name in tensors),
            expert_bytes=expert_bytes,
            total_bytes=sum(t.nbytes for t in tensors.values()),
            backbone_header={
                name: {"dtype": SAFETENSORS_NAME[t.dtype], "shape": list(t.shape)}
                for name, t in tensors.items()
                if not (_PER_EXPERT.match(name) or _STACKED.match(name))
            },
        )


def shard_files(folder: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The folder's safetensors shards: those model.safetensors.index.json names (each
    checked to be a plain file name, and there), else every model*.safetensors; and the
    index's weight map (tensor -> shard), None without an index."""
    index_path = folder / INDEX_FILE
    if index_path.exists():
        try:
            with open_regular(index_path) as f:  # a FIFO would block the read forever
                data = f.read(MAX_INDEX_BYTES + 1)
            if len(data) > MAX_INDEX_BYTES:
                raise ValueError("too large")
            weight_map = json.loads(data)["weight_map"]
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError("bad weight_map")
            if not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError("bad weight_map")
            names = sorted(set(weight_map.values()))
        except NotRegularFile as e:
            raise CheckpointError(f"{index_path} is {e.kind}, not a file; {REDOWNLOAD}") from None
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            raise CheckpointError(f"{index_path} is corrupt; {REDOWNLOAD}") from None
        bad = [n for n in names if "/" in n or "\\" in n or n in ("", ".", "..")]
        if bad:
            raise CheckpointError(f"{index_path} names {bad[0][:80]!a}, not a file beside it")
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise CheckpointError(
                f"{folder} lacks shard(s) {', '.join(missing[:3])} listed in {INDEX_FILE}; "
                "download them"
            )
        return [folder / n for n in names], weight_map
    files = sorted(folder.glob("model*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} holds no model*.safetensors weights")
    return files, None


def _expert_slices(
    folder: Path, model_type: str, tensors: dict[str, TensorEntry]
) -> dict[str, list[dict[str, _Slice]]]:
    """{mlx-lm module path: [per expert: {component: slice}]} for every expert tensor."""
    projections = STREAMABLE.get(model_type)
    if projections is None:
        raise UnsupportedModelError(
            f"{folder}: S-MoE cannot stream '{model_type}' experts straight from the "
            f"download (it streams {', '.join(sorted(STREAMABLE))}); {CONVERT}"
        )
    found: dict[str, dict[int, dict[str, _Slice]]] = defaultdict(lambda: defaultdict(dict))
    stacked: dict[str, dict[str, TensorEntry]] = defaultdict(dict)
    for name, t in tensors.items():
        if m := _PER_EXPERT.match(name):
            prefix, e, proj, part = m.groups()
            if proj not in projections:
                raise _unexpressible(folder, name)
            comp = f"{projections[proj]}.{part}"
            found[f"{prefix}.switch_mlp"][int(e)][comp] = _Slice(
                t.file, t.start, t.nbytes, t.dtype, t.shape
            )
        elif m := _STACKED.match(name):
            module, proj, part = m.groups()
            if proj not in PROJ_ORDER:
                raise _unexpressible(folder, name)
            stacked[module][f"{proj}.{part}"] = t
        elif ".experts." in name:
            raise _unexpressible(folder, name)
    out: dict[str, list[dict[str, _Slice]]] = {}
    for module, per in found.items():
        if sorted(per) != list(range(len(per))):
            raise CheckpointError(
                f"{folder}: the experts of {module} are numbered {sorted(per)[:4]}..., not "
                f"0..{len(per) - 1}: shards are missing tensors; {REDOWNLOAD}"
            )
        out[module] = [per[e] for e in range(len(per))]
    for module, comps in stacked.items():
        if module in out:
            raise _unexpressible(folder, f"{module} (both per-expert and stacked)")
        out[module] = _unstack(folder, module, comps)
    if not out:
        raise UnsupportedModelError(
            f"{folder}: no routed experts found in the shards (a dense model?): there is "
            "nothing to stream; run it with mlx-lm directly"
        )
    return out


def _unexpressible(folder: Path, name: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"{folder}: expert tensor {name[:120]!a} is not stored the way S-MoE streams "
        f"from a download (per-expert or stacked gate/up/down projections); {CONVERT}"
    )


def _unstack(folder: Path, module: str, comps: dict[str, TensorEntry]) -> list[dict[str, _Slice]]:
    """A stacked module's components [E, ...] cut into per-expert slices."""
    counts = {t.shape[0] if t.shape else 0 for t in comps.values()}
    if len(counts) != 1 or 0 in counts:
        raise CheckpointError(
            f"{folder}: the stacked expert tensors of {module} disagree on the expert "
            f"count ({sorted(counts)}); {REDOWNLOAD}"
        )
    n = counts.pop()
    return [
        {
            comp: _Slice(t.file, t.start + e * (t.nbytes // n), t.nbytes // n, t.dtype, t.shape[1:])
            for comp, t in comps.items()
        }
        for e in range(n)
    ]


def _expert_count(folder: Path, config: dict[str, Any], layers: dict[str, Any]) -> int:
    """The experts per layer: the same in every layer, and what config.json says."""
    counts = {len(per) for per in layers.values()}
    said = next((config[k] for k in EXPERT_COUNT_KEYS if config.get(k) is not None), None)
    if len(counts) != 1 or (said is not None and counts != {said}):
        raise CheckpointError(
            f"{folder}: the shards hold {sorted(counts)} experts per layer, config.json "
            f"says {said}: use the config that came with these weights, or {REDOWNLOAD}"
        )
    return counts.pop()


def _component_key(name: str) -> tuple[int, int]:
    proj, part = name.rsplit(".", 1)
    return PROJ_ORDER.index(proj), PART_ORDER.index(part)


def _one_layout(
    folder: Path, layers: dict[str, list[dict[str, _Slice]]]
) -> tuple[RecordLayout, list[str]]:
    """The record layout every expert of every layer shares, and the modules in layer
    order. A component in a dtype no record holds, or experts shaped unlike the first
    one's, is refused."""
    modules = sorted(layers, key=layer_of)
    first = layers[modules[0]][0]
    specs = [(c, first[c].dtype, first[c].shape) for c in sorted(first, key=_component_key)]
    for comp, dtype, _ in specs:
        if dtype not in ITEMSIZE:
            raise UnsupportedModelError(
                f"{folder}: expert tensor {modules[0]}.{comp} is {dtype}, which S-MoE does "
                f"not stream as it is; {CONVERT}"
            )
    want = {c: (d, s) for c, d, s in specs}
    for module in modules:
        for e, comps in enumerate(layers[module]):
            got = {c: (s.dtype, s.shape) for c, s in comps.items()}
            if got != want:
                raise UnsupportedModelError(
                    f"{folder}: expert {e} of {module} is stored unlike expert 0 of "
                    f"{modules[0]} (one record layout is streamed for the whole model: "
                    f"mixed-precision recipes differ per layer); {CONVERT}"
                )
    return RecordLayout.build(specs), modules


def _merge(
    index: dict[Path, int], layout: RecordLayout, comps: dict[str, _Slice]
) -> tuple[Extent, ...]:
    """One record's extents: its components' byte ranges in file order, those that touch
    in one file merged into one read."""
    spans = sorted(
        (index[s.file], s.start, s.nbytes, layout.component(c).offset) for c, s in comps.items()
    )
    out: list[Extent] = []
    for file, start, nbytes, dst in spans:
        last = out[-1] if out else None
        if last is not None and last.file == file and last.offset + last.length == start:
            piece = Piece(last.length, dst, nbytes)
            out[-1] = Extent(file, last.offset, last.length + nbytes, (*last.pieces, piece))
        else:
            out.append(Extent(file, start, nbytes, (Piece(0, dst, nbytes),)))
    return tuple(out)
