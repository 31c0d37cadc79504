"""A TCP proxy in front of PostgreSQL (or a pooler) that can lose the answer to one COMMIT.

Armed (``arm()``), the next simple-query ``COMMIT`` a client sends is forwarded to the database,
which commits it; the proxy then waits ``hold`` seconds and cuts that client's connection
without passing the answer on: the client is left not knowing whether its transaction
committed, as when a connection drops during the COMMIT's round trip. ``arm(after=...)`` takes
only the COMMIT of a transaction that sent a statement holding those bytes (after ``skip``
such COMMITs passed on); ``arm(deliver=False)`` cuts both connections without forwarding the
COMMIT, so the database rolls the transaction back: the client cannot tell the two apart.
``arm(after=..., statement=True)`` takes, instead of a COMMIT, the Sync that ends the execution
of the statement holding those bytes (extended protocol: Parse ... Execute, Sync): outside a
transaction PostgreSQL commits the statement at that Sync, inside one it runs it and the
transaction rolls back when the connection goes."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from urllib.parse import urlsplit, urlunsplit


class CommitDropProxy:
    def __init__(self, upstream_url: str, *, hold: float = 0.3) -> None:
        parts = urlsplit(upstream_url)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 5432)
        self._parts = parts
        self._hold = hold
        self._armed = threading.Event()
        self._after = b""
        self._skip = 0
        self._deliver = True
        self._statement = False
        self.dropped = 0
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self.loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        p = self._parts
        auth = p.netloc.rpartition("@")[0]
        netloc = f"{auth}@127.0.0.1:{self.port}" if auth else f"127.0.0.1:{self.port}"
        return urlunsplit((p.scheme, netloc, p.path, p.query, p.fragment))

    def arm(self, *, after: bytes = b"", skip: int = 0, deliver: bool = True,
            statement: bool = False) -> None:
        self._after, self._skip, self._deliver = after, skip, deliver
        self._statement = statement and bool(after)
        self._armed.set()

    def disarm(self) -> None:
        """Whatever was armed and not yet taken is let pass."""
        self._armed.clear()

    async def _serve(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            sr, sw = await asyncio.open_connection(*self._upstream)
        except OSError:
            cw.close()
            return
        cut = asyncio.Event()

        async def down() -> None:  # database -> client
            try:
                while not cut.is_set():
                    data = await sr.read(65536)
                    if not data or cut.is_set():
                        break
                    cw.write(data)
                    await cw.drain()
            except (OSError, asyncio.CancelledError):
                pass
            if not cut.is_set():  # the database ended the connection: so does the client's
                cw.transport.abort()

        async def up() -> None:  # client -> database, message by message
            try:
                started = False
                marked = False  # the transaction sent a statement holding ``_after``
                executed = False  # ... and, marked, its Execute (``statement``)
                while True:
                    if not started:
                        head = await cr.readexactly(4)
                        (length,) = struct.unpack("!i", head)
                        body = await cr.readexactly(length - 4)
                        sw.write(head + body)
                        await sw.drain()
                        code = struct.unpack("!i", body[:4])[0]
                        started = code == 196608  # the StartupMessage (not SSL/GSS requests)
                        continue
                    kind = await cr.readexactly(1)
                    head = await cr.readexactly(4)
                    (length,) = struct.unpack("!i", head)
                    body = await cr.readexactly(length - 4)
                    armed = self._armed.is_set()
                    if armed and self._after and self._after in body:
                        marked = True
                    if kind == b"E" and marked:
                        executed = True
                    ends = kind == b"Q" and body.lstrip().upper().startswith((b"COMMIT",
                                                                              b"ROLLBACK"))
                    if armed and self._statement:  # the Sync after the statement's Execute
                        commit = kind == b"S" and executed
                    else:
                        commit = (ends and body.lstrip().upper().startswith(b"COMMIT") and armed
                                  and (marked or not self._after))
                    if ends:
                        marked = False
                    if kind == b"S":
                        executed = False
                    if commit and self._skip > 0:
                        self._skip -= 1
                        commit = False
                    if commit:
                        self._armed.clear()
                        cut.set()  # nothing more reaches the client
                        if not self._deliver:  # the database sees its client go: rolled back
                            self.dropped += 1
                            break
                    sw.write(kind + head + body)
                    await sw.drain()
                    if commit:
                        await asyncio.sleep(self._hold)  # the database commits meanwhile
                        self.dropped += 1
                        break
            except (OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
                pass

        task = asyncio.ensure_future(down())
        await up()
        cut.set()
        for w in (cw, sw):
            with contextlib.suppress(Exception):
                w.transport.abort()
        task.cancel()

    def close(self) -> None:
        self._server.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
