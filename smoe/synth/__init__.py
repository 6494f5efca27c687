"""`smoe synth`: write a complete Hugging Face MoE checkpoint with deterministic random weights.

The checkpoint is what transformers' `save_pretrained` would write for the chosen architecture
(same config.json, same tensor names and shapes, sharded safetensors with an index), plus a small
ChatML tokenizer, so transformers, mlx-lm and S-MoE can all load it. Weights are scaled so routing
and greedy decoding are decisive (see weights.py).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path

from smoe.errors import SmoeError
from smoe.models.registry import ARCHITECTURES
from smoe.synth import layout, tokenizer, weights
from smoe.synth.presets import ARCHS, ENDOFTEXT_ID, IM_END_ID, PRESETS, Preset, resolve

__all__ = ["ARCHS", "DTYPES", "PRESETS", "Preset", "synthesize"]

DTYPES: tuple[str, ...] = tuple(layout.DTYPES)


def synthesize(
    out: Path,
    *,
    arch: str = "qwen3_moe",
    preset: str = "tiny",
    layers: int | None = None,
    seed: int = 0,
    dtype: str = "bfloat16",
    force: bool = False,
    progress: Callable[[str, int, int], None] | None = None,
) -> Path:
    """Write a synthetic `arch` checkpoint with `preset`'s geometry into directory `out`.

    `layers` overrides the preset's layer count. The same (arch, preset, layers, seed, dtype)
    always gives the same files. The checkpoint is built in a hidden sibling directory and renamed
    to `out` only when complete; on any error (or Ctrl-C) nothing is left behind.
    `progress(stage, done, total)` is called with stage "tokenizer" (0/1, 1/1) and "weights"
    (bytes written so far / total bytes).

    Returns `out`. Raises SmoeError for an unknown arch, preset or dtype, an arch the preset does
    not support, too few layers, a negative seed, or when `out` exists and is not empty and
    `force` is False (with force, the old `out` is replaced once the new one is complete).
    """
    out = Path(out)
    p, n_layers = resolve(arch, preset, layers)
    if dtype not in layout.DTYPES:
        raise SmoeError(f"unknown dtype {dtype!r}; choose one of: {', '.join(layout.DTYPES)}")
    if not 0 <= seed < 2**64:
        raise SmoeError(f"--seed must be an integer in [0, 2**64), got {seed}")
    if _occupied(out) and not force:
        raise SmoeError(f"{out} already exists and is not empty; pass --force to replace it")
    if _occupied(out) and not (out / "config.json").exists():
        raise SmoeError(
            f"{out} exists and is not a checkpoint; choose another path "
            "(--force only replaces checkpoints)"
        )

    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_siblings(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        tmp.mkdir()
        _write_checkpoint(tmp, arch, preset, p, n_layers, seed, dtype, progress)
        _fsync_dir(tmp)
        _install(tmp, out, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_checkpoint(
    d: Path,
    arch: str,
    preset: str,
    p: Preset,
    n_layers: int,
    seed: int,
    dtype: str,
    progress: Callable[[str, int, int], None] | None,
) -> None:
    config, specs = layout.build(arch, preset, p, n_layers, dtype)

    if progress is not None:
        progress("tokenizer", 0, 1)
    tokenizer_json = tokenizer.train(p.vocab)
    for path in tokenizer.save(d, tokenizer_json, config.max_position_embeddings):
        _fsync_file(path)
    if progress is not None:
        progress("tokenizer", 1, 1)

    from transformers import GenerationConfig

    _write_text(d / "config.json", config.to_json_string(use_diff=True))
    generation = GenerationConfig(
        bos_token_id=ENDOFTEXT_ID, eos_token_id=[IM_END_ID, ENDOFTEXT_ID], pad_token_id=ENDOFTEXT_ID
    )
    _write_text(d / "generation_config.json", generation.to_json_string(use_diff=True))

    init = partial(
        weights.init_for,
        hidden=p.hidden,
        experts=p.experts,
        sigmoid_router=ARCHITECTURES[arch].sigmoid_router,
        tied=not any(s.name.endswith("lm_head.weight") for s in specs),
        # Keeps stray bytes and control characters out of greedy and chat output.
        quiet_tokens=tokenizer.quiet_tokens(tokenizer_json),
    )
    weight_map = weights.write_shards(d, weights.plan_shards(specs), seed, init, progress)
    index = {
        "metadata": {
            "total_parameters": sum(s.numel for s in specs),
            "total_size": sum(s.nbytes for s in specs),
            "smoe_synth": {
                "arch": arch,
                "preset": preset,
                "layers": n_layers,
                "seed": seed,
                "dtype": dtype,
            },
        },
        "weight_map": weight_map,
    }
    _write_text(
        d / "model.safetensors.index.json", json.dumps(index, indent=2, sort_keys=True) + "\n"
    )


def _occupied(out: Path) -> bool:
    if out.is_dir() and not out.is_symlink():
        return any(out.iterdir())
    return out.exists() or out.is_symlink()


def _remove_stale_siblings(out: Path) -> None:
    """Delete `.{name}.tmp-PID` / `.{name}.old-PID` left by runs that were killed outright."""
    for path in out.parent.glob(f".{out.name}.*-*"):
        kind, _, pid = path.name[len(out.name) + 2 :].rpartition("-")
        if kind not in ("tmp", "old") or not pid.isdigit():
            continue
        if int(pid) != os.getpid():
            try:
                os.kill(int(pid), 0)
                continue  # still running: another synth is writing there
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
        shutil.rmtree(path, ignore_errors=True)


def _install(tmp: Path, out: Path, force: bool) -> None:
    """Move the finished checkpoint to `out`, replacing what is there only now."""
    if _occupied(out) and not force:  # appeared while we were writing
        raise SmoeError(f"{out} already exists and is not empty; pass --force to replace it")
    if out.is_dir() and not out.is_symlink():
        if any(out.iterdir()):
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            out.rmdir()
            tmp.rename(out)
    else:
        if out.exists() or out.is_symlink():
            out.unlink()
        tmp.rename(out)
    _fsync_dir(out.parent)


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    # Directory fsync makes renames durable on Linux; other systems may refuse it.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
