"""Running straight from a download (issue 17): a checkpoint folder's experts streamed from
its original shards (smoe/vault/source*.py, smoe/io/shard_reader.py).

References no one here wrote: transformers' save_pretrained writes the Hugging Face
folders, mlx-lm's own quantize_model/save_model the mlx-community-style one; the
vault `smoe convert` makes from the same folder, and mlx-lm's model in memory on the same
folder, give the bytes, tokens and logits the source must reproduce bit for bit.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from smoe.engine import Engine
from smoe.errors import CheckpointError, SmoeError, UnsupportedModelError, VaultReadError
from smoe.io.shard_reader import ShardReader
from smoe.vault.convert import ConvertOptions, convert
from smoe.vault.format import Vault
from smoe.vault.source import Source, open_model
from tests.exact.test_convert import mlx_lm_reference
from tests.exact.test_engine_exact import _prompt, reference_logits

_real_preadv = os.preadv
KINDS = ["qwen3_moe", "mixtral", "mlx-4bit"]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """Each test's source statistics go to its own cache, never the user's."""
    monkeypatch.setenv("SMOE_CACHE", str(tmp_path / "cache"))


def _mlx_quantized(src: Path, out: Path) -> Path:
    """What mlx_lm.convert -q writes (an mlx-community folder), by mlx-lm's own functions."""
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    model, config = load_model(src, lazy=True)
    model, config = quantize_model(model, config, group_size=64, bits=4)
    save_model(out, model)
    save_config(config, out / "config.json")
    return out


def _float32(model):
    """mlx-lm's model with every float tensor widened to float32, quantization scales and
    biases included, as the engine computes on the CPU (mlx-lm's ``model.set_dtype``)."""
    cast = [
        (name, a.astype(mx.float32))
        for name, a in tree_flatten(model.parameters())
        if mx.issubdtype(a.dtype, mx.floating)
    ]
    model.load_weights(cast, strict=False)
    mx.eval(model.parameters())
    model.eval()
    return model


@pytest.fixture(scope="module")
def sources(hf_dir, tmp_path_factory):
    """Factory: (folder, its vault, mlx-lm's in-memory model of the folder) per kind. The
    Hugging Face folders are saved in several shards (with an index.json), and converted
    with --bits 16 (the same bytes); the MLX one is copied as it is."""
    cache: dict[str, tuple[Path, Vault, object]] = {}

    def get(kind: str):
        if kind not in cache:
            root = tmp_path_factory.mktemp(f"source-{kind}")
            if kind == "mlx-4bit":
                folder = _mlx_quantized(hf_dir("mixtral"), root / "mlx")
                vault = convert(folder, root / "v")
                from mlx_lm.utils import load_model

                ref = load_model(folder)[0]
            else:
                folder = root / "hf"
                _save_sharded(hf_dir(kind), folder)
                vault = convert(folder, root / "v", ConvertOptions(bits=16))
                ref = mlx_lm_reference(folder, kind)
            cache[kind] = (folder, vault, _float32(ref))
        return cache[kind]

    return get


def _save_sharded(src: Path, out: Path) -> None:
    """``src`` saved again by transformers in 100 KB shards (model.safetensors.index.json)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size="100KB")
    assert (out / "model.safetensors.index.json").exists()


# ----------------------------------------------------------------------------- the index
@pytest.mark.parametrize("kind", KINDS)
def test_the_index_lays_out_records_as_convert_writes_them(kind, sources):
    """Same topology, layers and record layout as the converted vault, and every record's
    bytes, read from the shards by ShardReader, equal the vault's record."""
    folder, vault, _ = sources(kind)
    source = open_model(folder)
    assert isinstance(source, Source) and not isinstance(open_model(vault.path), Source)
    m, v = source.manifest, vault.manifest
    assert m.topology == v.topology and m.layers == v.layers and m.record == v.record
    assert m.quantization == v.quantization
    ring = _HostRing(m.record.stride, 4)
    with ShardReader(source, ring, workers=2) as reader:
        data = vault.experts_path.read_bytes()

        async def read_all() -> None:
            for record in range(m.num_records):
                slot = record % 4
                await reader.read(record, slot)
                got = ring.slots[slot][: m.record.size]
                off = record * v.record.stride
                want = np.frombuffer(data[off : off + v.record.size], dtype=np.uint8)
                for c in m.record.components:  # padding is not the source's to fill
                    span = slice(c.offset, c.offset + c.nbytes)
                    assert np.array_equal(got[span], want[span]), (record, c.name)

        asyncio.run(read_all())
        # mlx-community: one read per stacked component (3 projections x 3 parts).
        # transformers 5 writes a sharded checkpoint one projection's experts after
        # another, so its experts are 3 reads; unsharded, 1 (test_one_read_per_expert...).
        per_expert = 9 if kind == "mlx-4bit" else 3
        assert source.index.reads_per_expert() == per_expert
        assert reader.reads == per_expert * m.num_records
    if kind != "mlx-4bit":
        assert len(source.index.files) > 1  # several shards, named by the index.json


