"""The staged ring: host landings, commits into per-component arrays in the compute dtype,
banks, and the reader and engine on top of it.

Threads are synchronised with events and with the ring's own counters, never by sleeping.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import mlx.core as mx
import numpy as np
import pytest

from smoe.io import DirectReader, StagedRing, UnifiedRing
from smoe.vault.convert import convert
from smoe.vault.export import read_layer
from smoe.vault.format import Vault
from smoe.vault.layout import RecordLayout

SAFETY = 30  # seconds: a bug fails a test instead of hanging it; never used to synchronise

LAYOUT = RecordLayout.build(
    [
        ("w", "uint32", (256, 128)),
        ("scales", "bfloat16", (256, 16)),
        ("biases", "bfloat16", (256, 16)),
    ]
)


def land(ring: StagedRing, slot: int, fill: int) -> None:
    with ring.landing(slot) as memory:
        np.frombuffer(memory, np.uint8)[:] = fill


def expected_scales(fill: int) -> np.ndarray:
    """The float32 value of bfloat16 scales whose bytes are all ``fill``."""
    word = np.uint32((fill << 8 | fill) << 16)
    return np.array([word], dtype=np.uint32).view(np.float32)[0]


def wait_until(predicate, what: str) -> None:
    done = threading.Event()
    for _ in range(SAFETY * 1000):
        if predicate():
            return
        done.wait(0.001)  # polling a counter: the event is never set, this only yields
    raise AssertionError(f"timed out waiting for {what}")


# ---------------------------------------------------------------------------- commits
@pytest.mark.parametrize("slots", [8, 1024])
def test_commits_convert_in_place_and_touch_no_more_than_a_record(slots):
    """A commit converts the landed records into their slots in place: MLX's active
    memory does not change and its peak grows by the converted components of the landed
    records, whatever the ring size (a copy of the arrays would add 160 KB x slots)."""
    ring = StagedRing(LAYOUT, slots, mx.float32, landings=4)
    banks = ring.banks()
    assert len(banks) == 1 and banks[0]["scales"].dtype == mx.float32
    assert banks[0]["w"].shape == (slots, 256, 128) and banks[0]["w"].dtype == mx.uint32
    assert ring.nbytes == slots * (256 * 128 * 4 + 2 * 256 * 16 * 4)
    for i in range(4):
        land(ring, slots - 1 - i, i + 1)
    assert ring.pending() == 4
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    assert ring.commit() == 4
    assert mx.get_active_memory() == before
    # Scales and biases of the 4 records, plus one record's worth for the allocator (its
    # rounding and one temporary, seen in full-suite runs): a copy of the ring is 160 KB x
    # slots, which this still refuses at 8 slots and at 1024.
    assert mx.get_peak_memory() - before <= 5 * 2 * 256 * 16 * 4
    arrays = ring.banks()[0]
    for i in range(4):
        slot = slots - 1 - i
        assert (np.array(arrays["w"][slot]).view(np.uint8) == i + 1).all()
        assert (np.array(arrays["scales"][slot]) == expected_scales(i + 1)).all()
    assert ring.commit() == 0 and ring.commits == 4


def test_a_slot_landed_twice_before_a_commit_keeps_the_last():
    ring = StagedRing(LAYOUT, 4, mx.float32, landings=3)
    land(ring, 2, 7)
    land(ring, 2, 9)
    assert ring.commit() == 1
    assert (np.array(ring.banks()[0]["w"][2]).view(np.uint8) == 9).all()
    for _ in range(3):  # every landing came back to the pool
        land(ring, 0, 1)
    ring.commit()


def test_banks_split_the_slots_and_never_alias_a_landing():
    """Banks of at most max_bank_bytes per array; a one-slot bank still
    holds its record after the landing buffer is reused (MLX returns an update that
    covers a whole array as the update itself, so a bank has at least two rows)."""
    per_slot = 256 * 128 * 4  # the uint32 weight: the largest array
    ring = StagedRing(LAYOUT, 5, mx.float32, landings=1, max_bank_bytes=2 * per_slot)
    assert [b["w"].shape[0] for b in ring.banks()] == [2, 2, 2]  # 2 + 2 + 1 (padded)
    assert [ring.locate(s) for s in range(5)] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
    one = StagedRing(LAYOUT, 3, mx.float32, landings=1, max_bank_bytes=per_slot)
    land(one, 1, 5)
    one.commit()
    land(one, 0, 6)  # the same landing buffer, rewritten
    one.commit()
    assert (np.array(one.banks()[1]["w"][0]).view(np.uint8) == 5).all()
    assert (np.array(one.banks()[0]["w"][0]).view(np.uint8) == 6).all()
    with pytest.raises(ValueError, match="more than a bank"):
        StagedRing(LAYOUT, 3, mx.float32, max_bank_bytes=per_slot - 1)


def test_a_failed_read_gives_its_landing_back():
    ring = StagedRing(LAYOUT, 2, mx.float32, landings=1)
    with pytest.raises(OSError), ring.landing(0):
        raise OSError(5, "injected")
    assert ring.pending() == 0
    land(ring, 1, 3)  # the one landing is free again
    assert ring.commit() == 1


# ---------------------------------------------------------------------------- threads
def test_a_reader_waits_for_a_free_landing_until_the_compute_thread_commits():
    ring = StagedRing(LAYOUT, 4, mx.float32, landings=1)
    land(ring, 0, 1)  # the only landing is now waiting for its commit
    second = threading.Thread(target=land, args=(ring, 1, 2))
    second.start()
    wait_until(lambda: ring.waiting_for_landing == 1, "the reader to wait for a landing")
    assert ring.pending() == 1
    ring.commit()  # frees the landing: the reader lands its record
    second.join(SAFETY)
    assert not second.is_alive() and ring.pending() == 1
    ring.commit()
    assert (np.array(ring.banks()[0]["w"][1]).view(np.uint8) == 2).all()


def test_block_on_commits_while_it_waits():
    """The compute thread waiting for a reservation commits records as they land, so
    I/O threads never wait on it for long; what landed before the result is committed
    before block_on returns."""
    ring = StagedRing(LAYOUT, 4, mx.float32, landings=1)
    result: concurrent.futures.Future[str] = concurrent.futures.Future()

    def io() -> None:
        for slot in range(3):  # one landing: each needs the previous one committed
            land(ring, slot, slot + 1)
        result.set_result("done")

    t = threading.Thread(target=io)
    t.start()
    assert ring.block_on(result) == "done"
    t.join(SAFETY)
    assert ring.pending() == 0 and ring.commits == 3
    failed: concurrent.futures.Future[str] = concurrent.futures.Future()
    failed.set_exception(OSError(5, "injected"))
    with pytest.raises(OSError, match="injected"):
        ring.block_on(failed)


def test_close_wakes_a_reader_waiting_for_a_landing():
    ring = StagedRing(LAYOUT, 2, mx.float32, landings=1)
    land(ring, 0, 1)
    errors: list[BaseException] = []

    def second() -> None:
        try:
            land(ring, 1, 2)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=second)
    t.start()
    wait_until(lambda: ring.waiting_for_landing == 1, "the reader to wait")
    ring.close()
    t.join(SAFETY)
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    assert ring.pending() == 0  # uncommitted landings were dropped
    with pytest.raises(RuntimeError, match="closed"), ring.landing(0):
        pass


# ---------------------------------------------------------------------------- reader
@pytest.fixture(scope="module")
def bf16_vault(hf_dir, tmp_path_factory) -> Vault:
    """A 4-bit vault with bfloat16 scales (the default format)."""
    return convert(hf_dir("qwen3_moe"), tmp_path_factory.mktemp("staged") / "v")


@pytest.mark.parametrize("bounce", [False, True])
def test_reads_through_landings_hold_the_records_in_the_compute_dtype(bf16_vault, bounce):
    """DirectReader into a staged ring: after the commits, every slot equals the stacked
    expert tensors (scales converted to float32 exactly), with and without a bounce
    buffer between the disk and the landing."""
    m = bf16_vault.manifest
    placement = {slot: record for slot, record in enumerate(range(m.num_records - 1, 3, -2))}
    ring = StagedRing(m.record, len(placement), mx.float32, landings=2, bounce=bounce)

    async def read_all(reader: DirectReader) -> None:
        await asyncio.gather(*(reader.read(r, s) for s, r in placement.items()))

    with DirectReader(bf16_vault, ring, workers=3) as reader:
        future = concurrent.futures.Future()
        t = threading.Thread(target=lambda: future.set_result(asyncio.run(read_all(reader))))
        t.start()
        ring.block_on(future)  # this thread commits, as the compute thread does
        t.join(SAFETY)
    arrays = ring.banks()[0]
    for slot, record in placement.items():
        layer, expert = m.record_key(record)
        for name, stacked in read_layer(bf16_vault, layer).items():
            want = stacked[expert]
            if mx.issubdtype(want.dtype, mx.floating):
                want = want.astype(mx.float32)
            got = arrays[name][slot]
            assert got.dtype == want.dtype and mx.array_equal(got, want), (slot, name)


def test_the_unified_ring_reports_nothing_to_commit(bf16_vault):
    ring = UnifiedRing(bf16_vault.manifest.record, 2)
    done: concurrent.futures.Future[int] = concurrent.futures.Future()
    done.set_result(3)
    assert ring.commit() == 0 and ring.block_on(done) == 3
    assert ring.locate(1) == (0, 1) and len(ring.banks()) == 1
