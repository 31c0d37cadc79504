"""The default number of serving processes follows the CPUs the process may actually use: its
affinity mask, capped by its cgroup's CPU quota (cgroup v2 ``cpu.max``, or v1
``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``), read here from fake cgroup trees."""

from __future__ import annotations

import math
import os
from fractions import Fraction
from pathlib import Path

import pytest
from context_engine.config import Config, cgroup_cpu_limit
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

AFFINITY = len(os.sched_getaffinity(0))


def v2(root: Path, cpu_max: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "cpu.max").write_text(cpu_max + "\n")
    return root


def v1(root: Path, quota: str, period: str = "100000", controller: str = "cpu") -> Path:
    directory = root / controller
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "cpu.cfs_quota_us").write_text(quota + "\n")
    (directory / "cpu.cfs_period_us").write_text(period + "\n")
    return root


@pytest.fixture
def host_of_64_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process allowed on 64 cores, as in a container on a large host."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))


def test_v2_without_a_quota_leaves_the_affinity(tmp_path: Path, host_of_64_cpus: None):
    root = v2(tmp_path, "max 100000")
    assert cgroup_cpu_limit(root) is None
    assert Config().worker_count(cgroup_root=root) == 64


@pytest.mark.parametrize(("cpu_max", "cpus"), [
    ("200000 100000", 2),  # 2 CPUs
    ("150000 100000", 2),  # 1.5 CPUs: rounded up
    ("50000 100000", 1),  # half a CPU: still one process
    ("1000 100000", 1),
    ("400000 50000", 8),  # another period
])
def test_v2_quota_caps_the_workers(tmp_path: Path, host_of_64_cpus: None, cpu_max: str,
                                   cpus: int):
    root = v2(tmp_path, cpu_max)
    assert cgroup_cpu_limit(root) == cpus
    assert Config().worker_count(cgroup_root=root) == cpus


def test_a_quota_above_the_affinity_does_not_raise_the_count(tmp_path: Path):
    root = v2(tmp_path, f"{(AFFINITY + 62) * 100000} 100000")
    assert cgroup_cpu_limit(root) == AFFINITY + 62
    assert Config().worker_count(cgroup_root=root) == AFFINITY


@pytest.mark.parametrize("controller", ["cpu", "cpu,cpuacct"])
def test_v1_quota_caps_the_workers(tmp_path: Path, host_of_64_cpus: None, controller: str):
    root = v1(tmp_path, "250000", "100000", controller=controller)
    assert cgroup_cpu_limit(root) == 3
    assert Config().worker_count(cgroup_root=root) == 3


def test_v1_without_a_quota_leaves_the_affinity(tmp_path: Path, host_of_64_cpus: None):
    root = v1(tmp_path, "-1")
    assert cgroup_cpu_limit(root) is None
    assert Config().worker_count(cgroup_root=root) == 64


def test_v2_is_read_before_v1(tmp_path: Path, host_of_64_cpus: None):
    root = v1(v2(tmp_path, "max 100000"), "200000")
    assert cgroup_cpu_limit(root) is None
    root = v1(v2(tmp_path, "300000 100000"), "-1")
    assert cgroup_cpu_limit(root) == 3


@pytest.mark.parametrize("layout", ["empty", "absent", "v1 quota without period",
                                    "garbage v2", "zero period"])
def test_missing_or_malformed_files_mean_no_limit(tmp_path: Path, host_of_64_cpus: None,
                                                  layout: str):
    root = tmp_path / "cgroup"
    if layout == "empty":
        root.mkdir()
    elif layout == "v1 quota without period":
        (root / "cpu").mkdir(parents=True)
        (root / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    elif layout == "garbage v2":
        v2(root, "garbage")
    elif layout == "zero period":
        v2(root, "200000 0")
    assert cgroup_cpu_limit(root) is None
    assert Config().worker_count(cgroup_root=root) == 64


def test_explicit_workers_ignore_the_cgroup(tmp_path: Path):
    root = v2(tmp_path, "100000 100000")
    assert Config(workers=5).worker_count(cgroup_root=root) == 5
    config = Config.from_env({"CE_WORKERS": "0"})
    assert config.worker_count(cgroup_root=root) == 1


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(quota=st.integers(min_value=1, max_value=10**9),
       period=st.integers(min_value=1000, max_value=10**6))
def test_the_limit_is_the_quota_in_cpus_rounded_up(tmp_path: Path, quota: int, period: int):
    expected = max(1, math.ceil(Fraction(quota, period)))
    assert cgroup_cpu_limit(v2(tmp_path / "v2", f"{quota} {period}")) == expected
    assert cgroup_cpu_limit(v1(tmp_path / "v1", str(quota), str(period))) == expected
