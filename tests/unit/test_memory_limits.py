"""The default ring budget honours the process's cgroup memory limit (v2 and v1), not only
the host's MemAvailable: a container or a systemd unit may use less than the host has free.
Fake /proc and /sys trees stand in for the kernel's."""

from __future__ import annotations

from pathlib import Path

import pytest

import smoe.plan.memory as memory_module
import smoe.plan.ring as ring_plan
from smoe.plan.memory import available_memory
from smoe.plan.ring import Device, loaded_backbone_bytes, plan_ring
from smoe.vault.convert import convert

GiB = 1 << 30


def fake_system(root: Path, mem_available: int, cgroup: str, files: dict[str, str]) -> Path:
    """A tree with proc/meminfo, proc/self/cgroup and the given sys/fs/cgroup files."""
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/meminfo").write_text(
        f"MemTotal:       67108864 kB\nMemFree:         1000000 kB\n"
        f"MemAvailable:   {mem_available // 1024} kB\n"
    )
    (root / "proc/self/cgroup").write_text(cgroup)
    for rel, text in files.items():
        path = root / "sys/fs/cgroup" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_no_cgroup_limit_is_mem_available(tmp_path):
    root = fake_system(
        tmp_path,
        16 * GiB,
        "0::/user.slice\n",
        {"user.slice/memory.max": "max\n", "user.slice/memory.current": f"{GiB}\n"},
    )
    assert available_memory(root) == 16 * GiB


def test_cgroup_v2_tightest_ancestor_less_its_usage(tmp_path):
    """The limit binds at a parent (a systemd slice): 4 GiB there, 3 GiB used (of which
    1 GiB is inactive file cache the kernel would drop first) -> 2 GiB, though the host
    has 16 GiB available and the process's own cgroup has no limit."""
    root = fake_system(
        tmp_path,
        16 * GiB,
        "0::/app.slice/smoe.service\n",
        {
            "app.slice/memory.max": f"{4 * GiB}\n",
            "app.slice/memory.current": f"{3 * GiB}\n",
            "app.slice/memory.stat": f"anon {2 * GiB}\ninactive_file {GiB}\nactive_file 0\n",
            "app.slice/smoe.service/memory.max": "max\n",
            "app.slice/smoe.service/memory.high": "max\n",
            "app.slice/smoe.service/memory.current": f"{GiB}\n",
        },
    )
    assert available_memory(root) == 2 * GiB


def test_cgroup_v2_in_a_container_reads_the_mount_root(tmp_path):
    """A container's cgroup namespace shows '0::/' and the container's own limit at the
    mount's root; memory.high (a throttling cap) counts like memory.max."""
    root = fake_system(
        tmp_path,
        64 * GiB,
        "0::/\n",
        {"memory.max": f"{8 * GiB}\n", "memory.high": f"{6 * GiB}\n", "memory.current": "0\n"},
    )
    assert available_memory(root) == 6 * GiB


def test_cgroup_v1_limit_and_usage(tmp_path):
    """v1: memory.limit_in_bytes less memory.usage_in_bytes, walking up from the host path
    that a container shows (not mounted there) to the mount's root (the container's)."""
    root = fake_system(
        tmp_path,
        32 * GiB,
        "12:pids:/docker/abc\n4:cpu,memory:/docker/abc\n0::/\n",
        {
            "memory/memory.limit_in_bytes": f"{3 * GiB}\n",
            "memory/memory.usage_in_bytes": f"{GiB}\n",
            "memory/memory.stat": "cache 0\ntotal_inactive_file 0\n",
        },
    )
    assert available_memory(root) == 2 * GiB
    # v1's "no limit" is a huge number: MemAvailable decides
    (root / "sys/fs/cgroup/memory/memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert available_memory(root) == 32 * GiB


def test_usage_above_the_limit_leaves_nothing(tmp_path):
    root = fake_system(
        tmp_path,
        8 * GiB,
        "0::/x\n",
        {"x/memory.max": f"{GiB}\n", "x/memory.current": f"{2 * GiB}\n"},
    )
    assert available_memory(root) == 0


def test_no_proc_at_all_is_unknown(tmp_path):
    assert available_memory(tmp_path) is None


def test_default_ring_budget_fits_the_cgroup_limit(hf_dir, tmp_path, monkeypatch):
    """The engine's default ring: half the available memory beside the backbone. Under a
    cgroup cap that is half the cap's room, not half the host's MemAvailable."""
    import mlx.core as mx

    vault = convert(hf_dir("qwen3_moe"), tmp_path / "v")
    m, cpu = vault.manifest, Device(gpu=False, discrete=False)
    per_slot = ring_plan.slot_bytes(
        ring_plan.ring_kind("auto", m.record, mx.float32, cpu), m.record, mx.float32
    )
    backbone = loaded_backbone_bytes(vault, mx.float32)
    room = 2 * (backbone + 5 * per_slot)  # the default takes half: the backbone and 5 slots
    root = fake_system(
        tmp_path / "sys",
        64 * GiB,
        "0::/user.slice/user-1000.slice/session-2.scope\n",
        {
            "user.slice/user-1000.slice/memory.max": f"{room + GiB}\n",
            "user.slice/user-1000.slice/memory.current": f"{GiB}\n",
        },
    )
    monkeypatch.setattr(memory_module, "SYSTEM_ROOT", root)
    plan = plan_ring(vault, requested="auto", dtype=mx.float32, device=cpu)
    assert plan.slots == 5 < m.num_records


@pytest.mark.parametrize("text", ["", "garbage\n", "0::\n"])
def test_odd_cgroup_files_fall_back_to_mem_available(tmp_path, text):
    root = fake_system(tmp_path, 4 * GiB, text, {"memory.max": "junk\n"})
    assert available_memory(root) == 4 * GiB
