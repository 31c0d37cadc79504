"""Which ``postmaster.pid`` the embedded mode takes off before pgserver reads it
(``server.clear_stale_postmaster_pid``): pgserver takes any live pid in the file for the
cluster's postmaster, so a pid reused since a kill or a reboot failed every start and had that
process stopped, and a copied data directory's file named the original's postmaster. Real
processes stand in for the postmaster: a ``postgres`` working in the directory (a shell under
that name), another program, one that has ended."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from context_engine.api.server import FirstStartInterrupted, clear_stale_postmaster_pid

SLEEP = "/bin/sleep"


def pid_file(pg_dir: Path, pid: int, pgdata: Path | None = None) -> Path:
    """A postmaster.pid as PostgreSQL writes it (its first two lines are what is read)."""
    path = pg_dir / "postmaster.pid"
    path.write_text(f"{pid}\n{pgdata or pg_dir}\n1765000000\n5432\n{pg_dir}\n\n"
                    "  8826964     65536\nready   \n", encoding="utf-8")
    return path


@pytest.fixture
def pg_dir(tmp_path: Path) -> Path:
    d = tmp_path / "pg"
    d.mkdir()
    return d


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        p.kill()
        p.wait()


def named_postgres(processes: list[subprocess.Popen[bytes]], data: Path,
                   *args: str) -> int:
    """A process named ``postgres`` working in ``data``, as every PostgreSQL process does, its
    command line ``postgres -c ... <args>``: a shell, named so, waiting on its standard
    input."""
    p = subprocess.Popen(["postgres", "-c", "read line", *args], executable="/bin/sh",
                         stdin=subprocess.PIPE, cwd=data)
    processes.append(p)
    return p.pid


@pytest.mark.parametrize("args", [("-D", "<dir>"), ("-D", "pg"), ()],
                         ids=["its_path", "relative_to_where_it_started", "from_pgdata"])
def test_the_file_of_this_directorys_running_postgres_is_kept(pg_dir, processes, args):
    """However its command line names the directory: in full, relative to where pg_ctl ran
    (``-D pg``), or not at all (the server read PGDATA)."""
    args = tuple(str(pg_dir) if a == "<dir>" else a for a in args)
    pid = named_postgres(processes, pg_dir, *args)
    path = pid_file(pg_dir, pid)
    assert clear_stale_postmaster_pid(pg_dir) is None and path.exists(), seen(pid)


def seen(pid: int) -> str:
    """What the check saw of ``pid`` (status, command line, directory), for a failure's
    message: the test failed once in a whole-suite run on a loaded machine and never alone."""
    import psutil  # type: ignore[import-untyped]

    try:
        process = psutil.Process(pid)
        return f"{process.status()} {process.cmdline()} in {process.cwd()}"
    except psutil.Error as exc:
        return repr(exc)


def test_a_pid_reused_by_another_program_is_taken_off_and_that_program_left_alone(
        pg_dir, processes):
    other = subprocess.Popen([SLEEP, "60"])
    processes.append(other)
    path = pid_file(pg_dir, other.pid)
    assert clear_stale_postmaster_pid(pg_dir) == other.pid
    assert not path.exists() and other.poll() is None


def test_a_postgres_of_another_directory_is_not_this_ones(tmp_path, pg_dir, processes):
    """A copied data directory: its file names the original's running postmaster."""
    original = tmp_path / "original" / "pg"
    original.mkdir(parents=True)
    pid = named_postgres(processes, original, "-D", str(original))
    path = pid_file(pg_dir, pid, pgdata=original)  # the file as copied, naming the original
    assert clear_stale_postmaster_pid(pg_dir) == pid and not path.exists()
    # the same postmaster named under this directory's path but running on the other one (a
    # command line naming this directory does not make it this directory's)
    path = pid_file(pg_dir, pid)
    assert clear_stale_postmaster_pid(pg_dir) == pid and not path.exists()
    elsewhere = named_postgres(processes, original, "-D", str(pg_dir))
    path = pid_file(pg_dir, elsewhere)
    assert clear_stale_postmaster_pid(pg_dir) == elsewhere and not path.exists()
    path = pid_file(pg_dir, pid)
    assert clear_stale_postmaster_pid(pg_dir) == pid and not path.exists()


def test_a_file_naming_an_ended_process_is_taken_off(pg_dir):
    ended = subprocess.Popen([SLEEP, "0"])
    ended.wait()
    pid_file(pg_dir, ended.pid)
    assert clear_stale_postmaster_pid(pg_dir) == ended.pid


def test_no_file_is_nothing_to_do(pg_dir):
    assert clear_stale_postmaster_pid(pg_dir) is None


def test_initdbs_bootstrap_file_left_by_a_killed_first_start_is_named(pg_dir):
    """initdb's bootstrap backend writes its pid negated; killed, it leaves the cluster half
    made (PG_VERSION written, no database): the start says so and what to do, and keeps the
    directory as it is."""
    ended = subprocess.Popen([SLEEP, "0"])
    ended.wait()
    path = pid_file(pg_dir, -ended.pid)
    with pytest.raises(FirstStartInterrupted) as info:
        clear_stale_postmaster_pid(pg_dir)
    assert f"remove {pg_dir} and start again" in str(info.value)
    assert path.exists()


def test_a_killed_single_user_backend_in_a_cluster_that_ran_is_only_stale(pg_dir):
    """A negated pid in a cluster a server has run in (its log written by pgserver's first
    start) is a killed ``postgres --single`` (a manual VACUUM, say), not a half-made cluster:
    taken off as stale, never a word about removing a directory that holds data."""
    ended = subprocess.Popen([SLEEP, "0"])
    ended.wait()
    (pg_dir / "log").write_text("2026-12-01 LOG:  database system is ready\n", encoding="utf-8")
    path = pid_file(pg_dir, -ended.pid)
    assert clear_stale_postmaster_pid(pg_dir) == -ended.pid and not path.exists()


def test_initdb_still_running_is_left_to_finish(pg_dir, processes):
    """initdb's backend names no directory (``postgres --boot -F ...``): it works in it."""
    pid = named_postgres(processes, pg_dir, "--boot", "-F")
    path = pid_file(pg_dir, -pid)
    assert clear_stale_postmaster_pid(pg_dir) is None and path.exists()


def test_an_unreadable_first_line_is_stale(pg_dir):
    (pg_dir / "postmaster.pid").write_text("garbage\n", encoding="utf-8")
    assert clear_stale_postmaster_pid(pg_dir) == 0
    assert not (pg_dir / "postmaster.pid").exists()
    assert os.path.isdir(pg_dir)


def test_a_failed_start_names_its_log_only_when_there_is_one(tmp_path):
    """A start that failed before PostgreSQL ever wrote its log named a file that did not
    exist."""
    from context_engine.api.server import EmbeddedDatabaseFailed

    (tmp_path / "pg").mkdir()
    without = str(EmbeddedDatabaseFailed(tmp_path, ValueError("no")))
    assert "its log" not in without and without.endswith(
        "(or point DATABASE_URL at another database)"), without
    (tmp_path / "pg" / "log").write_text("FATAL: ...\n", encoding="utf-8")
    with_log = str(EmbeddedDatabaseFailed(tmp_path, ValueError("no")))
    assert f"(its log is in {tmp_path / 'pg' / 'log'}; or point DATABASE_URL" in with_log
