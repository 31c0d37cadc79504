"""Real `context-engine serve` processes for tests that need more than one, or a restart."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any


class ServerProcess:
    def __init__(self, env: dict[str, str], *, timeout: float = 90.0,
                 grpc_addr: str = "127.0.0.1:0", metrics_addr: str = "127.0.0.1:0") -> None:
        full_env = {**os.environ, "CE_GRACE_SECONDS": "5", "CE_DRAIN_SECONDS": "0.5", **env}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "context_engine", "serve", "--grpc-addr", grpc_addr,
             "--metrics-addr", metrics_addr],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=full_env, text=True)
        # A failing test must not leave a server (and its embedded PostgreSQL) running.
        atexit.register(self.kill)
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[dict[str, Any]] = []
        self.raw: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        serving = self.wait_for("serving", timeout)
        self.address = serving["grpc"]
        self.metrics = serving.get("metrics")

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def wait_for(self, event: str, timeout: float,
                 where: Callable[[dict[str, Any]], bool] = lambda record: True
                 ) -> dict[str, Any]:
        """The first line of ``event`` (that ``where`` accepts) from now on."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    break
                continue
            self.raw.append(line)
            try:
                record = json.loads(line)
            except ValueError:
                continue
            self.log.append(record)
            if record.get("event") == event and where(record):
                return dict(record)
        raise AssertionError(f"no {event!r} line within {timeout}s; output:\n{''.join(self.raw)}")

    def terminate(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            while not self.lines.empty():
                line = self.lines.get()
                self.raw.append(line)
                with contextlib.suppress(ValueError):
                    self.log.append(json.loads(line))

    def kill(self) -> None:
        """Stop the process however it is: SIGTERM first (so an embedded PostgreSQL is stopped
        by its atexit handler), SIGKILL if it does not go."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
