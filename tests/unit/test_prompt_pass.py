"""PromptPass with fake layers: the order chunks run in, and what a failure leaves."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from smoe.compute.prompt_pass import PromptPass, current_chunk
from smoe.models.registry import layer_major_prefill


class FakeMoE:
    """A MoE layer that logs who asks and serves each chunk x + layer."""

    def __init__(self, layer: int, log: list, fail_at: tuple[int, int] | None = None):
        self.layer, self.log, self.fail_at = layer, log, fail_at

    def __call__(self, chunk_id: int, x: mx.array) -> mx.array:
        self.log.append(("attention", self.layer, chunk_id))
        chunk = current_chunk()
        assert chunk is not None
        return chunk.ask(self, x, np.array([chunk_id]))

    def prompt_layer_steps(self, calls):
        """Serves a chunk a step, as StreamingExperts does where the union fits."""
        ids = [int(indices.item()) for _, indices in calls]
        self.log.append(("serve", self.layer, tuple(ids)))
        out = []
        for x, _ in calls:
            if self.fail_at is not None and self.fail_at[0] == self.layer:
                raise OSError("a read failed")
            out.append(x + self.layer)
            yield 1.0  # one chunk's experts
        return out


def model_of(layers: list[FakeMoE], log: list):
    def run(piece: list[int]) -> int:
        chunk_id = piece[0]
        x = mx.array(0)
        try:
            for layer in layers:
                x = layer(chunk_id, x)
            return int(x.item()) + chunk_id * 100
        finally:
            log.append(("end", chunk_id))

    return run


def test_chunks_run_each_layer_in_prompt_order_and_are_served_together():
    log: list = []
    layers = [FakeMoE(i, log) for i in range(3)]
    p = PromptPass(model_of(layers, log), [[0, 0], [1], [2, 2, 2]])
    assert p.tokens == 6 and not p.done
    units = []
    while not p.done:
        units.append(p.step())
    # each chunk started (half a chunk-layer), then at each layer a serve step per chunk
    # and a resume per chunk (half each)
    assert units == [0.5] * 3 + [0.5] * 6 * 3 and p.layers_served == 3
    assert p.results() == [0 + 3, 100 + 3, 200 + 3]  # 0 + 1 + 2 from the layers
    want = []
    for layer in range(3):
        want += [("attention", layer, c) for c in range(3)]
        want.append(("serve", layer, (0, 1, 2)))
    want += [("end", 0), ("end", 1), ("end", 2)]
    assert log == want


def test_a_failure_ends_every_chunk_and_is_raised():
    log: list = []
    layers = [FakeMoE(0, log), FakeMoE(1, log, fail_at=(1, 0))]
    p = PromptPass(model_of(layers, log), [[0], [1]])
    assert p.advance(1)  # started: every chunk waits at layer 0
    assert p.advance(2)  # layer 0 served, both resumed: every chunk waits at layer 1
    with pytest.raises(OSError, match="a read failed"):
        p.advance()
    assert ("end", 0) in log and ("end", 1) in log  # each chunk unwound (its finally ran)
    assert p.done


def test_a_caller_can_stop_between_any_two_chunks():
    """advance(budget) spends at most budget units (a chunk started or resumed, a step of
    serving a layer): a long prompt's turn ends between chunks, not after a whole layer of
    them."""
    log: list = []
    layers = [FakeMoE(i, log) for i in range(2)]
    p = PromptPass(model_of(layers, log), [[c] for c in range(5)])
    turns = 0
    while p.advance(1):  # a chunk-layer's work a turn: two units
        turns += 1
        chunk_units = [e for e in log if e[0] == "attention"]
        assert len(chunk_units) <= 2 * turns  # never more than the budget a turn
    assert p.results() == [c * 100 + 1 for c in range(5)]
    assert turns == 12  # 25 half units (5 starts; per layer 5 serve steps, 5 resumes)


def test_a_model_without_moe_layers_finishes_at_the_first_step():
    p = PromptPass(lambda piece: sum(piece), [[1, 2], [3]])
    assert not p.advance()
    assert p.results() == [3, 3]
    assert current_chunk() is None  # outside any chunk


def test_which_architectures_prefill_layer_major():
    for arch in ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3"):
        assert layer_major_prefill({"model_type": arch})
    assert layer_major_prefill({"model_type": "gpt_oss"})  # sliding first, as published
    sliding_second = {
        "model_type": "gpt_oss",
        "layer_types": ["full_attention", "sliding_attention"],
    }
    assert not layer_major_prefill(sliding_second)  # its window mask reads layer 1's fill
    assert not layer_major_prefill({"model_type": "llama"})  # not known: chunk by chunk


def test_a_late_chunks_attention_costs_more_the_longer_its_context():
    """A turn of late chunks is not several times longer than one of early chunks: their
    attention half counts once per CONTEXT_UNIT tokens of context."""
    from smoe.compute.prompt_pass import CHUNK_HALF, CONTEXT_UNIT

    log: list = []
    chunk = CONTEXT_UNIT // 2
    pieces = [[i] * chunk for i in range(6)]
    p = PromptPass(model_of([FakeMoE(0, log)], log), pieces)
    starts = [p.step() for _ in pieces]  # each chunk started: its attention at layer 0
    assert starts == [CHUNK_HALF * max(1.0, (i + 1) * chunk / CONTEXT_UNIT) for i in range(6)]
    assert starts[-1] == 3 * CHUNK_HALF


class WaveSource:
    """A ring of ``capacity`` slots that logs what each acquire pins (a fake StreamSource)."""

    def __init__(self, capacity: int):
        self.slots, self.pinned, self.wait_seconds = capacity, [], 0.0

    def capacity(self) -> int:
        return self.slots

    def acquire(self, layer: int, experts: list[int]) -> list[int]:
        self.pinned.append(list(experts))
        return list(range(len(experts)))

    def release(self, slots: list[int]) -> None:
        pass


def test_waves_leave_room_for_others_and_a_step_is_about_one_chunks_experts(monkeypatch):
    """A union larger than what the pass may hold runs in waves of three quarters of the
    ring, each expert in one wave; a step computes one wave for a group of chunks worth
    about one chunk's expert work."""
    from smoe.compute.prompt_layer import ROOM_SHARE, PromptLayerServing
    from smoe.compute.switch import CallAssembly

    class Layer(PromptLayerServing):
        layer, _tracer = 0, None

        def __init__(self, source: WaveSource) -> None:
            self._source = source

        def _compute(self, x, idx, experts, slots, ref, sort=None):
            return mx.zeros((len(experts),))

    monkeypatch.setattr(CallAssembly, "add", lambda self, mine, compute: None)
    monkeypatch.setattr(CallAssembly, "result", lambda self: mx.zeros((1,)))
    source = WaveSource(capacity=16)
    rng = np.random.default_rng(0)
    calls = [(mx.zeros((8, 4)), rng.permutation(32)[:16].reshape(8, 2)) for _ in range(12)]
    work = list(Layer(source).prompt_layer_steps(calls))
    held = 16 - 16 // ROOM_SHARE
    union = np.unique(np.concatenate([idx.reshape(-1) for _, idx in calls])).tolist()
    waves = {tuple(w) for w in source.pinned}
    assert all(len(w) <= held for w in waves)
    assert sorted(e for w in waves for e in w) == union  # each expert in one wave
    assert sum(work) == pytest.approx(len(calls)) and max(work) <= 1.5
