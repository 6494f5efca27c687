"""`smoe serve`'s GET /metrics: the server's counters and gauges in Prometheus' text
exposition format (version 0.0.4), for a scraper or a dashboard. Names start with
``smoe_``; counters end in ``_total``. Read from ``Engine.stats()``, as /v1/smoe/stats is."""

from __future__ import annotations

from collections.abc import Iterable

from smoe.engine import Engine
from smoe.serve.counters import ServerCounts

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _metric(name: str, kind: str, help_: str, samples: Iterable[tuple[str, float]]) -> str:
    """One metric family: its HELP and TYPE lines, then each ``(labels, value)`` sample."""
    lines = [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{labels} {value:g}" for labels, value in samples]
    return "\n".join(lines)


def render(engine: Engine, counts: ServerCounts) -> str:
    """The exposition text of the server now: its ``counts`` and ``engine``'s stats."""
    now = engine.stats()
    stats, ring, queues, batch = now.scheduler, now.ring, now.queues, now.batch
    families = [
        _metric(
            "smoe_requests_total",
            "counter",
            "HTTP requests answered, by status code.",
            ((f'{{code="{code}"}}', n) for code, n in sorted(counts.by_status.items())),
        ),
        _metric(
            "smoe_prompt_tokens_total",
            "counter",
            "Prompt tokens of answered generations.",
            [("", counts.prompt_tokens)],
        ),
        _metric(
            "smoe_generated_tokens_total",
            "counter",
            "Tokens generated for answered requests.",
            [("", counts.generated_tokens)],
        ),
        _metric(
            "smoe_prefix_reused_tokens_total",
            "counter",
            "Prompt tokens whose keys and values a cached prefix gave.",
            [("", counts.reused_tokens)],
        ),
        _metric(
            "smoe_expert_bytes_read_total",
            "counter",
            "Bytes of expert records read.",
            [("", stats.bytes_read())],
        ),
        _metric(
            "smoe_expert_hit_rate",
            "gauge",
            "Share of expert uses served from the ring since start.",
            [("", now.hit_rate)],  # with the resident tables' uses (EngineStats.hits)
        ),
        _metric(
            "smoe_ring_slots",
            "gauge",
            "Expert slots of the ring, and those filled.",
            [('{state="all"}', ring.slots), ('{state="filled"}', ring.filled)],
        ),
        _metric(
            "smoe_read_queue_depth",
            "gauge",
            "Expert reads waiting, by priority; in flight.",
            [
                ('{queue="demand"}', queues.demand),
                ('{queue="speculative"}', queues.speculative),
                ('{queue="in_flight"}', queues.in_flight),
            ],
        ),
        _metric(
            "smoe_batch_requests",
            "gauge",
            "Requests decoding together, and waiting for a place.",
            [('{state="active"}', batch.active), ('{state="waiting"}', batch.waiting)],
        ),
        _metric(
            "smoe_batch_mean_rows",
            "gauge",
            "Mean rows per decode step since start.",
            [("", batch.mean_rows_per_step)],
        ),
    ]
    return "\n".join(families) + "\n"
