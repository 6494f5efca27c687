"""Open a source checkpoint (Hugging Face or MLX-quantized) through mlx-lm, lazily.

mlx-lm already knows, per architecture, how checkpoint tensors map onto its modules
(``Model.sanitize``) and how MLX-quantized checkpoints are laid out. We reuse its loader
with ``lazy=True``: nothing is read from disk until a tensor is evaluated, so the
converter can pull one layer's experts at a time.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from smoe.errors import CheckpointError, SmoeError, UnsupportedModelError
from smoe.models.registry import architecture
from smoe.models.topology import (
    ExpertModule,
    Topology,
    describe,
    find_expert_modules,
    load_config,
    model_classes,
    normalize_config,
)
from smoe.util.files import NotRegularFile, open_regular


def safetensors_header(path: Path) -> dict[str, Any]:
    """Parse a safetensors header and check that the file holds every byte it declares."""
    try:
        f = open_regular(path)  # a FIFO would block the read forever
    except NotRegularFile as e:
        raise CheckpointError(
            f"{path} is {e.kind}, not a regular file; download it again"
        ) from None
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read ({e.strerror}); check the file") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is truncated (empty or cut short); download it again")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100_000_000:
            raise CheckpointError(
                f"{path} is truncated or not a safetensors file; download it again"
            )
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise CheckpointError(f"{path} has a corrupt header; download it again") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise CheckpointError(
            f"{path} is truncated ({size} bytes, its header needs {8 + n + end}); download it again"
        )
    return header


def weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors shards, checked to be present and complete."""
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir} is not a directory; give the checkpoint's folder")
    if not (model_dir / "config.json").exists():
        raise CheckpointError(
            f"{model_dir} has no config.json; give the folder of a Hugging Face or MLX checkpoint"
        )
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.exists():
        try:
            with open_regular(index_path) as f:  # a FIFO would block the read forever
                weight_map = json.loads(f.read())["weight_map"]
        except NotRegularFile as e:
            raise CheckpointError(
                f"{index_path} is {e.kind}, not a file; download it again"
            ) from None
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            raise CheckpointError(f"{index_path} is corrupt; download it again") from None
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (model_dir / n).exists()]
        if missing:
            raise CheckpointError(
                f"{model_dir} lacks shard(s) {', '.join(missing)} listed in "
                f"{index_path.name}; download them"
            )
        files = [model_dir / n for n in names]
        headers = {f.name: safetensors_header(f) for f in files}
        for tensor, shard in weight_map.items():
            if tensor not in headers[shard]:
                raise CheckpointError(
                    f"{model_dir / shard} lacks tensor '{tensor}' that {index_path.name} "
                    "places there; download the shard again"
                )
        return files
    files = sorted(model_dir.glob("model*.safetensors"))
    if not files:
        hint = ""
        if list(model_dir.glob("*.bin")) or list(model_dir.glob("*.pt")):
            hint = " (PyTorch .bin weights: re-save them with transformers' save_pretrained)"
        raise CheckpointError(f"{model_dir} holds no model*.safetensors weights{hint}")
    for f in files:
        safetensors_header(f)
    return files


@dataclass
class SourceCheckpoint:
    """A checkpoint opened lazily: its mlx-lm model, parameters and expert modules."""

    path: Path
    config: dict[str, Any]  # normalised, as mlx-lm reads it
    raw_config: dict[str, Any]  # config.json as found
    model: Any
    params: dict[str, Any]  # mlx-lm name -> lazy mx.array (nothing read yet)
    experts: list[ExpertModule]
    topology: Topology
    files: list[Path]

    @property
    def quantization(self) -> dict[str, Any] | None:
        """The source's own MLX quantization (mlx-community style), or None for float."""
        q = self.config.get("quantization")
        return dict(q) if isinstance(q, dict) else None

    @property
    def source_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)


def open_checkpoint(model_dir: Path | str) -> SourceCheckpoint:
    """Open a checkpoint directory; raise a CheckpointError/UnsupportedModelError naming the fix."""
    model_dir = Path(model_dir)
    files = weight_files(model_dir)
    raw = load_config(model_dir)
    config = normalize_config(raw)
    model_class, args_class = model_classes(config)

    arch = architecture(config["model_type"])
    adapter = arch.source_adapter if arch is not None else None

    class _Adapted(model_class):  # type: ignore[misc, valid-type]
        def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
            if adapter is not None:
                weights = adapter(weights)
            if hasattr(super(), "sanitize"):
                weights = super().sanitize(weights)
            return weights

    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    try:
        model, loaded_config = load_model(
            model_dir,
            lazy=True,
            strict=True,
            model_config=config,
            get_model_classes=lambda config: (_Adapted, args_class),
        )
    except SmoeError:
        raise
    except (KeyError, ValueError, TypeError, IndexError, AttributeError) as e:
        detail = str(e).replace("\n", " ")
        if len(detail) > 300:
            detail = detail[:300] + "..."
        raise CheckpointError(
            f"config.json of {model_dir} contradicts its tensors ({type(e).__name__}: {detail}); "
            "use the config that came with these weights"
        ) from None
    experts = find_expert_modules(model)
    if not experts:
        raise UnsupportedModelError(
            f"'{config['model_type']}' in {model_dir} has no routed experts that mlx-lm runs "
            "as SwitchGLU/SwitchMLP (a dense model?): there is nothing to stream; "
            "run it with mlx-lm directly"
        )
    topology = describe(loaded_config, model, experts)
    params = dict(tree_flatten(model.parameters()))
    return SourceCheckpoint(
        path=model_dir,
        config=loaded_config,
        raw_config=raw,
        model=model,
        params=params,
        experts=experts,
        topology=topology,
        files=files,
    )


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem that holds ``path`` (or its nearest existing parent)."""
    p = path.absolute()
    while not p.exists():
        p = p.parent
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize
