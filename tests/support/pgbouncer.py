"""A real PgBouncer (the ``pgbouncer`` binary) in front of a PostgreSQL, for tests.

``PgBouncer(upstream_url).start()`` writes an ini and an auth file in a temporary directory,
starts ``pgbouncer`` on a free loopback port, waits until its admin console answers and returns
itself; ``.url`` is a ``postgresql://`` URL to the pooler with the upstream's database and user
(any other database of the upstream server is reachable through it by its own name too).
Clients authenticate with ``trust`` (loopback only); PgBouncer logs in to the upstream as the
client's user, with the upstream URL's password when it has one. ``admin(sql)`` runs a command
(``SHOW POOLS``, ``SHOW STATS``...) on the admin console, which speaks the simple query protocol
only (asyncpg cannot query it).

PgBouncer refuses to run as root: as root it is started with ``-u`` (the ``pgserver`` system
user the embedded PostgreSQL runs as, else ``nobody``), and its directory is given to that user.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pwd
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from urllib.parse import parse_qs, quote, unquote, urlsplit

PGBOUNCER = os.environ.get("CE_TEST_PGBOUNCER") or shutil.which("pgbouncer") or (
    "/usr/sbin/pgbouncer")
ADMIN_DATABASE = "pgbouncer"


class PgBouncerError(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ini_value(value: str) -> str:
    """A value of a [databases] connection string, quoted when it needs to be."""
    if value and all(c.isalnum() or c in "/._-:" for c in value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _auth_quote(value: str) -> str:
    return '"' + value.replace('"', '""') + '"'


class Upstream:
    """The parts of a ``postgresql://`` URL PgBouncer needs (TCP or a unix-socket directory)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("postgresql", "postgres"):
            raise ValueError(f"not a postgresql:// URL: {url!r}")
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        self.user = unquote(parts.username or "") or query.get("user") or "postgres"
        self.password = unquote(parts.password or "") or query.get("password") or ""
        self.database = unquote(parts.path.lstrip("/")) or query.get("dbname") or self.user
        self.host = query.get("host") or parts.hostname or "/tmp"
        port = query.get("port") or (str(parts.port) if parts.port else "")
        self.port = int(port) if port else 5432


