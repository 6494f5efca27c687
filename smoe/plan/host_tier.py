"""How many expert images the host tier keeps (smoe.io.host_tier): ``--host-memory``.

The tier sits between a staged ring and the vault, in host memory. By default it exists
only where the ring lives in a discrete GPU's memory: there half of the host's available
memory (cgroup limits included: smoe.plan.memory) goes to it, at most one image per
record (it keeps copies of some of the ring's records: a tier of every record never gives
one up), none where the ring holds every record, and none when that is under one image. ``--host-memory 0`` turns it off; a size asks for that much (on top of --memory,
which stays the GPU's), refused where the ring is host memory already (unified) or under
expert parallelism (each rank's ring is its own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from smoe.errors import SmoeError
from smoe.io.host_tier import image_layout
from smoe.plan.memory import available_memory
from smoe.util.sizes import as_written, format_bytes, round_size
from smoe.vault.layout import RecordLayout

DEFAULT_SHARE = 0.5  # of the host's available memory, by default


@dataclass(frozen=True)
class HostTierPlan:
    images: int  # experts the tier keeps (0: no tier)
    image_bytes: int  # host memory one takes

    @property
    def nbytes(self) -> int:
        return self.images * self.image_bytes

    def line(self) -> str:
        """'host tier 64.0 GB = 6,028 experts x 10.62 MB' (or 'no host tier')."""
        if not self.images:
            return "no host tier"
        return (
            f"host tier {format_bytes(self.nbytes)} = {self.images:,} experts x "
            f"{format_bytes(self.image_bytes)}"
        )


NONE = HostTierPlan(0, 0)


def plan_host_tier(
    layout: RecordLayout,
    num_records: int,
    host_memory: int | None,
    *,
    ring_kind: str,
    ring_slots: int,
    dtype: Any,
    discrete: bool,
    distributed: bool,
    available: int | None = None,
) -> HostTierPlan:
    """The tier for a model of ``num_records`` records of ``layout`` beside a ring of
    ``ring_slots`` (module doc); ``host_memory`` in bytes (None: the default). ``available``:
    the host's available memory (None: measured now). SmoeError naming the fix for a size
    that cannot work."""
    _, image_bytes = image_layout(layout, dtype)
    room = num_records if ring_slots < num_records else 0
    if host_memory is None:
        if ring_kind != "staged" or not discrete or distributed or not room:
            return NONE
        free = available_memory() if available is None else available
        images = int((free or 0) * DEFAULT_SHARE) // image_bytes
        return HostTierPlan(min(images, room), image_bytes) if images else NONE
    asked = host_memory
    if asked == 0:
        return NONE
    if ring_kind != "staged":
        raise SmoeError(
            "--host-memory needs a ring in a GPU's memory (a staged ring): this ring is host "
            "memory already; leave --host-memory out, or add --ring staged"
        )
    if distributed:
        raise SmoeError("--host-memory does not run with --distributed yet; leave it out")
    images = asked // image_bytes
    if images < 1:
        raise SmoeError(
            f"--host-memory {as_written(host_memory, str)} holds no expert of "
            f"{format_bytes(image_bytes)}: use --host-memory {round_size(image_bytes)} or "
            "more, or 0 for none"
        )
    return HostTierPlan(min(images, room), image_bytes) if room else NONE