@pytest.mark.asyncio
async def test_a_shard_read_cancelled_while_running_returns_after_its_thread(sources):
    """ShardReader is the one RecordReader: a read cancelled while its thread fills the
    slot returns only once the thread is done (its own inline copy of this protocol is
    gone), and a queued one is dropped at once."""
    from smoe.io.reader import RecordReader
    from tests.unit.test_io import Blocking, loop_turns

    folder, _, _ = sources("qwen3_moe")
    source = open_model(folder)
    reader = ShardReader(source, _HostRing(source.manifest.record.stride, 2), workers=1)
    assert isinstance(reader, RecordReader)
    with reader, Blocking(reader) as fake:
        fake.arm(3)
        running = asyncio.create_task(reader.read(3, 0))
        running.add_done_callback(lambda t: fake.log.append("read() finished"))
        await fake.wait_started(3)
        queued = asyncio.create_task(reader.read(4, 1))  # the one worker is busy
        await loop_turns()
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued  # never started: dropped at once
        running.cancel()
        await loop_turns()
        assert not running.done()  # the thread may still be writing into the slot
        fake.release[3].set()
        with pytest.raises(asyncio.CancelledError):
            await running
        assert fake.log == ["thread 3 done", "read() finished"]
        assert reader.shards.records == 1  # record 4 was never read


class _HostRing:
    """The ring's landing interface over host memory (what ShardReader writes into)."""

    kind = "unified"

    def __init__(self, stride: int, slots: int) -> None:
        self.stride, self.num_slots = stride, slots
        self.slots = [np.zeros(stride, dtype=np.uint8) for _ in range(slots)]

    def land(self, slot: int):
        ring = self

        class Land:
            memory = memoryview(ring.slots[slot])

            def finish(self):
                return self.memory

            def hand_over(self):
                pass

            def discard(self):
                pass

        return Land()


# ------------------------------------------------------------------------- exactness
@pytest.mark.asyncio
@pytest.mark.parametrize("kind", KINDS)
async def test_logits_and_tokens_equal_the_vault_and_mlx_lm(kind, sources):
    """Teacher-forced logits (70 tokens, two chunks) and 12 greedy tokens from the
    folder equal those from its vault and mlx-lm's in-memory model of the folder, bit for
    bit, at the smallest ring (one layer's top-k) and at a ring holding every expert."""
    folder, vault, ref = sources(kind)
    prompt = _prompt(70)
    want = reference_logits(ref, prompt)
    top_k = vault.manifest.shape.experts_per_token
    for slots in (top_k, None):
        got = {}
        for path in (folder, vault.path):
            async with Engine.open(path, slots=slots) as engine:
                logits = await engine.logits(prompt)
                tokens = [
                    ev.token
                    async for ev in engine.generate(prompt, max_tokens=12, stop_at_eos=False)
                    if ev.token is not None
                ]
                got[path] = (logits, tokens)
                assert engine.stats().scheduler.io_errors == 0
        (a, ta), (b, tb) = got[folder], got[vault.path]
        assert np.array_equal(a, b) and ta == tb, slots
        assert np.array_equal(a, want), slots


# ---------------------------------------------------------------------- bad downloads
def _header(path: Path) -> tuple[dict, int]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), n


def _write_header(path: Path, header: dict) -> None:
    """Rewrite ``path``'s header (padded to its old length, so the data stays in place;
    its optional __metadata__ dropped to make room)."""
    header.pop("__metadata__", None)
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    raw[8 : 8 + n] = text + b" " * (n - len(text))
    path.write_bytes(bytes(raw))


def _first_expert(header: dict) -> str:
    return next(k for k in sorted(header) if ".experts.0." in k)