class PgBouncer:
    def __init__(self, upstream_url: str, *, pool_mode: str = "transaction",
                 default_pool_size: int = 10, max_client_conn: int = 1000,
                 server_login_retry: int | None = None) -> None:
        """``server_login_retry``: seconds PgBouncer waits after a failed login to the server
        before it tries another (its own default, 15, when None)."""
        if pool_mode not in ("session", "transaction", "statement"):
            raise ValueError(f"pool_mode {pool_mode!r} is not session, transaction or statement")
        self.upstream_url = upstream_url
        self.upstream = Upstream(upstream_url)
        self.pool_mode = pool_mode
        self.default_pool_size = default_pool_size
        self.max_client_conn = max_client_conn
        self.server_login_retry = server_login_retry
        self.port = 0
        self.dir: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    # ------------------------------------------------------------------ addresses

    @property
    def url(self) -> str:
        """The pooler, with the upstream's database and user (no password: trust)."""
        self._require_started()
        up = self.upstream
        return (f"postgresql://{quote(up.user, safe='')}@127.0.0.1:{self.port}/"
                f"{quote(up.database, safe='')}")

    @property
    def admin_url(self) -> str:
        self._require_started()
        return f"postgresql://{quote(self.upstream.user, safe='')}@127.0.0.1:{self.port}/pgbouncer"

    @property
    def log_path(self) -> Path:
        self._require_started()
        assert self.dir is not None
        return self.dir / "pgbouncer.log"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def _require_started(self) -> None:
        if self.proc is None:
            raise PgBouncerError("PgBouncer is not started")

    # ------------------------------------------------------------------ life cycle

    def _run_as(self) -> str | None:
        if os.geteuid() != 0:
            return None
        for name in ("pgserver", "nobody"):
            with contextlib.suppress(KeyError):
                pwd.getpwnam(name)
                return name
        raise PgBouncerError("pgbouncer refuses to run as root and there is no pgserver or "
                             "nobody user to run it as")

    def _write_files(self, directory: Path, port: int) -> Path:
        up = self.upstream
        server = [f"host={_ini_value(up.host)}", f"port={up.port}"]
        if up.password:  # log in as the URL's user with its password
            server += [f"user={_ini_value(up.user)}", f"password={_ini_value(up.password)}"]
        ini = directory / "pgbouncer.ini"
        ini.write_text("\n".join([
            "[databases]",
            f"{_ini_value(up.database)} = {' '.join(server)} dbname={_ini_value(up.database)}",
            # any other database of the same server by its own name (tests create some)
            f"* = {' '.join(server)}",
            "",
            "[pgbouncer]",
            "listen_addr = 127.0.0.1",
            f"listen_port = {port}",
            "unix_socket_dir =",
            "auth_type = trust",
            f"auth_file = {directory / 'users.txt'}",
            f"admin_users = {up.user}",
            f"stats_users = {up.user}",
            f"pool_mode = {self.pool_mode}",
            f"default_pool_size = {self.default_pool_size}",
            f"max_client_conn = {self.max_client_conn}",
            f"logfile = {directory / 'pgbouncer.log'}",
            f"pidfile = {directory / 'pgbouncer.pid'}",
            "log_connections = 0",
            "log_disconnections = 0",
            *([] if self.server_login_retry is None
              else [f"server_login_retry = {self.server_login_retry}"]),
            "",
        ]))
        (directory / "users.txt").write_text(
            f"{_auth_quote(up.user)} {_auth_quote(up.password)}\n")
        for written in (ini, directory / "users.txt"):  # readable by the user it runs as
            written.chmod(0o644)
        return ini

    def start(self, timeout: float = 15.0) -> PgBouncer:
        if self.proc is not None:
            raise PgBouncerError("PgBouncer is already started")
        if not os.path.exists(PGBOUNCER):
            raise PgBouncerError(f"no pgbouncer at {PGBOUNCER} (scripts/ensure-pgbouncer "
                                 f"installs it)")
        user = self._run_as()
        self.dir = Path(tempfile.mkdtemp(prefix="ce-pgbouncer-"))
        if user is not None:
            entry = pwd.getpwnam(user)
            os.chown(self.dir, entry.pw_uid, entry.pw_gid)
        self.dir.chmod(0o755)
        last = ""
        for _ in range(5):  # the free port may be taken between choosing it and listening
            self.port = _free_port()
            ini = self._write_files(self.dir, self.port)
            log = self.dir / "pgbouncer.log"
            log.unlink(missing_ok=True)
            command = [PGBOUNCER, *(["-u", user] if user else []), str(ini)]
            # Its output goes to a file: a pipe nobody reads would block it once full.
            with open(self.dir / "stderr.log", "wb") as stderr:
                self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
            # a test that fails before stop() must not leave a pgbouncer running
            atexit.register(self.stop)
            try:
                self._wait_ready(timeout)
                return self
            except PgBouncerError as exc:
                last = str(exc)
                self._terminate()
                if "Address already in use" not in last:
                    break
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = None
        raise PgBouncerError(last)

    def _wait_ready(self, timeout: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                assert self.dir is not None
                stderr = (self.dir / "stderr.log").read_text(errors="replace")
                raise PgBouncerError(f"pgbouncer exited with {self.proc.returncode}: "
                                     f"{stderr.strip()} {self.log().strip()}")
            try:
                self.admin("SHOW VERSION", timeout=2.0)
                return
            except (OSError, PgBouncerError):
                time.sleep(0.05)
        raise PgBouncerError(f"pgbouncer did not accept connections within {timeout}s: "
                             f"{self.log().strip()}")

    def _terminate(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # immediate shutdown
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

    def stop(self) -> None:
        atexit.unregister(self.stop)
        self._terminate()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> PgBouncer:
        return self.start() if self.proc is None else self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # ------------------------------------------------------------------ admin console

    def admin(self, sql: str, *, timeout: float = 10.0) -> list[dict[str, str | None]]:
        """Rows of one admin-console command (``SHOW POOLS``, ``SHOW STATS``, ``RECONNECT``...),
        each a dict of column to text value."""
        if self.port == 0:
            raise PgBouncerError("PgBouncer is not started")
        return simple_query("127.0.0.1", self.port, self.upstream.user, ADMIN_DATABASE, sql,
                            timeout=timeout)

    def pools(self) -> list[dict[str, str | None]]:
        """``SHOW POOLS`` rows of the upstream database."""
        return [r for r in self.admin("SHOW POOLS") if r.get("database") == self.upstream.database]

    def stats(self) -> dict[str, str | None]:
        """The ``SHOW STATS`` row of the upstream database (totals since start)."""
        for row in self.admin("SHOW STATS"):
            if row.get("database") == self.upstream.database:
                return row
        return {}


# ---------------------------------------------------------------------- a minimal client
# The admin console accepts only the simple query protocol. This speaks just enough of the
# PostgreSQL wire protocol for it: startup (trust), one Query, the rows as text.


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise PgBouncerError("connection closed by the server")
        data += chunk
    return bytes(data)


def _message(sock: socket.socket) -> tuple[bytes, bytes]:
    head = _recv_exact(sock, 5)
    kind, length = head[:1], struct.unpack("!I", head[1:])[0]
    return kind, _recv_exact(sock, length - 4)


def _error_text(body: bytes) -> str:
    fields = {f[:1]: f[1:].decode(errors="replace") for f in body.split(b"\0") if f}
    return fields.get(b"M", body.decode(errors="replace"))


def simple_query(host: str, port: int, user: str, database: str, sql: str, *,
                 timeout: float = 10.0) -> list[dict[str, str | None]]:
    with socket.create_connection((host, port), timeout=timeout) as sock:
        params = b"".join(k.encode() + b"\0" + v.encode() + b"\0"
                          for k, v in (("user", user), ("database", database))) + b"\0"
        sock.sendall(struct.pack("!II", 8 + len(params), 196608) + params)
        while True:
            kind, body = _message(sock)
            if kind == b"E":
                raise PgBouncerError(_error_text(body))
            if kind == b"R" and struct.unpack("!I", body[:4])[0] != 0:
                raise PgBouncerError("the admin console asked for a password (not trust)")
            if kind == b"Z":
                break
        query = sql.encode() + b"\0"
        sock.sendall(b"Q" + struct.pack("!I", 4 + len(query)) + query)
        columns: list[str] = []
        rows: list[dict[str, str | None]] = []
        error = ""
        while True:
            kind, body = _message(sock)
            if kind == b"T":
                count, pos = struct.unpack("!H", body[:2])[0], 2
                columns = []
                for _ in range(count):
                    end = body.index(b"\0", pos)
                    columns.append(body[pos:end].decode())
                    pos = end + 1 + 18
            elif kind == b"D":
                count, pos = struct.unpack("!H", body[:2])[0], 2
                values: list[str | None] = []
                for _ in range(count):
                    size = struct.unpack("!i", body[pos:pos + 4])[0]
                    pos += 4
                    if size < 0:
                        values.append(None)
                    else:
                        values.append(body[pos:pos + size].decode(errors="replace"))
                        pos += size
                rows.append(dict(zip(columns, values, strict=True)))
            elif kind == b"E":
                error = _error_text(body)
            elif kind == b"Z":
                break
        with contextlib.suppress(OSError):
            sock.sendall(b"X" + struct.pack("!I", 4))
        if error:
            raise PgBouncerError(error)
        return rows
