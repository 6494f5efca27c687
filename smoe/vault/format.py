"""Vault format v1: opening a vault for reading, and checking its files against its manifest.

A vault is a directory (smoe.vault.names, docs/vault-format.md); its manifest is
smoe.vault.manifest, its record layout smoe.vault.layout. ``Vault.open`` reads manifest.json
and config.json and validates both completely (``Manifest.from_json``, ``Vault.config``)
before anything is mapped or read, so a damaged or edited vault is a VaultError naming the
field and the fix, never a crash, a traceback or silently wrong output. The rules are listed
in docs/vault-format.md. This module imports no MLX: the I/O side and the scheduler read
vaults too.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

from smoe.errors import VaultError
from smoe.models.topology import EXPERT_COUNT_KEYS, TOP_K_KEYS
from smoe.util.files import recover_dir, write_json_atomic
from smoe.vault.checks import CONVERT_AGAIN, DIM_MAX, Check, parse_json, read_limited, show
from smoe.vault.integrity import DEFAULT_ALGORITHM, digest, stream_digest
from smoe.vault.manifest import FORMAT, VERSION, Manifest, check_signature
from smoe.vault.names import BACKBONE_FILE, CONFIG_FILE, EXPERTS_FILE, MANIFEST, STATS_DIR
from smoe.vault.packing import Packing, quant_entry

BACKBONE_MEMO = "backbone-verified.json"  # in stats/: the file state last hashed and found good
MAX_MANIFEST_BYTES = 64 << 20  # a million records' checksums take ~20 MB
MAX_CONFIG_BYTES = 16 << 20
# The tokenizer and template files a vault copies from its source are read whole when
# checked; real ones are at most tens of MB (a tokenizer.json with a large vocabulary).
MAX_SIDE_FILE_BYTES = 512 << 20


def file_checksum(path: Path | str, algorithm: str = DEFAULT_ALGORITHM) -> dict[str, Any]:
    """``{"algorithm", "value"}``: the manifest's entry for a whole file (the backbone, the
    config). Read in blocks through one buffer, never mapped: the hash of a 700 MB backbone
    must not add 700 MB to a process held to its --memory; OSError if it cannot be read."""
    with open(path, "rb", buffering=0) as f:
        with contextlib.suppress(OSError, AttributeError):  # one pass: read ahead far
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return {"algorithm": algorithm, "value": stream_digest(algorithm, f)}


def _check_config(config: Any, m: Manifest, where: str) -> dict[str, Any]:
    """config.json against the manifest, where the engine relies on both: the model type,
    sizes, expert count and top-k that build mlx-lm's model and bound token ids, the
    quantization each expert projection is built with, and the types of the fields the
    engine reads itself. Returns the config; VaultError naming the field otherwise."""
    c = Check(where)
    if not isinstance(config, dict):
        raise VaultError(f"{where} must hold a JSON object, not {show(config)}; {CONVERT_AGAIN}")
    t = m.topology
    if config.get("model_type") != t["model_type"]:
        c.fail(
            "model_type",
            f"is {show(config.get('model_type'))}, the manifest's is {show(t['model_type'])}",
        )
    _check_sizes(c, config, m)
    _check_engine_fields(c, config, t)
    _check_built_packing(c, config, m)
    return config


def _check_sizes(c: Check, config: dict[str, Any], m: Manifest) -> None:
    """The sizes mlx-lm builds the model with are the manifest's. Each entry is (keys,
    value, required): conversion read the topology from the required ones, or mlx-lm built
    the model from them, so they were there (a layer or kv-head count may have come from
    elsewhere)."""
    t = m.topology
    same: list[tuple[tuple[str, ...], Any, bool]] = [
        (("vocab_size",), t["vocab_size"], True),
        (("hidden_size",), t["hidden_size"], True),
        (("num_hidden_layers",), t["num_layers"], False),
        (EXPERT_COUNT_KEYS, m.num_experts, True),
        (TOP_K_KEYS, t["experts_per_token"], True),
    ]
    for key in ("num_attention_heads", "num_key_value_heads", "head_dim"):
        if t.get(key) is not None:
            same.append(((key,), t[key], key != "num_key_value_heads"))
    for keys, want, required in same:
        for key in keys:
            got = config.get(key)
            if got is not None and (type(got) is not int or got != want):
                c.fail(key, f"is {show(got)}, the manifest says {want}")
        if required and all(config.get(key) is None for key in keys):
            c.fail(" or ".join(keys), f"is missing (the manifest says {want})")


def _check_engine_fields(c: Check, config: dict[str, Any], topology: dict[str, Any]) -> None:
    """The types and ranges of the config fields the engine reads itself."""
    if topology.get("max_position_embeddings") is not None:
        c.key(config, "max_position_embeddings", "")
    for key in ("num_attention_heads", "num_key_value_heads", "head_dim"):
        c.opt_int(config.get(key), key, 1, DIM_MAX)
    c.opt_int(config.get("max_position_embeddings"), "max_position_embeddings", 1)
    if config.get("tie_word_embeddings") is not None:
        c.bool_(config["tie_word_embeddings"], "tie_word_embeddings")
    eos = config.get("eos_token_id")
    if isinstance(eos, list):
        for i, token in enumerate(c.list_(eos, "eos_token_id", 0, 1024)):
            c.int_(token, f"eos_token_id[{i}]", 0, DIM_MAX)
    else:
        c.opt_int(eos, "eos_token_id", 0, DIM_MAX)


def _check_built_packing(c: Check, config: dict[str, Any], m: Manifest) -> None:
    """mlx-lm builds each expert projection with the packing its records hold."""
    q = config.get("quantization")
    default = None
    if q:
        q = c.obj(q, "quantization")
        default = quant_entry(c, q, "quantization")
    held = m.projections()
    for spec in m.layers:
        for proj, have in held.items():
            path = f"{spec.module}.{proj}"
            built = _built_packing(c, q, path, default)
            if built != have:
                said = "float" if built is None else "{}-bit group {} {}".format(*built)
                held_as = "float" if have is None else "{}-bit group {} {}".format(*have)
                c.fail(
                    f"quantization of {path}",
                    f"is {said}, but the records hold {held_as} weights",
                )


def _built_packing(c: Check, q: Any, path: str, default: Packing | None) -> Packing | None:
    """The packing mlx-lm builds module ``path`` with, by its rule: the module's own entry
    in config.json's "quantization" (false: float), else the default (None: float)."""
    entry = q.get(path, True) if q else False
    if isinstance(entry, dict):
        return quant_entry(c, entry, f"quantization[{path!r}]")
    if entry is True:
        return default
    if entry is not False and entry is not None:
        c.fail(f"quantization[{path!r}]", f"must be false or an object, not {show(entry)}")
    return None


