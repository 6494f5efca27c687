"""A downloaded checkpoint folder opened as a vault: run it with no conversion step.

``Source.open(folder)`` indexes the shards (``smoe.vault.source_index``: headers validated,
each expert's record layout and file extents) and presents them as a ``Vault``: a manifest
made in memory (the same topology, layers and record layout ``smoe convert`` would write
for this source without re-quantizing it), the mlx-lm-ready config, and a stats directory
in the user's cache, never in the download. ``open_model(path)`` opens a vault or a
checkpoint folder, whichever ``path`` is. The engine reads a source's experts with
``smoe.io.shard_reader.ShardReader`` and loads its backbone through mlx-lm's lazy loader
(``smoe.compute.model``).

Trust: a download carries no per-record checksums. The headers are validated completely
at open; the tensor bytes are trusted as mlx-lm trusts them (it checks nothing either).
Hashing every expert at first open would read the whole model before the first token,
the cost this path exists to avoid: ``smoe convert`` is the way to checked records.
docs/sources.md says more.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as _dt
from pathlib import Path
from typing import Any

import smoe
from smoe.errors import VaultError
from smoe.models.topology import TOP_K_KEYS, Topology, load_config, normalize_config
from smoe.util.cache import cache_dir
from smoe.vault.checks import Check
from smoe.vault.format import Vault
from smoe.vault.integrity import DEFAULT_ALGORITHM, digest
from smoe.vault.manifest import Manifest
from smoe.vault.names import BACKBONE_FILE, EXPERTS_FILE, MANIFEST
from smoe.vault.packing import projection_packing
from smoe.vault.source_index import CONVERT, SourceIndex

SOURCES_DIR = "sources"  # under the cache root: one directory per opened source


def is_checkpoint_folder(path: Path) -> bool:
    """A folder with config.json and none of a vault's own files: a download. (A vault
    whose manifest.json is missing is a broken vault, which Vault.open explains.)"""
    vault_files = (MANIFEST, EXPERTS_FILE, BACKBONE_FILE)
    return (
        path.is_dir()
        and (path / "config.json").is_file()
        and not any((path / name).exists() for name in vault_files)
    )


def open_model(path: Path | str) -> Vault:
    """The vault at ``path``, or the checkpoint folder there opened as a ``Source``; a Hub
    name (``org/name``) is its snapshot in the local Hugging Face cache
    (smoe.vault.hub). Raises VaultError/CheckpointError/UnsupportedModelError, or
    SmoeError for a Hub name not downloaded, naming the fix."""
    from smoe.vault.hub import resolve_model

    path = resolve_model(path)
    if is_checkpoint_folder(path):
        return Source.open(path)
    return Vault.open(path)


class Source(Vault):
    """A checkpoint folder (Hugging Face or mlx-community safetensors) used as a vault.

    ``manifest`` is made in memory from the index (its checksums are zeros: there are none
    to check); ``index`` says where each record's bytes lie. ``config()`` is config.json as
    mlx-lm reads it. ``stats_dir`` is in the cache (``cache_dir()/sources/<key>``).
    ``backbone_path`` and ``experts_path`` name the first shard, for messages and the
    conversation fingerprint; the backbone is loaded from every shard by mlx-lm.
    """

    def __init__(
        self, path: Path, manifest: Manifest, index: SourceIndex, config: dict[str, Any]
    ) -> None:
        super().__init__(path, manifest)
        self.index = index
        self._config = config
        self.cache_dir = cache_dir() / SOURCES_DIR / _cache_key(path, index)

    has_checksums = False  # the shards carry none: ``smoe convert`` makes a checked vault

    def streamed(self) -> dict[str, Any]:
        """How its experts are read: from how many shards, in how many reads each."""
        index = self.index
        return {
            "shards": len(index.files),
            "reads_per_expert": round(index.reads_per_expert(), 2),
            "stacked": index.stacked,
            "stats_dir": str(self.stats_dir),
        }

    @property
    def experts_path(self) -> Path:
        return self.index.files[0]

    @property
    def backbone_path(self) -> Path:
        return self.index.files[0]

    def backbone_header(self) -> dict[str, Any]:
        """The non-expert tensors of every shard (the backbone is loaded from all of them),
        as a safetensors header lists them."""
        return copy.deepcopy(self.index.backbone_header)

    @property
    def stats_dir(self) -> Path:
        return self.cache_dir / "stats"

    def config(self) -> dict[str, Any]:
        """config.json as mlx-lm reads it (normalised; read at open)."""
        return copy.deepcopy(self._config)

    def verify_backbone(self, force: bool = False) -> bool:
        """Nothing to check: a download has no checksums (its headers were validated at
        open). Returns False, as for a vault without a backbone checksum."""
        return False

    def verify_side_files(self) -> list[str]:
        """Nothing to check: a download has no checksums (the tokenizer's files are
        validated as they load). Returns no names."""
        return []

    def backbone_remembered(self) -> bool:
        """As Vault's: a download has no checksum to remember."""
        return False

    @classmethod
    def open(cls, path: Path | str) -> Source:
        """Index the checkpoint folder at ``path``. Raises CheckpointError for missing or
        damaged files, UnsupportedModelError for an architecture or encoding the index
        cannot stream (both naming the fix: re-download, or ``smoe convert``)."""
        path = Path(path)
        raw = load_config(path)
        config = normalize_config(raw)
        index = SourceIndex.build(path, config)
        quantized = isinstance(config.get("quantization"), dict)
        if not quantized:  # as `smoe convert --bits 16` writes it
            config.pop("quantization", None)
            config.pop("quantization_config", None)
        manifest = _manifest(path, index, config, quantized)
        source = cls(path, manifest, index, config)
        # The stats directory's parent (Popularity makes the directory itself); without
        # a cache, popularity counts are not kept, as in a read-only vault.
        with contextlib.suppress(OSError):
            source.cache_dir.mkdir(parents=True, exist_ok=True)
        return source


