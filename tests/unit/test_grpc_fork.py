"""The suite turns gRPC's fork handlers off before anything imports gRPC (``tests/__init__.py``):
pgserver starts ``pg_ctl`` as its system user, a plain ``fork`` then ``exec``, from processes
whose gRPC threads are busy, and gRPC's handlers (meant for a child that goes on using gRPC)
once crashed such a child before its ``exec`` (``pg_ctl`` "died" of SIGSEGV in a two-process
run). With them on, a process that forks while three threads call into gRPC logs "skipping
fork() handlers" or hangs (2 of 6 runs of 100 forks hung here); with them off it does neither.
That depends on timing, so only the setting is held here."""

from __future__ import annotations

import os

import tests


def test_the_suite_runs_with_grpcs_fork_handlers_off() -> None:
    assert os.environ.get("GRPC_ENABLE_FORK_SUPPORT") == "0"
    assert not tests.GRPC_IMPORTED_FIRST, "gRPC was imported before the setting was made"