def _one_line(e: BaseException, *words: str) -> None:
    message = str(e)
    assert "\n" not in message and "Traceback" not in message
    for w in words:
        assert w in message, (w, message)


def test_a_truncated_shard_is_one_line_naming_the_file(hf_dir, copy_dir):
    folder = copy_dir(hf_dir("qwen3_moe"))
    shard = folder / "model.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    with pytest.raises(CheckpointError) as e:
        Source.open(folder)
    _one_line(e.value, str(shard), "truncated", "download")


def test_a_header_pointing_outside_the_file_is_refused(hf_dir, copy_dir):
    folder = copy_dir(hf_dir("qwen3_moe"))
    shard = folder / "model.safetensors"
    header, _ = _header(shard)
    name = _first_expert(header)
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin + 10**9, end + 10**9]
    _write_header(shard, header)
    with pytest.raises(CheckpointError) as e:
        Source.open(folder)
    _one_line(e.value, str(shard), name, "past the end of the file")


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda h, k: h[k].update(dtype="BF17"), ("unknown dtype",)),
        (lambda h, k: h[k].update(dtype="F32"), ("spans", "bytes")),  # size no longer fits
        (lambda h, k: h[k].update(shape=[-1, 64]), ("shape",)),
    ],
)
def test_a_bad_dtype_or_shape_is_refused(hf_dir, copy_dir, edit, words):
    folder = copy_dir(hf_dir("qwen3_moe"))
    shard = folder / "model.safetensors"
    header, _ = _header(shard)
    name = _first_expert(header)
    edit(header, name)
    _write_header(shard, header)
    with pytest.raises(CheckpointError) as e:
        Source.open(folder)
    _one_line(e.value, str(shard), *words)


def test_overlapping_tensors_and_a_lying_header_length_are_refused(hf_dir, copy_dir):
    folder = copy_dir(hf_dir("qwen3_moe"))
    shard = folder / "model.safetensors"
    header, _ = _header(shard)
    a, b = sorted(k for k in header if ".experts.0." in k)[:2]
    header[b]["data_offsets"] = list(header[a]["data_offsets"])
    _write_header(shard, header)
    with pytest.raises(CheckpointError, match="overlap"):
        Source.open(folder)
    raw = bytearray(shard.read_bytes())
    raw[:8] = struct.pack("<Q", len(raw) * 2)
    shard.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="declares a header"):
        Source.open(folder)


def test_a_bad_file_through_the_cli_is_one_line_and_exit_1(hf_dir, copy_dir, run_cli):
    folder = copy_dir(hf_dir("qwen3_moe"))
    shard = folder / "model.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    code, out, err = run_cli("generate", folder, "--prompt-ids", "5,6,7", "--max-tokens", "2")
    assert code == 1 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and str(shard) in err


def test_experts_the_index_cannot_express_name_smoe_convert(hf_dir, tmp_path):
    """gpt-oss stores its experts fused ([E, in, 2 x out], interleaved): refused, naming
    `smoe convert`, which handles it."""
    with pytest.raises(UnsupportedModelError) as e:
        Source.open(hf_dir("gpt_oss"))
    _one_line(e.value, "smoe convert")


# -------------------------------------------------------------------------- read faults
@pytest.mark.asyncio
async def test_a_read_fault_is_a_vault_read_error_and_the_engine_stays_usable(sources, monkeypatch):
    folder, _, _ = sources("qwen3_moe")
    prompt = _prompt(20, seed=5)
    async with Engine.open(folder, slots=2, workers=1, lookahead=False) as engine:
        want = [ev.token async for ev in engine.generate(prompt, max_tokens=4) if ev.token]
        calls = 0

        def fail_the_third(fd, buffers, offset):
            nonlocal calls
            calls += 1
            if calls == 3:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return _real_preadv(fd, buffers, offset)

        monkeypatch.setattr(os, "preadv", fail_the_third)
        with pytest.raises(SmoeError) as e:
            async for _ in engine.generate(_prompt(20, seed=6), max_tokens=4):
                pass
        monkeypatch.setattr(os, "preadv", _real_preadv)
        assert isinstance(e.value.__cause__, VaultReadError)
        assert e.value.errno == errno.EIO
        _one_line(e.value, "layer", "expert", str(folder), "smoe convert")
        again = [ev.token async for ev in engine.generate(prompt, max_tokens=4) if ev.token]
        assert again == want


