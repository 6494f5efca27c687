"""How much memory this process may still take: the system's and every memory cgroup's room
(Linux; None elsewhere). Read when a plan has no budget of its own to go by."""

from __future__ import annotations

from pathlib import Path

# Where /proc and /sys are: tests point this at a fake tree.
SYSTEM_ROOT = Path("/")


def available_memory(root: Path | None = None) -> int | None:
    """Bytes of memory this process may still take (Linux), else None: the least of the
    system's MemAvailable and, for each memory cgroup (v2 or v1) it is in and each parent,
    the limit less the usage (a container's or a systemd unit's cap binds before the host's
    free memory does)."""
    root = SYSTEM_ROOT if root is None else root
    found = [m for m in (_mem_available(root), *_cgroup_rooms(root)) if m is not None]
    return min(found) if found else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _number(path: Path) -> int | None:
    """An integer control file's value; None if absent, unreadable or 'max' (no limit)."""
    text = _read(path)
    try:
        return int(text.strip()) if text is not None else None
    except ValueError:
        return None


def _mem_available(root: Path) -> int | None:
    for line in (_read(root / "proc/meminfo") or "").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def _reclaimable(stat: Path, key: str) -> int:
    """Inactive file cache (from memory.stat): counted in usage, yet the kernel drops it
    before it refuses memory, as the kubelet's working set also leaves it out."""
    for line in (_read(stat) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def _cgroup_rooms(root: Path) -> list[int]:
    """Room (limit - usage) in each limited memory cgroup of this process and its parents.

    /proc/self/cgroup names the cgroup: '0::/PATH' (v2, under /sys/fs/cgroup) and
    'N:...memory...:/PATH' (v1, under /sys/fs/cgroup/memory). Directories that are not
    there are skipped: in a container the path is the host's, and the container's own
    cgroup is the mount's root, which the walk up reaches.
    """
    fs = root / "sys/fs/cgroup"
    rooms = []
    for line in (_read(root / "proc/self/cgroup") or "").splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, cgroup = parts
        files: tuple[tuple[str, ...], str, str]
        if controllers == "":  # v2 (the unified hierarchy; "unified" in hybrid setups)
            mounts = [fs, fs / "unified"]
            files = (("memory.max", "memory.high"), "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            mounts = [fs / "memory"]
            files = (("memory.limit_in_bytes",), "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        limits, usage_file, cache_key = files
        for mount in mounts:
            rel = Path(cgroup.strip().lstrip("/"))
            for level in [rel, *rel.parents]:
                d = mount / level
                usage = _number(d / usage_file)
                caps = [c for c in (_number(d / f) for f in limits) if c is not None]
                if usage is None or not caps:
                    continue
                used = max(0, usage - _reclaimable(d / "memory.stat", cache_key))
                rooms.append(max(0, min(caps) - used))
    return rooms