# Vaults whose missing backbone checksum was already warned about, in this process.
_UNCHECKED_WARNED: set[str] = set()
# A file changed again within the file system's timestamp granularity of an earlier hash
# could look unchanged; files younger than this are hashed every time.
_RACY_NS = 2 * 10**9


class Vault:
    """An opened vault: its manifest and paths, validated and checked for completeness.

    Opening reads manifest.json and config.json and validates both (docs/vault-format.md,
    "Validation"), and stats the other files; it never reads records or the backbone
    (``verify_backbone`` does). Raises VaultError naming the file, the problem and the fix
    when the directory is not a complete, consistent v1 vault.
    """

    has_checksums = True  # every record and the backbone (a download's Source: none)

    def __init__(self, path: Path, manifest: Manifest) -> None:
        self.path = path
        self.manifest = manifest

    def streamed(self) -> dict[str, Any]:
        """How its experts are read where that is not a vault's one checked read per
        record (a download says; ``smoe inspect`` shows it): nothing here."""
        return {}

    @property
    def experts_path(self) -> Path:
        return self.path / EXPERTS_FILE

    @property
    def backbone_path(self) -> Path:
        return self.path / BACKBONE_FILE

    def backbone_header(self) -> dict[str, Any]:
        """The backbone's tensors as a safetensors header lists them (dtype, shape), for
        sizing it before it loads (smoe.plan.budget.backbone_bytes)."""
        from smoe.models.checkpoint import safetensors_header

        return safetensors_header(self.backbone_path)

    @property
    def config_path(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def stats_dir(self) -> Path:
        return self.path / STATS_DIR

    def config(self) -> dict[str, Any]:
        """config.json (read afresh), checked: valid JSON holding an object, equal to the
        checksum the manifest records for it (vaults made since it does), consistent with
        the manifest where the engine relies on both. Raises VaultError naming the fix."""
        data = read_limited(self.config_path, MAX_CONFIG_BYTES)
        entry = self.manifest.config.get("checksum")
        if entry is not None and digest(entry["algorithm"], data) != entry["value"]:
            raise VaultError(
                f"{self.config_path} does not match its checksum in the manifest: it was "
                f"changed or damaged after conversion; {CONVERT_AGAIN}"
            )
        return _check_config(
            parse_json(data, self.config_path), self.manifest, str(self.config_path)
        )

    @classmethod
    def open(cls, path: Path | str) -> Vault:
        """Open and validate the vault at ``path`` (see the class docstring)."""
        path = Path(path)
        # A replacement killed between its two renames (no atomic exchange here) left the
        # vault aside: put it back before deciding there is none (smoe.util.files).
        with contextlib.suppress(OSError):
            recover_dir(path, complete=lambda p: (p / MANIFEST).is_file())
        if not path.is_dir():
            raise VaultError(f"{path} is not a directory; give a vault made by 'smoe convert'")
        mpath = path / MANIFEST
        ours = (path / EXPERTS_FILE).exists() or (path / BACKBONE_FILE).exists()
        if not mpath.exists() and (path / CONFIG_FILE).is_file() and not ours:
            # A download (docs/sources.md) given to a command that needs a vault.
            raise VaultError(
                f"{path} is a checkpoint folder, not a vault; this command needs a vault: "
                f"run 'smoe convert {path} VAULT' first"
            )
        if not mpath.exists():
            raise VaultError(
                f"{path} is not a vault ({MANIFEST} is missing; an interrupted conversion "
                "leaves none): run 'smoe convert' again"
            )
        raw = parse_json(read_limited(mpath, MAX_MANIFEST_BYTES), mpath)
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise VaultError(f"{mpath} is not an S-MoE vault manifest")
        if raw.get("version") == VERSION:  # another version is refused as such below
            check_signature(raw, mpath)
        manifest = Manifest.from_json(raw, str(mpath))
        vault = cls(path, manifest)
        for f in (vault.backbone_path, vault.config_path, vault.experts_path):
            if not f.is_file():
                raise VaultError(
                    f"{f} is missing; the vault is incomplete: convert the model again"
                )
        size = vault.experts_path.stat().st_size
        if size != manifest.experts_bytes:
            raise VaultError(
                f"{vault.experts_path} has {size} bytes, the manifest says "
                f"{manifest.experts_bytes}: the vault is truncated or altered; convert again"
            )
        size = vault.backbone_path.stat().st_size
        if size != manifest.backbone["bytes"]:
            raise VaultError(
                f"{vault.backbone_path} has {size} bytes, the manifest says "
                f"{manifest.backbone['bytes']}: the vault is truncated or altered; convert again"
            )
        vault.config()
        return vault

    def verify_backbone(self, force: bool = False) -> bool:
        """Check backbone.safetensors against the checksum the manifest records for it.

        The file is hashed once per change of it: a good result is remembered in
        stats/backbone-verified.json, keyed by the file's size, times and inode, where the
        vault is writable (elsewhere it is hashed each time); ``force`` hashes regardless.
        A vault made before the checksum was recorded is not checked: a warning, once per
        process, suggests converting it again. Returns whether a checksum was checked.
        Raises VaultError naming the file and the fix when it does not match.
        """
        entry = self.manifest.backbone.get("checksum")
        path = self.backbone_path
        if entry is None:
            if str(self.path.absolute()) not in _UNCHECKED_WARNED:
                _UNCHECKED_WARNED.add(str(self.path.absolute()))
                # Attributed to "smoe", not to the line that called (often an executor's).
                warnings.warn_explicit(
                    f"{path} is not checked: the vault was made before S-MoE recorded a "
                    "backbone checksum; convert the model again ('smoe convert') to have it "
                    "checked",
                    UserWarning,
                    filename="smoe",
                    lineno=0,
                )
            return False
        try:
            before = os.stat(path)
            key = {
                "file": BACKBONE_FILE,
                **_stat_key(before),
                "algorithm": entry["algorithm"],
                "value": entry["value"],
            }
            if not force and self._memo() == key:
                return True
            actual = file_checksum(path, entry["algorithm"])["value"]
            after = os.stat(path)
        except OSError as e:
            raise VaultError(f"{path} is unreadable ({e.strerror}); {CONVERT_AGAIN}") from None
        if actual != entry["value"]:
            raise VaultError(
                f"{path} does not match its checksum in the manifest ({entry['algorithm']} "
                f"{actual:x}, expected {entry['value']:x}): the file is damaged or was "
                f"changed after conversion; {CONVERT_AGAIN}"
            )
        newest = max(after.st_mtime_ns, after.st_ctime_ns)
        if _stat_key(after) == _stat_key(before) and time.time_ns() - newest > _RACY_NS:
            try:
                self.stats_dir.mkdir(exist_ok=True)
                write_json_atomic(self.stats_dir / BACKBONE_MEMO, key)
            except OSError:
                pass  # a read-only vault is hashed on every open
        return True

    def side_files(self) -> list[str]:
        """The files copied from the source (tokenizer, templates, generation config): the
        manifest's "source.copied", plain names (validated when it was read)."""
        return list(self.manifest.source.get("copied") or [])

    def read_side_file(self, name: str) -> bytes:
        """The bytes of the side file ``name``, checked: a regular file inside the vault
        (a link out of it, or a FIFO, which would block the read, is refused), at most
        MAX_SIDE_FILE_BYTES, equal to its checksum where the manifest records one. Raises
        VaultError naming the file and the fix."""
        path = self.path / name
        fix = f"put it back from the source, or {CONVERT_AGAIN}"
        try:
            inside = path.resolve(strict=True).is_relative_to(self.path.resolve(strict=True))
        except FileNotFoundError:
            raise VaultError(
                f"{path} is missing from the vault (its tokenizer or template files); {fix}"
            ) from None
        except (OSError, RuntimeError) as e:  # a link loop, an unreadable directory
            raise VaultError(f"{path} cannot be resolved ({e}); {fix}") from None
        if not inside:
            raise VaultError(f"{path} is a link to a file outside the vault; {fix}")
        data = read_limited(path, MAX_SIDE_FILE_BYTES, fix)
        entry = (self.manifest.source.get("checksums") or {}).get(name)
        if entry is not None and digest(entry["algorithm"], data) != entry["value"]:
            raise VaultError(
                f"{path} does not match its checksum in the manifest: it was changed "
                f"or damaged after conversion; {fix}"
            )
        return data

    def verify_side_files(self) -> list[str]:
        """Check every file copied from the source (``read_side_file``); return the names
        checked against a checksum (all of them in vaults made since it is recorded; none
        in older ones, whose files are still checked to be regular files inside the vault).
        Raises VaultError naming the first bad one. Cheap: they are small."""
        for name in self.side_files():
            self.read_side_file(name)
        return list(self.manifest.source.get("checksums") or {})

    def backbone_remembered(self) -> bool:
        """Whether backbone.safetensors last hashed good and its size, times and inode are
        unchanged since (stats/backbone-verified.json). Metadata alone cannot see bit rot
        under an unchanged file, so the engine then hashes it again in the background
        (``verify_backbone(force=True)``) rather than before it opens."""
        entry = self.manifest.backbone.get("checksum")
        if entry is None:
            return False
        try:
            st = os.stat(self.backbone_path)
        except OSError:
            return False
        key = {"file": BACKBONE_FILE, **_stat_key(st)}
        return bool(
            self._memo() == {**key, "algorithm": entry["algorithm"], "value": entry["value"]}
        )

    def _memo(self) -> Any:
        try:
            return json.loads((self.stats_dir / BACKBONE_MEMO).read_bytes())
        except (OSError, ValueError, RecursionError):
            return None


def _stat_key(st: os.stat_result) -> dict[str, int]:
    """What changes when a file's bytes do (ctime too, which no one can set back)."""
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "inode": st.st_ino,
        "device": st.st_dev,
    }