@pytest.mark.asyncio
async def test_a_shard_cut_short_while_running_names_the_file(hf_dir, copy_dir):
    folder = copy_dir(hf_dir("qwen3_moe"))
    shard = folder / "model.safetensors"
    async with Engine.open(folder, slots=2, workers=1, lookahead=False) as engine:
        first = engine.vault.index.extents[0][0]
        os.truncate(shard, first.offset + 10)  # the backbone is loaded; the experts are not
        with pytest.raises(SmoeError) as e:
            await engine.logits(_prompt(8))
        _one_line(e.value, str(shard), "truncated")


# ----------------------------------------------------------------- the download stays as is
@pytest.mark.asyncio
async def test_statistics_go_to_the_cache_never_into_the_download(hf_dir, copy_dir, tmp_path):
    folder = copy_dir(hf_dir("qwen3_moe"))
    before = sorted((p.name, p.stat().st_mtime_ns) for p in folder.rglob("*"))
    async with Engine.open(folder, slots=2) as engine:
        await engine.logits(_prompt(8))
        stats = engine.vault.stats_dir
    assert sorted((p.name, p.stat().st_mtime_ns) for p in folder.rglob("*")) == before
    assert stats.is_relative_to(tmp_path / "cache") and (stats / "popularity.npz").exists()


def test_inspect_says_what_a_download_would_stream(hf_dir, run_cli):
    code, out, _ = run_cli("inspect", hf_dir("qwen3_moe"))
    assert code == 0 and "1 reads per expert" in out and "streamed from its shards" in out
    code, out, _ = run_cli("inspect", hf_dir("qwen3_moe"), "--json")
    assert json.loads(out)["streamed"]["reads_per_expert"] == 1
    code, _, err = run_cli("inspect", hf_dir("qwen3_moe"), "--verify")
    assert code == 1 and "no checksums" in err


@pytest.mark.asyncio
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
async def test_one_read_per_expert_where_its_tensors_sit_side_by_side(arch, hf_dir):
    """A single-file checkpoint stores each expert's three tensors side by side (names
    sorted: experts.E.down/gate/up, Mixtral's w1/w2/w3): one read each, which the engine
    counts while generating."""
    source = Source.open(hf_dir(arch))
    assert source.index.reads_per_expert() == 1
    assert [c.name for c in source.manifest.record.components] == [
        "gate_proj.weight",
        "up_proj.weight",
        "down_proj.weight",
    ]
    async with Engine.open(source, slots=2) as engine:
        await engine.logits(_prompt(8))
        assert engine.debug.reader.reads == engine.stats().scheduler.misses > 0


def test_an_index_naming_a_tensor_its_shard_lacks_is_refused(sources, copy_dir):
    folder = copy_dir(sources("qwen3_moe")[0])
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    name = next(k for k in data["weight_map"] if ".experts.3." in k)
    shards = sorted(set(data["weight_map"].values()))
    data["weight_map"][name] = next(s for s in shards if s != data["weight_map"][name])
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError) as e:
        Source.open(folder)
    _one_line(e.value, name, "download")


def test_the_same_download_gives_the_same_manifest_identity(hf_dir):
    """Ranks opening one download must agree on the model (Manifest.identity)."""
    a, b = Source.open(hf_dir("qwen3_moe")), Source.open(hf_dir("qwen3_moe"))
    assert a.manifest.identity() == b.manifest.identity()


@pytest.mark.asyncio
@pytest.mark.parametrize("arch", ["qwen2_moe", "olmoe", "deepseek_v2"])
async def test_the_other_streamable_architectures_equal_their_vault(arch, hf_dir, tmp_path):
    """Every architecture the index streams: its layout is convert's, its logits the
    vault's, bit for bit, at the smallest ring (shared experts and dense first layers
    stay in the backbone)."""
    folder = hf_dir(arch)
    vault = convert(folder, tmp_path / "v", ConvertOptions(bits=16))
    source = Source.open(folder)
    assert source.manifest.record == vault.manifest.record
    assert source.manifest.topology == vault.manifest.topology
    prompt = _prompt(40)
    got = []
    for path in (folder, vault.path):
        async with Engine.open(path, slots=vault.manifest.shape.experts_per_token) as engine:
            got.append(await engine.logits(prompt))
    assert np.array_equal(*got)


