"""Folding a dead worker's metrics files (telemetry/multiprocess.py), against prometheus_client's
own merge of the unfolded files: real processes write real multiprocess files (counters,
labelled histograms, and gauges of every mode the service or a library may use), and the
endpoint's samples after folding must equal its samples before, file by file removed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from context_engine.telemetry import multiprocess
from context_engine.telemetry.multiprocess import FoldingCollector, fold_dead
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

WORKER = textwrap.dedent("""
    import sys, time
    from prometheus_client import Counter, Gauge, Histogram
    n = int(sys.argv[1])
    c = Counter("ce_calls", "calls", ["method"])
    c.labels("Build").inc(n)
    c.labels("Plan" if n % 2 else "Rotate").inc(0.5 * n)
    h = Histogram("ce_seconds", "seconds", ["method"], buckets=(0.1, 1.0, 10.0))
    for v in (0.05 * n, 0.5 * n, 5.0 * n):
        h.labels("Build").observe(v)
    Gauge("ce_info", "info", ["version"], multiprocess_mode="max").labels("1").set(n % 3)
    Gauge("ce_least", "least", multiprocess_mode="min").set(10 - n)
    Gauge("ce_total", "total", multiprocess_mode="sum").set(n)
    Gauge("ce_factor", "factor", ["model"], multiprocess_mode="mostrecent").labels("m").set(
        1.0 + n / 10)
    Gauge("ce_each", "each", multiprocess_mode="all").set(n)
    Gauge("ce_live", "live", multiprocess_mode="livesum").set(100)
    time.sleep(0.01)
""")


def samples(path: Path, collector: type[MultiProcessCollector]) -> list[str]:
    """The endpoint's lines, sorted (the metrics' order follows the files' order)."""
    registry = CollectorRegistry()
    collector(registry, path=str(path))
    return sorted(generate_latest(registry).decode().splitlines())


def values(lines: list[str]) -> dict[str, float]:
    """Each sample line's series and value; the comment lines as themselves."""
    return {line.rsplit(" ", 1)[0] if not line.startswith("#") else line:
            float(line.rsplit(" ", 1)[1]) if not line.startswith("#") else 0.0
            for line in lines}


@pytest.fixture
def worked(tmp_path: Path) -> tuple[Path, list[int]]:
    """Five processes' files, written one after another (each one's gauges the latest)."""
    pids = []
    for n in range(1, 6):
        proc = subprocess.Popen([sys.executable, "-c", WORKER, str(n)],
                                env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
        assert proc.wait(timeout=60) == 0
        pids.append(proc.pid)
    return tmp_path, pids


def test_folding_dead_workers_leaves_every_sample_as_the_endpoint_merged_it(worked):
    path, pids = worked
    files_before = len(list(path.glob("*.db")))
    for pid in pids[:4]:  # the fifth stays, as a live worker's would
        mark_process_dead(pid, str(path))
        expected = samples(path, MultiProcessCollector)
        assert fold_dead(str(path), pid) > 0
        # the same series at the same values (a float sum in another order may differ in its
        # last bit: 83.25 against 83.24999999999999)
        assert values(samples(path, FoldingCollector)) == pytest.approx(values(expected))
        assert values(samples(path, MultiProcessCollector)) == pytest.approx(values(expected))
    # live worker 5's files, the archives (one per kind), and the "all" gauge of each pid
    names = sorted(p.name for p in path.glob("*.db"))
    archives = [n for n in names if "archived" in n]
    assert archives == ["counter_archived.db", "gauge_max_archived.db",
                        "gauge_min_archived.db", "gauge_mostrecent_archived.db",
                        "gauge_sum_archived.db", "histogram_archived.db"]
    assert not [n for n in names if any(f"_{pid}.db" in n for pid in pids[:4])
                and not n.startswith("gauge_all_")]
    assert len(names) < files_before


def test_the_totals_are_the_workers_own(worked):
    """Counted by hand: Build calls 1 + 2 + 3 + 4 + 5 = 15, Plan 0.5 x (1 + 3 + 5), Rotate
    0.5 x (2 + 4), the max
    gauge 2 (n % 3), the min 5 (10 - 5), the sum 15, the most recent written 1.5."""
    path, pids = worked
    for pid in pids:
        fold_dead(str(path), pid)
    text = samples(path, FoldingCollector)
    assert 'ce_calls_total{method="Build"} 15.0' in text
    assert 'ce_calls_total{method="Plan"} 4.5' in text
    assert 'ce_calls_total{method="Rotate"} 3.0' in text
    assert 'ce_seconds_count{method="Build"} 15.0' in text
    # observed 0.05 n, 0.5 n and 5 n for n = 1..5: 0.05 and 0.1 under 0.1, with all five
    # 0.05 n and 0.5 and 1.0 under 1.0; the sum 15 x 5.55
    assert 'ce_seconds_bucket{le="0.1",method="Build"} 2.0' in text
    assert 'ce_seconds_bucket{le="1.0",method="Build"} 7.0' in text
    assert 'ce_seconds_sum{method="Build"} 83.25' in text
    assert 'ce_info{version="1"} 2.0' in text
    assert "ce_least 5.0" in text
    assert "ce_total 15.0" in text
    assert 'ce_factor{model="m"} 1.5' in text
    assert not [line for line in text if line.startswith("ce_live")]


def test_a_restart_loop_keeps_the_directory_bounded(tmp_path):
    """Forty workers dead one after another: the directory holds the archives, not forty
    workers' files."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    script = WORKER.replace('Gauge("ce_each"', '# Gauge("ce_each"')
    for n in range(40):
        proc = subprocess.Popen([sys.executable, "-c", script, str(n % 5 + 1)], env=env)
        assert proc.wait(timeout=60) == 0
        fold_dead(str(tmp_path), proc.pid)
    assert len(list(tmp_path.glob("*.db"))) == 6
    assert 'ce_calls_total{method="Build"} 120.0' in samples(tmp_path, FoldingCollector)


def test_a_scrape_waits_for_a_fold_and_a_fold_for_a_scrape(worked):
    """The endpoint reads the directory only between folds: read mid-fold, a counter would
    count twice (the archive written, the dead file not yet removed) or be missing (a file
    removed between the collector's listing and its read: prometheus_client then raises)."""
    path, pids = worked
    for attempt in (lambda: samples(path, FoldingCollector),
                    lambda: fold_dead(str(path), pids[0])):
        done = threading.Event()

        def run(attempt=attempt, done=done) -> None:
            attempt()
            done.set()

        with multiprocess._LOCK:  # as a fold (or a scrape) holds it
            worker = threading.Thread(target=run, daemon=True)
            worker.start()
            assert not done.wait(0.3)
        assert done.wait(30)
        worker.join()
