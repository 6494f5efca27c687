"""smoe.io: the ring (one MLX allocation, in-place component views) and the direct reader
(O_DIRECT preadv into slots, buffered fallback, short reads, EINTR, errors, cancellation).

Synchronisation is by threading.Event and loop turns, never by sleeping.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import json
import os
import random
import shutil
import sys
import threading
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from smoe.errors import SmoeError
from smoe.io import BufferedIOWarning, DirectReader, StagedRing, VaultReadError, open_direct
from smoe.io import UnifiedRing as Ring
from smoe.util.sizes import parse_size, round_size, slots_for_budget
from smoe.vault.convert import ConvertOptions, convert
from smoe.vault.export import read_layer
from smoe.vault.format import Vault
from smoe.vault.integrity import digest
from smoe.vault.layout import RECORD_ALIGN, RecordLayout
from smoe.vault.manifest import SIGNATURE, sign_manifest

SAFETY = 30  # seconds: a bug fails a test instead of hanging it; never used to synchronise
_real_preadv = os.preadv
_real_open = os.open


@pytest.fixture(scope="module")
def vaults(hf_dir, tmp_path_factory):
    """Small vaults: 4-bit (16 KiB records, bf16 scales), float32 (64 KiB records: gather_mm
    on the CPU takes float32 only) and gpt-oss 8-bit (with expert biases)."""
    root = tmp_path_factory.mktemp("io-vaults")
    src = hf_dir("qwen3_moe")
    return {
        "q4": convert(src, root / "q4"),
        "float": convert(src, root / "float", ConvertOptions(bits=16, dtype="float32")),
        "q8-gptoss": convert(hf_dir("gpt_oss"), root / "q8", ConvertOptions(bits=8)),
    }


@pytest.fixture
def q4(vaults) -> Vault:
    return vaults["q4"]


def fstype(path: Path) -> str:
    """The filesystem type of the mount holding ``path`` (Linux), or ''."""
    best, kind = "", ""
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return ""
    real = str(path.resolve())
    for line in lines:
        _, mnt, typ, *_ = line.split()
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, kind = mnt, typ
    return kind


def address(a) -> int:
    mx.eval(a)
    return int(np.asarray(a).ctypes.data)


def fill(vault: Vault, ring: Ring, placement: dict[int, int]) -> None:
    """Read {slot: record} with plain buffered preadv (independent of DirectReader)."""
    stride = vault.manifest.record.stride
    fd = os.open(vault.experts_path, os.O_RDONLY)
    try:
        for slot, record in placement.items():
            assert os.preadv(fd, [ring.slot_memory(slot)], record * stride) == stride
    finally:
        os.close(fd)


def checksum(manifest, data) -> int:
    """The manifest's checksum of ``data`` (crc32 or xxh3_64, as the vault says)."""
    return digest(manifest.checksum_algorithm, data)


def expected(vault: Vault, record: int) -> dict[str, mx.array]:
    layer, expert = vault.manifest.record_key(record)
    return {name: a[expert] for name, a in read_layer(vault, layer).items()}


