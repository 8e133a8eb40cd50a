"""A fault-injecting HTTP proxy in front of the local S3 server (moto), for tests.

Clients talk to ``proxy.endpoint`` as if it were S3; the proxy forwards each request to
the upstream server unless a rule picks it. A rule matches requests by method and a regex
on the path (``/bucket/key?query``) and fires on the ``nth`` .. ``nth + count - 1`` matching
request (0-based), with one of these faults:

* ``slowdown``: answer 503 with an S3 ``SlowDown`` error body (nothing reaches the server);
* ``internal``: answer 500 ``InternalError`` (nothing reaches the server);
* ``drop``: read the request, then reset the connection (RST) without an answer;
* ``stall``: forward the request, then hold the answer for ``stall_s`` seconds (beyond the
  client's read timeout) before closing: the server acted, the client never hears it;
* ``truncate``: forward the headers and only the first half of the body, then reset both
  connections: the server sees an upload that ends early.

``proxy.fired`` lists what was injected (kind, method, path), for assertions and the ledger.
``strip_headers`` (lower-case names) are dropped from every request before it is forwarded:
``{"if-none-match"}`` makes the server a store that ignores create-only writes and overwrites.
"""

from __future__ import annotations

import http.client
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.support.s3server import free_port

KINDS = ("slowdown", "internal", "drop", "stall", "truncate")
_BODIES = {
    "slowdown": (503, "SlowDown", "Please reduce your request rate."),
    "internal": (500, "InternalError", "We encountered an internal error. Please try again."),
}


@dataclass
class Rule:
    kind: str
    method: str = ".*"
    path: str = ".*"
    nth: int = 0
    count: int = 1
    stall_s: float = 3.0
    seen: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; one of {KINDS}")
        self._method = re.compile(self.method)
        self._path = re.compile(self.path)

    def take(self, method: str, path: str) -> bool:
        """Counts a matching request; True when this one is to fail."""
        if not (self._method.fullmatch(method) and self._path.search(path)):
            return False
        i = self.seen
        self.seen += 1
        return self.nth <= i < self.nth + self.count


@dataclass
class FaultProxy:
    upstream_port: int
    rules: list[Rule] = field(default_factory=list)
    fired: list[tuple[str, str, str]] = field(default_factory=list)
    requests: list[tuple[str, str]] = field(default_factory=list)
    strip_headers: set[str] = field(default_factory=set)

    def __post_init__(self):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    def add(self, kind: str, **kw) -> Rule:
        rule = Rule(kind, **kw)
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()

    def pick(self, method: str, path: str) -> Rule | None:
        with self._lock:
            self.requests.append((method, path))
            for r in self.rules:
                if r.take(method, path):
                    self.fired.append((r.kind, method, path))
                    return r
        return None

    def __enter__(self) -> FaultProxy:
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def storage_options(self, read_timeout: float = 2.0, max_attempts: int | None = None) -> dict:
        """s3fs options pointing at the proxy (credentials come from the environment)."""
        config: dict = {"read_timeout": read_timeout, "connect_timeout": 2}
        if max_attempts is not None:
            config["retries"] = {"max_attempts": max_attempts, "mode": "standard"}
        return {"endpoint_url": self.endpoint, "config_kwargs": config, "client_kwargs": {"region_name": "us-east-1"}}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    owner: FaultProxy

    def log_message(self, *args) -> None:  # quiet
        pass

    def _body(self) -> bytes:
        n = self.headers.get("Content-Length")
        if n is not None:
            return self.rfile.read(int(n))
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            raw = b""
            while True:
                line = self.rfile.readline()
                raw += line
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while True:  # trailers up to the blank line
                        t = self.rfile.readline()
                        raw += t
                        if t in (b"\r\n", b"\n", b""):
                            return raw
                raw += self.rfile.read(size + 2)
        return b""

    def _reset(self) -> None:
        """Close the client connection with a TCP reset (what a dropped connection looks like)."""
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        self.close_connection = True
        try:
            self.connection.close()
        except OSError:
            pass

    def _any(self) -> None:
        method, path = self.command, self.path
        body = self._body()
        rule = self.owner.pick(method, path)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in self.owner.strip_headers}
        if rule is not None and rule.kind in _BODIES:
            status, code, msg = _BODIES[rule.kind]
            xml = (
                f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{msg}</Message>'
                f"<RequestId>fault</RequestId></Error>"
            ).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(xml) if method != "HEAD" else 0))
            self.end_headers()
            if method != "HEAD":
                self.wfile.write(xml)
            return
        if rule is not None and rule.kind == "drop":
            self._reset()
            return
        up = http.client.HTTPConnection("127.0.0.1", self.owner.upstream_port, timeout=30)
        if rule is not None and rule.kind == "truncate":
            up.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
            for k, v in headers.items():
                up.putheader(k, v)
            up.endheaders()
            up.send(body[: len(body) // 2])
            up.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            up.close()
            self._reset()
            return
        up.request(method, path, body=body if body or method in ("PUT", "POST") else None, headers=headers)
        resp = up.getresponse()
        data = resp.read()
        up.close()
        if rule is not None and rule.kind == "stall":
            time.sleep(rule.stall_s)
            self._reset()
            return
        self.send_response(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                self.send_header(k, v)
        self.send_header(
            "Content-Length", str(len(data)) if method != "HEAD" else resp.getheader("Content-Length", "0")
        )
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any