@pytest.mark.asyncio
async def test_buffered_reads_give_the_same_bytes(sources):
    """Where O_DIRECT is refused (or direct_io=False), reads go through the page cache:
    the same records."""
    folder, vault, _ = sources("mlx-4bit")
    prompt = _prompt(30)
    got = []
    for direct in (True, False):
        async with Engine.open(folder, slots=2, direct_io=direct) as engine:
            assert engine.debug.reader.direct is direct
            got.append(await engine.logits(prompt))
    assert np.array_equal(*got)


def test_generate_from_a_download_with_its_tokenizer(tmp_path, run_cli):
    """A `smoe synth` folder (tokenizer and all) runs from text: the CLI takes the folder
    where it takes a vault, and the tokens equal its vault's."""
    from smoe.synth import synthesize

    folder = synthesize(tmp_path / "src", arch="qwen3_moe", preset="tiny", seed=3)
    vault = convert(folder, tmp_path / "v", ConvertOptions(bits=16))
    outs = []
    for path in (folder, vault.path):
        code, out, err = run_cli(
            "generate", path, "--prompt", "hello there", "--max-tokens", "6", "--json"
        )
        assert code == 0, err
        outs.append(json.loads(out)["tokens"])
    assert outs[0] == outs[1] and len(outs[0]) > 0


@pytest.mark.asyncio(loop_factories=["uvloop"])  # model arithmetic, not loop behaviour
async def test_the_readers_bounce_buffers_are_in_the_whole_process_budget(sources):
    """--memory on a download counts the ShardReader's bounce buffers beside the ring: the
    budget's working part grows by exactly what the reader allocates."""
    import mlx.core as mx

    from smoe.io.shard_reader import bounce_bytes
    from smoe.plan.ring import budget_parts
    from smoe.vault.source import open_model

    folder, vault, _ = sources("qwen3_moe")
    source = open_model(folder)

    def working(model, kind):  # at the engine's default context (budget.pick_context)
        return budget_parts(
            model, mx.float32, kind=kind, max_batch=1, workers=3, max_context=4096
        ).working

    budget = working(source, "staged") + 60 * 10**6
    async with Engine.open(folder, memory=budget, workers=3, max_batch=1) as engine:
        kind = engine.debug.ring.kind
        assert engine.plan.ring.fit is not None and engine.plan.ring.fit.working == working(
            source, kind
        )
        spare = engine.debug.reader.shards.spare  # what the reader allocated for its threads
        allocated = sum(b.base.nbytes if b.base is not None else b.nbytes for b in spare)
    assert working(source, kind) - working(vault, kind) == bounce_bytes(source, 3) == allocated


def test_a_downloads_backbone_is_sized_from_the_non_expert_tensors_of_every_shard(
    tmp_path, monkeypatch, run_cli
):
    """The budget sizes a download's backbone from every shard's non-expert tensors, as
    its vault's backbone.safetensors (not the first shard whole, experts and all): the same
    bytes at either compute width, and the same line from `smoe generate --memory`."""
    from smoe.compute.model import float_policy
    from smoe.models.checkpoint import safetensors_header
    from smoe.plan.budget import backbone_bytes
    from smoe.plan.ring import loaded_backbone_bytes
    from smoe.synth import synthesize, weights

    monkeypatch.setattr(weights, "MAX_SHARD_BYTES", 150_000)  # several shards
    folder = synthesize(tmp_path / "src", arch="qwen3_moe", preset="tiny", seed=3)
    shards = sorted(folder.glob("model*.safetensors"))
    assert len(shards) >= 3
    vault = convert(folder, tmp_path / "v", ConvertOptions(bits=16))
    source = open_model(folder)
    for dtype in (mx.bfloat16, mx.float32):
        got = loaded_backbone_bytes(source, dtype)
        assert got == loaded_backbone_bytes(vault, dtype)
    f32 = float_policy(vault, mx.float32)
    assert got != backbone_bytes(safetensors_header(shards[0]), f32)  # the old count
    lines = []
    for path in (folder, vault.path):
        code, out, err = run_cli(
            "generate", path, "--prompt-ids", "5,6,7", "--max-tokens", "2", "--memory", "700MB"
        )
        assert code == 0, err
        lines.append(next(line for line in err.splitlines() if line.startswith("memory")))
    backbone = [line.split("backbone ")[1].split(" +")[0] for line in lines]
    assert backbone[0] == backbone[1]
