"""Grow a converted vault to more layers: a benchmark vault of a real model's expert geometry
with as many layers as a disk holds, made in a minute instead of synthesizing and converting
tens of GB of float weights.

    python bench/grow_vault.py SRC_VAULT OUT_VAULT --layers 16

New decoder layer i is source layer i % L (L: the source's layers) with:
- its backbone tensors copied under the new layer's names, the router's rows (one per expert)
  permuted by a seeded permutation, so that layers route differently;
- its expert records copied with each record's first packed component XORed with a seeded
  per-layer mask (any bit pattern is a valid quantized weight), so that no two records on
  disk are alike; checksums are recomputed.
The config's layer count and quantization entries follow. The output is a complete vault
(smoe inspect --verify passes); it is written to a temporary sibling and renamed into place.
Only for models whose every decoder layer has routed experts (e.g. qwen3_moe).
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import sys
import time
from pathlib import Path

import harness
import mlx.core as mx
import numpy as np

from smoe.util.files import fsync_path, remove_tree, replace_dir, write_json_atomic
from smoe.vault.format import Vault, file_checksum
from smoe.vault.integrity import DEFAULT_ALGORITHM, digest
from smoe.vault.manifest import ExpertLayer, Manifest
from smoe.vault.names import BACKBONE_FILE, CONFIG_FILE, EXPERTS_FILE, MANIFEST, STATS_DIR
from smoe.vault.tensorfile import write_safetensors

_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")


def _renamed(name: str, layer: int) -> str:
    return _LAYER.sub(lambda m: f"{m.group(1)}layers.{layer}.", name, count=1)


def grow(src: Vault, out: Path, layers: int, seed: int = 0) -> Vault:
    m = src.manifest
    config = src.config()
    old_layers = int(config["num_hidden_layers"])
    if len(m.layers) != old_layers:
        raise SystemExit("every decoder layer of the source must have routed experts")
    tmp = out.with_name(f".{out.name}.growing-{os.getpid()}")
    remove_tree(tmp)
    tmp.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    try:
        # Backbone: per-layer tensors copied (routers permuted), the rest as they are.
        backbone = dict(mx.load(str(src.backbone_path)))
        out_tensors: dict[str, mx.array] = {}
        per_layer: dict[int, dict[str, mx.array]] = {}
        for name, a in backbone.items():
            found = _LAYER.search(name)
            if found is None:
                out_tensors[name] = a
            else:
                per_layer.setdefault(int(found.group(2)), {})[name] = a
        for i in range(layers):
            perm = mx.array(rng.permutation(m.num_experts))
            for name, a in per_layer[i % old_layers].items():
                is_router = a.ndim == 2 and a.shape[0] == m.num_experts and ".mlp." in name
                out_tensors[_renamed(name, i)] = a[perm] if is_router else a
        backbone_bytes = write_safetensors(tmp / BACKBONE_FILE, out_tensors, {"format": "mlx"})

        # Config: the layer count, and quantization entries for every new layer.
        config["num_hidden_layers"] = layers
        q = config.get("quantization")
        if isinstance(q, dict):
            entries = {k: v for k, v in q.items() if not _LAYER.search(k)}
            for i in range(layers):
                for k, v in q.items():
                    found = _LAYER.search(k)
                    if found is not None and int(found.group(2)) == i % old_layers:
                        entries[_renamed(k, i)] = v
            config["quantization"] = entries
        write_json_atomic(tmp / CONFIG_FILE, config)

        # Records: layer by layer, the packed component XORed with a per-layer mask.
        packed = next(c for c in m.record.components if c.dtype in ("uint32", "uint8"))
        stride = m.record.stride
        checksums: list[int] = []
        pool = concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 4)
        with open(src.experts_path, "rb") as f_in, open(tmp / EXPERTS_FILE, "wb") as f_out:
            for i in range(layers):
                f_in.seek((i % old_layers) * m.num_experts * stride)
                block = np.frombuffer(f_in.read(m.num_experts * stride), np.uint8).copy()
                block = block.reshape(m.num_experts, stride)
                mask = rng.integers(0, 256, packed.nbytes, dtype=np.uint8)
                block[:, packed.offset : packed.offset + packed.nbytes] ^= mask
                checksums += list(
                    pool.map(
                        lambda e, b=block: digest(DEFAULT_ALGORITHM, b[e, : m.record.size]),
                        range(m.num_experts),
                    )
                )
                f_out.write(memoryview(block))
                print(f"layer {i + 1}/{layers}", file=sys.stderr, flush=True)
            f_out.flush()
            os.fsync(f_out.fileno())
        pool.shutdown()

        for p in src.path.iterdir():  # tokenizer and side files
            if p.is_file() and p.name not in {MANIFEST, CONFIG_FILE, BACKBONE_FILE, EXPERTS_FILE}:
                shutil.copyfile(p, tmp / p.name)
        (tmp / STATS_DIR).mkdir()
        topology = dict(m.topology)
        for key in ("num_layers", "num_hidden_layers", "layers"):
            if isinstance(topology.get(key), int):
                topology[key] = layers
        if "moe_layers" in topology:
            topology["moe_layers"] = list(range(layers))
        module = m.layers[0].module
        manifest = Manifest(
            topology=topology,
            record=m.record,
            layers=tuple(ExpertLayer(i, _renamed(module, i)) for i in range(layers)),
            num_experts=m.num_experts,
            checksums=checksums,
            checksum_algorithm=DEFAULT_ALGORITHM,
            quantization=m.quantization,
            source={**m.source, "grown_from": str(src.path), "grown_layers": layers},
            backbone={
                **m.backbone,
                "bytes": backbone_bytes,
                "tensors": len(out_tensors),
                "checksum": file_checksum(tmp / BACKBONE_FILE),
            },
            config={"file": CONFIG_FILE, "checksum": file_checksum(tmp / CONFIG_FILE)},
            created=time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
            producer=m.producer + " (bench/grow_vault.py)",
        )
        write_json_atomic(tmp / MANIFEST, manifest.to_json())
        fsync_path(tmp)
        replace_dir(tmp, out)
    except BaseException:
        remove_tree(tmp)
        raise
    return Vault.open(out)


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("src", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    start = time.perf_counter()
    vault = grow(Vault.open(args.src), args.out, args.layers, args.seed)
    m = vault.manifest
    harness.report(
        {
            "vault": str(vault.path),
            "layers": len(m.layers),
            "records": m.num_records,
            "experts_GB": round(m.experts_bytes / 1e9, 2),
            "seconds": round(time.perf_counter() - start, 1),
        },
        args,
    )


if __name__ == "__main__":
    main()
