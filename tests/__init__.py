"""The suite. Before anything imports gRPC: the suite starts programs from processes whose gRPC
threads are busy (pgserver runs ``pg_ctl`` as its system user, a plain ``fork`` then ``exec``).
gRPC's fork handlers are for a child that goes on using gRPC; in a child that only execs they
can crash it before the ``exec`` (``pg_ctl`` then "dies" of SIGSEGV), so they are turned off
(gRPC's documented setting for fork-then-exec). gRPC reads the setting when it is imported:
``GRPC_IMPORTED_FIRST`` records whether something imported it before this package."""

import os
import sys

GRPC_IMPORTED_FIRST = "grpc" in sys.modules
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