def _cache_key(path: Path, index: SourceIndex) -> str:
    """The folder's name and a hash of where it is and of its shards' sizes and times:
    another download, or the same one replaced, starts a fresh history."""
    parts = [str(path.absolute())]
    for f in index.files:
        st = f.stat()
        parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    key = digest(DEFAULT_ALGORITHM, "\n".join(parts).encode())
    name = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in path.name)[:64]
    return f"{name}-{key:016x}"


def _topology(config: dict[str, Any], index: SourceIndex) -> Topology:
    """What ``smoe.models.topology.describe`` finds in mlx-lm's model, read from the index
    and the config instead (no model is built)."""
    gate = index.layout.components[0]  # gate_proj.weight: [expert hidden, in]
    top_k = next((config[k] for k in TOP_K_KEYS if config.get(k) is not None), None)
    if type(top_k) is not int:
        raise VaultError(
            f"{index.files[0].parent}/config.json does not say how many experts each token "
            f"uses (one of {', '.join(TOP_K_KEYS)}); add it"
        )
    shared = config.get("n_shared_experts") or config.get("num_shared_experts") or 0
    if not shared and config.get("shared_expert_intermediate_size"):
        shared = 1
    heads = config.get("num_attention_heads")
    return Topology(
        model_type=config["model_type"],
        num_layers=int(config["num_hidden_layers"]),
        hidden_size=int(config["hidden_size"]),
        vocab_size=int(config["vocab_size"]),
        num_experts=index.num_experts,
        experts_per_token=top_k,
        expert_hidden_size=gate.shape[0],
        expert_kind="SwitchGLU",
        moe_layers=tuple(s.layer for s in index.layers),
        shared_experts=int(shared),
        num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads", heads),
        head_dim=config.get("head_dim"),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_position_embeddings=config.get("max_position_embeddings"),
    )


def _quantization(config: dict[str, Any], quantized: bool) -> dict[str, Any]:
    """The manifest's "quantization": as convert records a source kept as it is."""
    if not quantized:
        return {"experts": None, "backbone": None, "float_dtype": None}
    q = config["quantization"]
    top = {k: v for k, v in q.items() if not isinstance(v, dict | bool)}
    return {
        "experts": {
            "mode": q.get("mode", "affine"),
            "bits": q.get("bits"),
            "group_size": q.get("group_size"),
            "copied_from_source": True,
        },
        "backbone": {**top, "copied_from_source": True},
        "float_dtype": None,
    }


def _manifest(path: Path, index: SourceIndex, config: dict[str, Any], quantized: bool) -> Manifest:
    topology = _topology(config, index).to_json()
    quantization = _quantization(config, quantized)
    # The index's layout must be one mlx-lm's expert module can hold, packed as stated.
    projection_packing(Check(str(path), CONVERT), index.layout, topology, quantization)
    return Manifest(
        topology=topology,
        record=index.layout,
        layers=index.layers,
        num_experts=index.num_experts,
        checksums=[0] * (len(index.layers) * index.num_experts),
        checksum_algorithm=DEFAULT_ALGORITHM,
        quantization=quantization,
        source={
            "path": str(path.absolute()),
            "kind": "mlx" if quantized else "hf",
            "bytes": sum(f.stat().st_size for f in index.files),
            "files": [f.name for f in index.files],
            "streamed_from_shards": True,
        },
        backbone={
            "file": index.files[0].name,
            "bytes": index.total_bytes - index.expert_bytes,
            "tensors": None,
        },
        # The newest shard's time, not now: ranks opening the same download must find the
        # same manifest (Manifest.identity).
        created=_dt.datetime.fromtimestamp(
            max(f.stat().st_mtime for f in index.files), _dt.UTC
        ).isoformat(timespec="seconds"),
        producer=f"smoe {smoe.__version__}",
    )
