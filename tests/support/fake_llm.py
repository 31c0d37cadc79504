"""A fake OpenAI-compatible chat-completions endpoint on loopback, for the LLM summarizer."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# How long the "slow" mode waits before answering: longer than any summarizer timeout the
# tests configure for failures.
SLOW_SECONDS = 2.0
# The error body's ``code`` when ``mode`` is an HTTP status.
ERROR_CODE = "fake_error"


class FakeProvider:
    """Answers every chat completion with ``ECHO`` and the contents of the messages it was
    given, after ``delay`` seconds.

    ``mode`` makes it fail instead: "5xx" (a 503), "slow" (answers after :data:`SLOW_SECONDS`),
    "garbage" (not even an HTTP status line), "truncated" (a body shorter than its
    Content-Length), "cut" (a completion the model stopped at its output limit:
    ``finish_reason`` "length", its text unfinished), an HTTP status as digits ("404", "429": that
    status with an OpenAI-style error body whose code is :data:`ERROR_CODE` and whose message
    quotes the request); "ok" answers. Each request is kept in
    ``bodies`` (its JSON body plus ``path`` and ``auth``, the Authorization header) and sets
    ``started`` when it arrives.
    """

    def __init__(self, *, delay: float = 0.0) -> None:
        self.mode = "ok"
        self.delay = delay
        self.bodies: list[dict[str, Any]] = []
        self.started = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.bodies.append({"path": self.path, "auth": self.headers.get("Authorization"),
                                    **body})
                fake.started.set()
                time.sleep(fake.delay)
                if fake.mode == "5xx":
                    self.send_response(503)
                    self.end_headers()
                    return
                if fake.mode.isdigit():
                    data = json.dumps({"error": {"message": f"refused: {body['messages']}",
                                                 "type": "invalid_request_error",
                                                 "code": ERROR_CODE}}).encode()
                    self.send_response(int(fake.mode))
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                if fake.mode == "slow":
                    time.sleep(SLOW_SECONDS)
                if fake.mode == "garbage":
                    self.wfile.write(b"garbage\r\n\r\n")
                    return
                if fake.mode == "truncated":
                    self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\n{\"ch")
                    return
                echo = "\n".join(m["content"] for m in body["messages"])
                choice: dict[str, Any] = {"message": {"role": "assistant",
                                                      "content": "ECHO " + echo}}
                if fake.mode == "cut":
                    choice = {"finish_reason": "length",
                              "message": {"role": "assistant", "content": "ECHO " + echo[:40]}}
                data = json.dumps({"choices": [choice]})
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.end_headers()
                    self.wfile.write(data.encode())
                except OSError:  # the caller gave up (deadline, timeout) before the answer
                    pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/v1"

    @property
    def calls(self) -> int:
        return len(self.bodies)

    def stop(self) -> None:
        self.http.shutdown()
        self.http.server_close()
