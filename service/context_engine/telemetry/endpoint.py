"""The ``/metrics`` endpoint: prometheus_client's WSGI app on a threading HTTP server in a
daemon thread, as its ``start_http_server`` makes it, except for how often the serve loop looks
for a stop. socketserver's loop notices ``shutdown()`` only between polls, every 0.5 s by
default (which ``start_http_server`` keeps), and ``shutdown()`` waits for it: every stop of a
server, or of a supervisor, waited up to half a second for its endpoint (all of it just after a
scrape)."""

from __future__ import annotations

import socket
import threading
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

# How long a stop waits for the serve loop at most; an idle loop wakes this often
POLL_SECONDS = 0.05


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """No line per scrape (as prometheus_client's own handler)."""


def serve_metrics(host: str, port: int, registry: CollectorRegistry) -> WSGIServer:
    """Serve ``registry`` on ``host:port`` (port 0: any free one, ``server_port`` says which)
    until ``shutdown()``."""
    # the address family of the host (an IPv6 host needs AF_INET6), as prometheus_client finds it
    family, *_, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                              flags=socket.AI_PASSIVE)[0]

    class Server(ThreadingWSGIServer):
        address_family = family

    httpd = make_server(str(sockaddr[0]), port, make_wsgi_app(registry), Server,
                        handler_class=_Quiet)
    threading.Thread(target=httpd.serve_forever, args=(POLL_SECONDS,), daemon=True,
                     name="metrics-endpoint").start()
    return httpd
