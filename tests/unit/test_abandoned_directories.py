"""Which of a supervisor's temporary directories a later start may remove: only those no live
process holds. The holders here are separate processes taking the lock with flock(1)'s
system call from their own interpreter, and their death is a SIGKILL, as an OOM kill's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from context_engine.api.workers import OWNERS_LOCK, remove_abandoned, remove_abandoned_directories

HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_SH)
print("held", flush=True)
sys.stdin.read()
"""


def made(tmp: Path, name: str, content: str = "12345\n") -> Path:
    directory = tmp / name
    directory.mkdir()
    (directory / "counter_1.db").write_bytes(b"\0" * 4096)
    (directory / OWNERS_LOCK).write_text(content)
    return directory


def holder(directory: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(directory / OWNERS_LOCK)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def test_a_directory_held_by_a_live_process_stays_until_it_is_killed(tmp_path):
    directory = made(tmp_path, "context-engine-metrics-live")
    proc = holder(directory)
    try:
        assert remove_abandoned(directory) is False
        assert (directory / "counter_1.db").exists()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert remove_abandoned(directory) is True
    assert not directory.exists()


def test_the_lock_not_the_pid_tells_a_live_supervisor(tmp_path):
    """The pid written in the lock file is that of a live process (this one, as a pid reused
    by an unrelated process would be): the directory is still abandoned, none holds it."""
    directory = made(tmp_path, "context-engine-ready-reused", content=f"{os.getpid()}\n")
    assert remove_abandoned(directory) is True and not directory.exists()


def test_what_nothing_tells_the_state_of_is_left_alone(tmp_path):
    # made before the lock existed: none of its processes can be told alive or dead
    old = tmp_path / "context-engine-metrics-old"
    old.mkdir()
    (old / "counter_1.db").write_bytes(b"\0")
    # its maker has made the file but holds no lock on it yet
    starting = made(tmp_path, "context-engine-metrics-starting", content="")
    assert remove_abandoned(old) is False and remove_abandoned(starting) is False
    assert (old / "counter_1.db").exists() and (starting / OWNERS_LOCK).exists()


def test_a_sweep_takes_only_the_abandoned_among_many(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    live = [made(tmp_path, f"context-engine-metrics-live{i}") for i in range(2)]
    dead = [made(tmp_path, "context-engine-metrics-dead"),
            made(tmp_path, "context-engine-ready-dead")]
    other = made(tmp_path, "another-program-dead")
    procs = [holder(d) for d in live]
    try:
        assert remove_abandoned_directories() == sorted(str(d) for d in dead)
        assert all(d.exists() for d in [*live, other]) and not any(d.exists() for d in dead)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


SWEEP = """
import sys
from pathlib import Path
from context_engine.api.workers import remove_abandoned
print(remove_abandoned(Path(sys.argv[1])), flush=True)
"""


def test_a_lock_that_is_no_regular_file_never_holds_up_a_start(tmp_path):
    """Any user may make a directory of the prefix under the temporary directory, and put a
    FIFO where the lock goes: the open for the lock waited for a writer for ever, and the
    start with it, before it served anything. It is left alone, at once."""
    directory = tmp_path / "context-engine-metrics-fifo"
    directory.mkdir()
    os.mkfifo(directory / OWNERS_LOCK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    try:
        out = subprocess.run([sys.executable, "-c", SWEEP, str(directory)], env=env,
                             capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:  # (the blocked sweep is killed)
        raise AssertionError("the sweep blocked on a FIFO lock") from None
    assert out.stdout == "False\n", out.stderr
    assert (directory / OWNERS_LOCK).exists()


def test_another_users_directory_is_left_alone(tmp_path, monkeypatch):
    """The README promises another user's directories are never removed; a sweep run as root
    removed any abandoned one. Here the directory's owner is made another user by this
    process's effective uid."""
    directory = made(tmp_path, "context-engine-metrics-theirs")
    uid = os.stat(directory).st_uid
    monkeypatch.setattr(os, "geteuid", lambda: uid + 1)
    assert remove_abandoned(directory) is False
    assert (directory / "counter_1.db").exists()
    monkeypatch.setattr(os, "geteuid", lambda: uid)
    assert remove_abandoned(directory) is True and not directory.exists()
