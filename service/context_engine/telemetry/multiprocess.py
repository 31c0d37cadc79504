"""A dead worker's metrics, folded into the files of the workers gone before it.

Under ``serve --workers N`` every worker writes prometheus_client's multiprocess files
(``counter_<pid>.db``, ``histogram_<pid>.db``, ``gauge_<mode>_<pid>.db``: about 1.1-1.4 MB a
worker) into the supervisor's metrics directory, and the supervisor's endpoint sums them. A
worker that dies leaves its files, which keep its counters' totals; prometheus_client removes
only its live gauges' (``mark_process_dead``) and offers nothing that merges the rest, so a
worker restarted in a loop (once a second at most) grew the directory by a worker's files each
time, without bound. :func:`fold_dead` adds a dead worker's values into one archive file per
kind (``counter_archived.db``, ``gauge_max_archived.db``, ...), merged as the endpoint merges
them (counters and histograms summed, a ``max`` gauge by its maximum, a ``mostrecent`` one by
its latest write), and removes its files: the directory holds the live workers' files and one
archive per kind, whatever the restarts. A scrape never sees a fold half done: the endpoint's
collector (:class:`FoldingCollector`) and the fold take the same lock, so a counter never
reads twice (archive written, file not yet gone) nor not at all, either of which Prometheus
would take for a reset.
"""

from __future__ import annotations

import glob
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

ARCHIVE = "archived"  # the archive's "pid" in its file name: never a process's

# a scrape and a fold of the same directory never overlap (one supervisor, one endpoint)
_LOCK = threading.Lock()

Merge = Callable[[tuple[float, float], tuple[float, float]], tuple[float, float]]


def _sum(kept: tuple[float, float], dead: tuple[float, float]) -> tuple[float, float]:
    return kept[0] + dead[0], max(kept[1], dead[1])


def _max(kept: tuple[float, float], dead: tuple[float, float]) -> tuple[float, float]:
    return max(kept, dead, key=lambda v: v[0])


def _min(kept: tuple[float, float], dead: tuple[float, float]) -> tuple[float, float]:
    return min(kept, dead, key=lambda v: v[0])


def _latest(kept: tuple[float, float], dead: tuple[float, float]) -> tuple[float, float]:
    return dead if dead[1] >= kept[1] else kept


# how the endpoint merges each gauge mode across processes; "all" keeps a series per pid (no
# archive can stand for the dead pid), and the live modes' files are removed, not folded
_GAUGES: dict[str, Merge] = {"sum": _sum, "max": _max, "min": _min, "mostrecent": _latest}


def _archive_of(name: str) -> tuple[str, Merge] | None:
    """The archive a dead process's file (``name`` without ``.db``) folds into, and how; None:
    the file is left as it is."""
    parts = name.split("_")
    if parts[0] == "gauge":
        merge = _GAUGES.get(parts[1])
        return None if merge is None else (f"gauge_{parts[1]}_{ARCHIVE}.db", merge)
    return f"{parts[0]}_{ARCHIVE}.db", _sum  # counter, histogram, summary: added up


def fold_dead(path: str, pid: int) -> int:
    """Fold the files process ``pid`` (dead) left in ``path`` into the archives; its live
    gauges' files are removed (``mark_process_dead``). Returns how many files were folded."""
    mark_process_dead(pid, path)  # type: ignore[no-untyped-call]
    folded = 0
    with _LOCK:
        for dead_file in sorted(glob.glob(os.path.join(path, f"*_{pid}.db"))):
            found = _archive_of(os.path.basename(dead_file)[:-3])
            if found is None:
                continue
            archive_name, merge = found
            values = MmapedDict.read_all_values_from_file(dead_file)  # type: ignore[no-untyped-call]
            archive: Any = MmapedDict(os.path.join(path, archive_name))  # type: ignore[no-untyped-call]
            try:
                kept = {key: (value, ts) for key, value, ts in archive.read_all_values()}
                for key, value, ts, _ in values:
                    merged = merge(kept[key], (value, ts)) if key in kept else (value, ts)
                    archive.write_value(key, *merged)
                    kept[key] = merged
            finally:
                archive.close()
            os.remove(dead_file)
            folded += 1
    return folded


class FoldingCollector(MultiProcessCollector):
    """prometheus_client's collector of the directory, reading it only between folds."""

    def collect(self) -> Iterable[Any]:
        with _LOCK:
            return list(super().collect())  # type: ignore[no-untyped-call]