async def loop_turns(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


# ---------------------------------------------------------------------------- ring


def test_ring_slots_are_aligned_writable_and_bounded(q4):
    ring = Ring(q4.manifest.record, 5)
    assert ring.stride == RECORD_ALIGN and ring.nbytes == 5 * RECORD_ALIGN
    assert ring.address % RECORD_ALIGN == 0
    for s in range(5):
        mv = ring.slot_memory(s)
        assert not mv.readonly and mv.nbytes == ring.stride
        assert np.frombuffer(mv, np.uint8).ctypes.data == ring.address + s * ring.stride
    with pytest.raises(IndexError):
        ring.slot_memory(5)
    with pytest.raises(IndexError):
        ring.slot_memory(-1)
    with pytest.raises(ValueError):
        Ring(q4.manifest.record, 0)


def test_ring_allocates_its_size_once_and_views_allocate_nothing(q4):
    gc.collect()
    before = mx.get_active_memory()
    ring = Ring(q4.manifest.record, 512)  # 8 MiB
    grown = mx.get_active_memory() - before
    assert ring.nbytes <= grown <= ring.allocated_bytes + 4096, grown

    before = mx.get_active_memory()
    views = ring.views()
    mx.eval(*views.values())
    for v in views.values():  # slicing a slot (the in-place form) allocates nothing either
        mx.eval(v[3, ...], v[1:4])
    assert mx.get_active_memory() - before == 0

    size = ring.nbytes
    del ring, views, v
    gc.collect()
    assert mx.get_active_memory() - before <= -size  # freed with the ring


def test_budgets_size_the_ring_and_suggest_round_sizes():
    """The one count of slots a budget holds (with --memory and without: whether that is
    enough is the plan's, tests/unit/test_budget.py), and the one round size suggested."""
    layout = RecordLayout.build([("w", "uint8", (RECORD_ALIGN * 3,))])
    stride = layout.stride
    assert slots_for_budget(parse_size("200KB"), stride) == 200_000 // (3 * RECORD_ALIGN)
    assert slots_for_budget(10**6, stride, max_slots=3) == 3
    assert slots_for_budget(stride - 1, stride) == 0 == slots_for_budget(-stride, stride)

    big = RecordLayout.build([("w", "uint8", (648 * RECORD_ALIGN,))])  # stride 10.62 MB
    assert round_size(8 * big.stride) == "85MB"  # 84.93 MB
    assert round_size(4_290_000_000, up=False) == "4.2GB"
    rng = random.Random(0)
    for n in [
        1,
        999,
        1000,
        1001,
        84_934_656,
        10**9,
        1_234_567_890,
        *(rng.randrange(10**13) for _ in range(200)),
    ]:
        s = round_size(n)
        assert n <= parse_size(s) <= n * 1.1 + 1000, (n, s)
        assert parse_size(round_size(n, up=False)) <= n


@pytest.mark.parametrize("kind", ["q4", "float", "q8-gptoss"])
def test_views_equal_the_stacked_tensors_bit_for_bit(vaults, kind):
    vault = vaults[kind]
    m = vault.manifest
    ring = Ring(m.record, 7)  # fewer slots than records: slots get reused below
    views = ring.views()  # made once, before any read
    for name, v in views.items():
        c = m.record.component(name)
        assert v.shape == (7, *c.shape) and v.dtype == getattr(mx, c.dtype)

    rng = random.Random(kind)
    for _ in range(3):  # refill: the same views show each new placement
        placement = dict(enumerate(rng.sample(range(m.num_records), 7)))
        fill(vault, ring, placement)
        for slot, record in placement.items():
            ref = expected(vault, record)
            assert set(ref) == set(views)
            for name, v in views.items():
                assert mx.array_equal(v[slot, ...], ref[name]).item(), (name, slot, record)
                assert mx.array_equal(v[slot], ref[name]).item()  # (a copy, same values)


def test_views_are_in_place_and_show_bytes_at_evaluation_time(q4):
    m = q4.manifest
    ring = Ring(m.record, 4)
    views = ring.views()
    w = views["gate_proj.weight"]
    c = m.record.component("gate_proj.weight")
    # In place: the view and its slot slices sit at the ring's own addresses.
    assert address(w) == ring.address + c.offset
    assert address(w[2, ...]) == ring.address + 2 * ring.stride + c.offset
    assert address(w[2:3]) == ring.address + 2 * ring.stride + c.offset
    assert address(mx.take(w, 2, axis=0)) == ring.address + 2 * ring.stride + c.offset

    a, b = 0, 9
    fill(q4, ring, {0: a})
    old = expected(q4, a)["gate_proj.weight"]
    new = expected(q4, b)["gate_proj.weight"]
    assert not mx.array_equal(old, new).item()

    done_before = w[0, ...] + 0  # evaluated before the write: keeps the old values
    mx.eval(done_before)
    lazy = w[0, ...] + 0  # built before the write, evaluated after: sees the new bytes
    compiled_arg = mx.compile(lambda x: x[0, ...] + 0)
    compiled_closure = mx.compile(lambda: w[0, ...] + 0)
    assert mx.array_equal(compiled_arg(w), old).item()
    assert mx.array_equal(compiled_closure(), old).item()

    fill(q4, ring, {0: b})
    assert mx.array_equal(done_before, old).item()
    assert mx.array_equal(lazy, new).item()
    assert mx.array_equal(w[0, ...], new).item()
    assert mx.array_equal(compiled_arg(w), new).item()
    assert mx.array_equal(compiled_closure(), new).item()
    assert np.array_equal(np.asarray(w[0, ...]), np.asarray(new))


def test_gather_qmm_on_ring_views_equals_the_stacked_tensors(q4):
    m = q4.manifest
    q = m.quantization["experts"]
    layer = m.layers[1].layer
    stacked = read_layer(q4, layer)
    ring = Ring(m.record, 32)
    # This layer's experts in scattered slots, other slots hold the other layer's.
    slot_of = dict(
        zip(range(m.num_experts), random.Random(1).sample(range(32), m.num_experts), strict=True)
    )
    placement = {s: m.record_index(layer, e) for e, s in slot_of.items()}
    others = [s for s in range(32) if s not in placement]
    placement.update(
        {s: m.record_index(m.layers[0].layer, i % m.num_experts) for i, s in enumerate(others)}
    )
    fill(q4, ring, placement)
    views = ring.views()

    tokens, k, hidden = 6, 2, m.topology["hidden_size"]
    dtype = stacked["gate_proj.scales"].dtype
    x = mx.random.normal((tokens, 1, 1, hidden), key=mx.random.key(0)).astype(dtype)
    experts = mx.array(np.random.default_rng(0).integers(0, m.num_experts, (tokens, k)))
    slots = mx.array([[slot_of[int(e)] for e in row] for row in experts.tolist()])
    mx.eval(x, experts, slots)

    gc.collect()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    for proj in ("gate_proj", "up_proj"):
        args = dict(transpose=True, group_size=q["group_size"], bits=q["bits"])
        on_ring = mx.gather_qmm(
            x,
            views[f"{proj}.weight"],
            views[f"{proj}.scales"],
            views[f"{proj}.biases"],
            rhs_indices=slots,
            **args,
        )
        mx.eval(on_ring)
        assert mx.get_peak_memory() - base < ring.nbytes // 4  # no copy of the ring
        ref = mx.gather_qmm(
            x,
            stacked[f"{proj}.weight"],
            stacked[f"{proj}.scales"],
            stacked[f"{proj}.biases"],
            rhs_indices=experts,
            **args,
        )
        assert on_ring.shape == (tokens, k, 1, stacked[f"{proj}.weight"].shape[1])
        assert mx.array_equal(on_ring, ref).item()


def test_gather_mm_on_float_ring_views(vaults):
    vault = vaults["float"]
    m = vault.manifest
    layer = m.layers[0].layer
    stacked = read_layer(vault, layer)
    ring = Ring(m.record, m.num_experts)
    order = random.Random(2).sample(range(m.num_experts), m.num_experts)  # slot -> expert
    fill(vault, ring, {s: m.record_index(layer, e) for s, e in enumerate(order)})
    w = ring.views()["down_proj.weight"]
    x = mx.random.normal((3, 1, 1, w.shape[-1]), key=mx.random.key(1)).astype(w.dtype)
    experts = mx.array([[1, 5], [0, 7], [3, 3]])
    slots = mx.array([[order.index(e) for e in row] for row in experts.tolist()])
    on_ring = mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=slots)
    ref = mx.gather_mm(x, stacked["down_proj.weight"].swapaxes(-1, -2), rhs_indices=experts)
    assert mx.array_equal(on_ring, ref).item()


