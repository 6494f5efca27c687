"""Engine.learning.warm_up: MLX compiles the kernels a reply needs before anyone waits for it.

On the CPU, MLX builds its fused kernels with the C++ compiler on first use and keeps them
in TMPDIR/mlx/<version>/cpu. A fresh TMPDIR is a fresh machine, so a subprocess started with
one counts the kernels a first reply compiles, after a warm-up and without one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from smoe.chat.demo import demo_vault
from smoe.engine import Engine

SCRIPT = textwrap.dedent(
    """
    import json, pathlib, sys
    import smoe.util.loop
    from smoe.engine import Engine

    vault, warm, cache = sys.argv[1], sys.argv[2] == "1", pathlib.Path(sys.argv[3])
    SAMPLING = dict(temperature=0.8, top_p=0.9, seed=5)

    def kernels():
        return len(list(cache.rglob("*.so"))) if cache.exists() else 0

    async def main():
        async with Engine.open(vault) as engine:
            if warm:
                await engine.learning.warm_up(**SAMPLING)
            before = kernels()
            conv = engine.conversation()
            async for _ in conv.send("Who was Moses?", max_tokens=8, **SAMPLING):
                pass
            print(json.dumps({"before_reply": before, "after_reply": kernels()}))

    smoe.util.loop.run(main())
    """
)


def first_reply_kernels(vault, tmp_path, warm: bool) -> dict:
    tmp = tmp_path / ("warm" if warm else "cold")
    tmp.mkdir()
    cache = tmp / "mlx"
    env = {**os.environ, "TMPDIR": str(tmp)}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(vault), "1" if warm else "0", str(cache)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_after_a_warm_up_the_first_reply_compiles_nothing(tmp_path):
    vault = demo_vault()
    cold = first_reply_kernels(vault, tmp_path, warm=False)
    assert cold["after_reply"] > cold["before_reply"]  # a fresh machine's reply compiles
    warm = first_reply_kernels(vault, tmp_path, warm=True)
    assert warm["before_reply"] > 0 and warm["after_reply"] == warm["before_reply"]


@pytest.mark.asyncio
async def test_a_warm_up_reads_a_few_tokens_experts_and_counts_no_popularity():
    vault = demo_vault()
    async with Engine.open(vault) as engine:
        session = engine.debug.popularity.session.copy()
        sched = engine.stats().scheduler
        before = sched.bytes_read()
        seconds = await engine.learning.warm_up(temperature=0.7, seed=1)
        read = sched.bytes_read() - before
        m = engine.vault.manifest
        one_token = m.shape.experts_per_token * len(m.shape.moe_layers) * m.record.stride
        assert seconds > 0
        assert 0 < read <= 3 * one_token  # the prompt is one token repeated
        assert np.array_equal(engine.debug.popularity.session, session)  # this session's counts
        # the engine answers as before
        out = [
            e.token async for e in engine.generate([5, 17, 99], max_tokens=4) if e.token is not None
        ]
        assert len(out) == 4 and engine.debug.popularity.session.sum() > session.sum()