# ---------------------------------------------------------------------------- direct reader


@pytest.mark.asyncio
async def test_reader_fills_every_slot_concurrently_with_checksummed_bytes(q4):
    m = q4.manifest
    ring = Ring(m.record, m.num_records)
    with DirectReader(q4, ring, workers=4) as reader:
        records = random.Random(3).sample(range(m.num_records), m.num_records)
        sizes = await asyncio.gather(*(reader.read(r, s) for s, r in enumerate(records)))
        assert sizes == [m.record.stride] * m.num_records
        for slot, record in enumerate(records):
            data = bytes(ring.slot_memory(slot)[: m.record.size])
            assert checksum(m, data) == m.checksums[record]
        views = ring.views()
        for slot in (0, m.num_records - 1):
            for name, ref in expected(q4, records[slot]).items():
                assert mx.array_equal(views[name][slot, ...], ref).item()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="O_DIRECT is Linux's")
def test_direct_io_is_used_on_a_disk_filesystem(q4):
    kind = fstype(q4.experts_path)
    if kind not in {"ext4", "xfs", "btrfs"}:
        pytest.skip(f"vault on {kind or 'an unknown filesystem'}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fd, direct = open_direct(q4.experts_path)
    try:
        assert direct
        flags = int(Path(f"/proc/self/fdinfo/{fd}").read_text().split("flags:")[1].split()[0], 8)
        assert flags & os.O_DIRECT
    finally:
        os.close(fd)


def test_direct_false_opens_buffered_without_warning(q4):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reader = DirectReader(q4, Ring(q4.manifest.record, 2), direct=False)
    with reader:
        assert not reader.direct
        assert asyncio.run(reader.read(5, 1)) == reader.stride
        assert (
            checksum(q4.manifest, reader.ring.slot_memory(1)[: q4.manifest.record.size])
            == q4.manifest.checksums[5]
        )


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT here")
def test_fallback_when_open_refuses_o_direct(q4, monkeypatch):
    def refusing_open(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return _real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    with pytest.warns(BufferedIOWarning) as caught:
        reader = DirectReader(q4, Ring(q4.manifest.record, 1))
    message = str(caught[0].message)
    assert (
        str(q4.experts_path) in message
        and "page cache" in message
        and "not representative" in message
    )
    with reader:
        assert not reader.direct
        assert asyncio.run(reader.read(3, 0)) == reader.stride
        assert (
            checksum(q4.manifest, reader.ring.slot_memory(0)[: q4.manifest.record.size])
            == q4.manifest.checksums[3]
        )


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT here")
def test_fallback_when_the_first_direct_read_is_refused(q4, monkeypatch):
    calls = []

    def refuse_first(fd, buffers, offset):
        calls.append(offset)
        if len(calls) == 1:
            raise OSError(errno.EINVAL, "Invalid argument")
        return _real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", refuse_first)
    with pytest.warns(BufferedIOWarning, match="refuses O_DIRECT reads"):
        fd, direct = open_direct(q4.experts_path)
    os.close(fd)
    assert not direct and calls == [0]


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT here")
def test_open_errors_other_than_einval_propagate(tmp_path):
    with pytest.raises(FileNotFoundError):
        open_direct(tmp_path / "missing.bin")


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
@pytest.mark.asyncio
async def test_vault_on_dev_shm(q4):
    # tmpfs accepts O_DIRECT since Linux 6.6 (the reads still come from RAM); older kernels
    # refuse it at open. Either way the reader works, and warns exactly when buffered.
    shm = Path("/dev/shm") / f"smoe-test-io-{os.getpid()}"
    shutil.copytree(q4.path, shm)
    try:
        vault = Vault.open(shm)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reader = DirectReader(vault, Ring(vault.manifest.record, 2))
        with reader:
            warned = [w for w in caught if issubclass(w.category, BufferedIOWarning)]
            assert bool(warned) == (not reader.direct)
            assert await reader.read(vault.manifest.num_records - 1, 1) == reader.stride
            data = bytes(reader.ring.slot_memory(1)[: vault.manifest.record.size])
            assert checksum(vault.manifest, data) == vault.manifest.checksums[-1]
    finally:
        shutil.rmtree(shm)


@pytest.mark.asyncio
async def test_short_reads_are_continued(q4, monkeypatch):
    offsets = []

    def at_most_4k(fd, buffers, offset):
        offsets.append(offset)
        return _real_preadv(fd, [buffers[0][:4096]], offset)

    with DirectReader(q4, Ring(q4.manifest.record, 2)) as reader:
        monkeypatch.setattr(os, "preadv", at_most_4k)
        assert await reader.read(7, 1) == reader.stride
        monkeypatch.undo()
    base = 7 * reader.stride
    assert offsets == list(range(base, base + reader.stride, 4096))
    assert (
        checksum(q4.manifest, reader.ring.slot_memory(1)[: q4.manifest.record.size])
        == q4.manifest.checksums[7]
    )


@pytest.mark.asyncio
async def test_interrupted_reads_are_retried(q4, monkeypatch):
    calls = []

    def interrupted_once(fd, buffers, offset):
        calls.append(offset)
        if len(calls) == 1:
            raise InterruptedError(errno.EINTR, "Interrupted system call")
        return _real_preadv(fd, buffers, offset)

    with DirectReader(q4, Ring(q4.manifest.record, 1)) as reader:
        monkeypatch.setattr(os, "preadv", interrupted_once)
        assert await reader.read(2, 0) == reader.stride
    assert calls == [2 * reader.stride] * 2
    assert (
        checksum(q4.manifest, reader.ring.slot_memory(0)[: q4.manifest.record.size])
        == q4.manifest.checksums[2]
    )


@pytest.mark.parametrize("keep", [0, RECORD_ALIGN // 2], ids=["at-record-start", "mid-record"])
@pytest.mark.asyncio
async def test_truncated_vault_names_the_record(q4, tmp_path, keep):
    shutil.copytree(q4.path, tmp_path / "v")
    vault = Vault.open(tmp_path / "v")
    m = vault.manifest
    last = m.num_records - 1
    layer, expert = m.record_key(last)
    with DirectReader(vault, Ring(m.record, 1)) as reader:
        os.truncate(vault.experts_path, last * m.record.stride + keep)  # after opening
        assert await reader.read(last - 1, 0) == reader.stride  # the others still read
        with pytest.raises(VaultReadError) as e:
            await reader.read(last, 0)
    err = e.value
    assert isinstance(err, SmoeError) and not isinstance(err, OSError)  # one line, exit 1
    assert f"(record {last}, bytes" in str(err) and "truncated" in str(err)
    assert f"expert {expert} of layer {layer}" in str(err) and str(vault.experts_path) in str(err)
    assert f"smoe inspect {vault.path} --verify" in str(err) and "\n" not in str(err)
    assert (err.record, err.key, err.path, err.errno) == (
        last,
        (layer, expert),
        vault.experts_path,
        None,
    )


@pytest.mark.asyncio
async def test_io_error_names_the_record(q4, monkeypatch):
    def failing(fd, buffers, offset):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    m = q4.manifest
    with DirectReader(q4, Ring(m.record, 1)) as reader:
        monkeypatch.setattr(os, "preadv", failing)
        with pytest.raises(VaultReadError) as e:
            await reader.read(m.record_index(m.layers[1].layer, 6), 0)
    assert e.value.errno == errno.EIO and e.value.key == (m.layers[1].layer, 6)
    assert f"expert 6 of layer {m.layers[1].layer} (record {m.num_experts + 6}" in str(e.value)
    assert f"{os.strerror(errno.EIO)} (EIO)" in str(e.value) and "dmesg" in str(e.value)
    assert isinstance(e.value, SmoeError) and isinstance(e.value.__cause__, OSError)


def test_reader_rejects_bad_arguments(q4, vaults):
    with pytest.raises(ValueError, match="make the ring from this model.s record layout"):
        DirectReader(q4, Ring(vaults["float"].manifest.record, 1))
    with pytest.raises(ValueError):
        DirectReader(q4, Ring(q4.manifest.record, 1), workers=0)

    async def go(reader: DirectReader) -> None:
        with pytest.raises(IndexError):
            await reader.read(q4.manifest.num_records, 0)
        with pytest.raises(IndexError):
            await reader.read(0, 1)

    reader = DirectReader(q4, Ring(q4.manifest.record, 1))
    asyncio.run(go(reader))
    reader.close()
    reader.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(reader.read(0, 0))


class Blocking:
    """Wraps DirectReader._read_into: each call blocks until the test releases it.

    Use it as a context manager inside the reader's: leaving it releases every blocked call,
    so a failing test cannot leave close() waiting for a thread forever.
    """

    def __init__(self, reader: DirectReader) -> None:
        self.real = reader._read_into
        self.started: dict[int, threading.Event] = {}
        self.release: dict[int, threading.Event] = {}
        self.log: list[str] = []
        self.threads: list[str] = []
        reader._read_into = self  # type: ignore[method-assign]

    def __enter__(self) -> Blocking:
        return self

    def __exit__(self, *exc: object) -> None:
        for event in self.release.values():
            event.set()

    def arm(self, record: int) -> None:
        self.started[record] = threading.Event()
        self.release[record] = threading.Event()

    async def wait_started(self, record: int) -> None:
        assert await asyncio.to_thread(self.started[record].wait, SAFETY), "read never started"

    def __call__(self, record: int, slot: int):
        self.threads.append(threading.current_thread().name)
        self.started[record].set()
        self.release[record].wait()
        self.log.append(f"thread {record} done")
        return self.real(record, slot)  # then the real read (quick), verified as usual


@pytest.mark.asyncio
async def test_cancelled_read_returns_only_after_its_thread_finishes(q4):
    reader = DirectReader(q4, Ring(q4.manifest.record, 1), workers=2)
    with reader, Blocking(reader) as fake:
        fake.arm(4)
        task = asyncio.create_task(reader.read(4, 0))
        task.add_done_callback(lambda t: fake.log.append("read() finished"))
        await fake.wait_started(4)

        task.cancel()
        await loop_turns()
        assert not task.done()  # the thread may still be writing into the slot
        task.cancel()  # cancelling again does not cut the wait short
        await loop_turns()
        assert not task.done()

        fake.release[4].set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert fake.log == ["thread 4 done", "read() finished"]
        assert fake.threads[0].startswith("smoe-io")


@pytest.mark.asyncio
async def test_cancelled_read_that_never_started_returns_at_once(q4):
    reader = DirectReader(q4, Ring(q4.manifest.record, 2), workers=1)
    with reader, Blocking(reader) as fake:
        fake.arm(1)
        first = asyncio.create_task(reader.read(1, 0))
        await fake.wait_started(1)
        queued = asyncio.create_task(reader.read(2, 1))  # the one worker is busy
        await loop_turns()
        queued.cancel()
        await asyncio.wait([queued], timeout=SAFETY)  # (wait_for would cancel it: no use)
        assert queued.done() and queued.cancelled()  # while the first read is still blocked
        assert not first.done()
        fake.release[1].set()
        assert await first == reader.stride
        assert fake.started.keys() == {1} and fake.log == ["thread 1 done"]  # 2 never ran


@pytest.mark.asyncio
async def test_close_waits_for_running_reads_and_drops_queued_ones(q4):
    reader = DirectReader(q4, Ring(q4.manifest.record, 2), workers=1)
    with reader, Blocking(reader) as fake:
        fake.arm(1)
        running = asyncio.create_task(reader.read(1, 0))
        await fake.wait_started(1)
        queued = asyncio.create_task(reader.read(2, 1))
        await loop_turns()

        closing = asyncio.create_task(asyncio.to_thread(reader.close))
        await asyncio.wait([queued], timeout=SAFETY)
        assert queued.done()  # dropped by close(), which now waits for the running read
        with pytest.raises(RuntimeError, match="closed before record 2"):
            queued.result()
        assert not running.done() and not closing.done()
        fake.release[1].set()
        assert await running == reader.stride
        await closing
    with pytest.raises(OSError):
        os.fstat(reader.file.fd)  # closed


def test_a_ring_beyond_2_gib_allocates_and_views_its_last_slot():
    """MLX sizes a shape dimension with a 32-bit int: the ring is rows of 16 KiB, and its
    views never flatten it (one flat dimension failed at 2 GiB, any real model's ring)."""
    from smoe.vault.layout import Component

    stride = 1 << 20  # a 1 MiB record: one uint8 [1024, 1024] component
    layout = RecordLayout((Component("w", "uint8", (1024, 1024), 0),), stride, stride)
    ring = Ring(layout, 2049)  # 2 GiB + 1 MiB: 2^31 + 2^20 one-byte elements
    assert ring.allocated_bytes > 2**31
    for slot in (0, 1000, 2048):
        mine = np.frombuffer(ring.slot_memory(slot), dtype=np.uint8)
        mine[:] = np.random.default_rng(slot).integers(0, 255, mine.size, dtype=np.uint8)
    view = ring.views()["w"]
    assert view.shape == (2049, 1024, 1024)
    for slot in (0, 1000, 2048):
        want = np.random.default_rng(slot).integers(0, 255, stride, dtype=np.uint8)
        assert np.array_equal(np.array(view[slot, ...]).reshape(-1), want), slot
    del view, ring


@pytest.mark.asyncio
async def test_a_worker_takes_its_next_read_without_the_event_loop(q4):
    """A worker that finishes a read starts the next queued one itself: here the event
    loop is blocked (a synchronous wait in this coroutine) while read 1 finishes, and
    read 2 still starts. A round trip through the loop between reads would deadlock."""
    reader = DirectReader(q4, Ring(q4.manifest.record, 2), workers=1)
    with reader, Blocking(reader) as fake:
        fake.arm(1)
        fake.arm(2)
        first = asyncio.create_task(reader.read(1, 0))
        second = asyncio.create_task(reader.read(2, 1))
        await fake.wait_started(1)
        await loop_turns()  # both are queued in the reader now
        fake.release[1].set()
        assert fake.started[2].wait(SAFETY), "the worker waited for the loop"  # loop blocked
        fake.release[2].set()
        assert await first == await second == reader.stride
        assert fake.log == ["thread 1 done", "thread 2 done"]


@pytest.mark.asyncio
async def test_queued_demand_reads_start_before_queued_speculative_ones(q4):
    reader = DirectReader(q4, Ring(q4.manifest.record, 4), workers=1)
    with reader, Blocking(reader) as fake:
        for r in (1, 2, 3, 4):
            fake.arm(r)
        busy = asyncio.create_task(reader.read(1, 0))
        await fake.wait_started(1)
        spec = [asyncio.create_task(reader.read(r, r - 1, priority=1)) for r in (2, 3)]
        await loop_turns()
        demand = asyncio.create_task(reader.read(4, 3, priority=0))
        await loop_turns()
        for r in (1, 4, 2, 3):
            fake.release[r].set()
        await asyncio.gather(busy, demand, *spec)
        order = [line.split()[1] for line in fake.log]
        assert order == ["1", "4", "2", "3"]  # demand first, then speculation in order


def test_records_split_into_aligned_parts():
    from smoe.io.direct_file import split_record

    assert split_record(RECORD_ALIGN) == [(0, RECORD_ALIGN)]
    big = 648 * RECORD_ALIGN  # a Qwen3-235B 4-bit record: 10.6 MB
    parts = split_record(big)
    assert len(parts) == 4 and parts[0][0] == 0 and parts[-1][1] == big
    assert all(a % RECORD_ALIGN == 0 and b > a for a, b in parts)
    assert all(p[1] == q[0] for p, q in zip(parts, parts[1:], strict=False))
    assert split_record(3 * RECORD_ALIGN, parts=8) == [
        (0, RECORD_ALIGN),
        (RECORD_ALIGN, 2 * RECORD_ALIGN),
        (2 * RECORD_ALIGN, 3 * RECORD_ALIGN),
    ]


@pytest.mark.asyncio
async def test_a_record_read_in_parts_lands_whole_and_errors_wait_for_every_part(
    vaults, monkeypatch
):
    """Parts of one record are read at once by the worker and helper threads; every byte
    lands, and a failing part raises only after the others have finished writing."""
    vault = vaults["float"]  # records of several 16 KiB blocks: one part each
    m = vault.manifest
    ring = Ring(m.record, 2)
    with DirectReader(vault, ring, workers=1, parts=4) as reader:
        threads = set()

        def spy(fd, buffers, offset):
            threads.add(threading.current_thread().name)
            return _real_preadv(fd, buffers, offset)

        monkeypatch.setattr(os, "preadv", spy)
        assert await reader.read(3, 1) == m.record.stride
        assert len(threads) >= 2  # the worker and at least one helper
        got = np.frombuffer(ring.slot_memory(1), np.uint8)[: m.record.size]
        assert checksum(m, got) == m.checksums[3]

        finished = []

        def failing(fd, buffers, offset):
            if offset % m.record.stride == RECORD_ALIGN:  # the second part fails at once
                raise OSError(errno.EIO, "injected")
            n = _real_preadv(fd, buffers, offset)
            finished.append(offset)
            return n

        monkeypatch.setattr(os, "preadv", failing)
        with pytest.raises(VaultReadError, match="injected"):
            await reader.read(2, 0)
        assert len(finished) == len(reader.file.parts) - 1 >= 2  # the others were waited for


# ---------------------------------------------------------------------------- trust


def flip_bit(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x80]))


def flipping(record_offsets: set[int], times: int | None = None):
    """os.preadv that flips one bit of what it reads at ``record_offsets`` (the first
    ``times`` reads of each; None: every read), as a bus or DMA error would."""
    flips: dict[int, int] = {}

    def read(fd, buffers, offset):
        n = _real_preadv(fd, buffers, offset)
        if offset in record_offsets and (times is None or flips.get(offset, 0) < times):
            flips[offset] = flips.get(offset, 0) + 1
            buffers[0][100] ^= 0x04
        return n

    read.flips = flips
    return read


@pytest.mark.asyncio
async def test_a_record_corrupted_in_transit_is_read_again_and_lands_intact(q4, monkeypatch):
    m = q4.manifest
    ring = Ring(m.record, 2)
    with DirectReader(q4, ring, workers=1) as reader:
        spy = flipping({5 * reader.stride}, times=1)
        monkeypatch.setattr(os, "preadv", spy)
        assert await reader.read(5, 1) == reader.stride
        assert spy.flips == {5 * reader.stride: 1} and reader.rereads == 1
    assert checksum(m, ring.slot_memory(1)[: m.record.size]) == m.checksums[5]


@pytest.mark.parametrize("algorithm", ["crc32", "xxh3_64"])
@pytest.mark.asyncio
async def test_a_corrupt_record_fails_after_one_reread_naming_it(q4, tmp_path, algorithm):
    """Both checksum algorithms (crc32: vaults made before xxh3_64) are verified; a record
    whose bytes on disk are wrong is read twice, then fails with the record, expert, file
    and fix, and nothing was handed to the slot."""
    from smoe.errors import RecordChecksumError
    from smoe.vault.integrity import digest

    shutil.copytree(q4.path, tmp_path / "v")
    manifest = tmp_path / "v" / "manifest.json"
    data = json.loads(manifest.read_text())
    m = q4.manifest
    blob = q4.experts_path.read_bytes()
    data["checksums"] = {
        "algorithm": algorithm,
        "values": [
            digest(algorithm, blob[i * m.record.stride :][: m.record.size])
            for i in range(m.num_records)
        ],
    }
    manifest.write_text(
        json.dumps(sign_manifest({k: v for k, v in data.items() if k != SIGNATURE}))
    )
    vault = Vault.open(tmp_path / "v")
    bad = m.num_experts + 3
    flip_bit(vault.experts_path, bad * m.record.stride + 7)
    staged = StagedRing(m.record, 2, mx.float32, landings=1)
    for ring in (Ring(m.record, 2), staged):
        with DirectReader(vault, ring, workers=1) as reader:
            assert await reader.read(bad - 1, 0) == reader.stride  # its neighbours are fine
            ring.commit()
            with pytest.raises(RecordChecksumError) as e:
                await reader.read(bad, 1)
            assert reader.rereads == 1
            assert await reader.read(bad + 1, 1) == reader.stride  # still usable
        err = e.value
        layer, expert = m.record_key(bad)
        assert isinstance(err, SmoeError) and "\n" not in str(err)
        assert (err.record, err.key, err.path, err.algorithm) == (
            bad,
            (layer, expert),
            vault.experts_path,
            algorithm,
        )
        assert err.expected == vault.manifest.checksums[bad] != err.actual
        message = str(err)
        assert f"expert {expert} of layer {layer} (record {bad}," in message
        assert str(vault.experts_path) in message and f"its {algorithm} checksum" in message
        assert f"smoe inspect {vault.path} --verify" in message and "dmesg" in message
    # The staged ring committed the two good records only: the bad landing never queued.
    assert staged.commits == 1 and staged.commit() == 1 and staged.pending() == 0


@pytest.mark.asyncio
async def test_a_staged_landing_is_verified_before_it_can_be_committed(q4, monkeypatch):
    """The landing of a read whose bytes mismatch is given back, never queued for the
    commit: with one landing buffer, the re-read reuses it and only good bytes commit."""
    m = q4.manifest
    ring = StagedRing(m.record, 2, mx.float32, landings=1)
    queued = []
    hand_over = ring._hand_over
    monkeypatch.setattr(ring, "_hand_over", lambda s, land: (queued.append(s), hand_over(s, land)))
    with DirectReader(q4, ring, workers=1) as reader:
        monkeypatch.setattr(os, "preadv", flipping({9 * reader.stride}, times=1))
        assert await reader.read(9, 1) == reader.stride
        assert reader.rereads == 1 and queued == [1] and ring.pending() == 1
    assert ring.commit() == 1
    for name, ref in expected(q4, 9).items():
        got = ring.banks()[0][name][1]
        assert mx.array_equal(got, ref.astype(got.dtype)).item(), name


@pytest.mark.asyncio
async def test_a_worker_reads_on_while_its_last_record_is_verified(q4, monkeypatch):
    """Hashing is pipelined: with one worker, the second record is read while the first
    one's hash is held up; neither read completes before its own hash is done."""
    reader = DirectReader(q4, Ring(q4.manifest.record, 2), workers=1)
    real_hash = reader.checks.hash
    gate, hashing, second_read = threading.Event(), threading.Event(), threading.Event()

    def held(data):
        if not hashing.is_set():  # the first record's hash only
            hashing.set()
            assert gate.wait(SAFETY), "the hash was never released"
        return real_hash(data)

    def spy(fd, buffers, offset):
        n = _real_preadv(fd, buffers, offset)
        if offset == 2 * reader.stride:
            second_read.set()
        return n

    reader.checks.hash = held
    monkeypatch.setattr(os, "preadv", spy)
    with reader:
        try:
            first = asyncio.create_task(reader.read(1, 0))
            assert await asyncio.to_thread(hashing.wait, SAFETY)  # record 1 is being hashed
            second = asyncio.create_task(reader.read(2, 1))
            assert await asyncio.to_thread(second_read.wait, SAFETY), "the worker waited"
            await loop_turns()
            assert not first.done() and not second.done()  # both wait for their hashes
        finally:
            gate.set()
        assert await first == reader.stride and await second == reader.stride


@pytest.mark.parametrize(("failures", "ok"), [(2, True), (3, False)])
@pytest.mark.parametrize("kind", [errno.EINTR, errno.EAGAIN])
@pytest.mark.asyncio
async def test_transient_errors_are_retried_three_times_at_most(
    q4, monkeypatch, kind, failures, ok
):
    calls = []

    def failing(fd, buffers, offset):
        calls.append(offset)
        if len(calls) <= failures:
            raise OSError(kind, os.strerror(kind))
        return _real_preadv(fd, buffers, offset)

    with DirectReader(q4, Ring(q4.manifest.record, 1)) as reader:
        monkeypatch.setattr(os, "preadv", failing)
        if ok:
            assert await reader.read(4, 0) == reader.stride
        else:
            with pytest.raises(VaultReadError) as e:
                await reader.read(4, 0)
            assert e.value.errno == kind and errno.errorcode[kind] in str(e.value)
    assert len(calls) == min(failures + 1, 3)


@pytest.mark.asyncio
async def test_an_io_error_on_the_direct_io_probe_names_the_file(q4, monkeypatch):
    def failing(fd, buffers, offset):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "preadv", failing)
    with pytest.raises(VaultReadError) as e:
        DirectReader(q4, Ring(q4.manifest.record, 1))
    assert isinstance(e.value, SmoeError) and e.value.errno == errno.EIO
    assert str(q4.experts_path) in str(e.value) and "(EIO)" in str(e.value)
    assert "dmesg" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.asyncio
async def test_verification_can_be_switched_off_for_benchmarks(q4, monkeypatch):
    with DirectReader(q4, Ring(q4.manifest.record, 1), workers=1, verify=False) as reader:
        monkeypatch.setattr(os, "preadv", flipping({3 * reader.stride}))
        assert await reader.read(3, 0) == reader.stride  # unchecked: the flip goes through
        assert reader.rereads == 0
