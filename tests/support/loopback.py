"""Servers on 127.0.0.1 for the security tests: an HTTP server that records every request it gets,
and moto's S3 behind an Airflow Connection (no credentials in the process environment)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# Distinctive values: a test greps outputs, XComs, logs and command lines for them.
CONN_KEY = "AKIACONNECTIONONLY01"
CONN_SECRET = "conn-only-secret-8f3b2a"
SECRET_BODY = b'{"AccessKeyId": "ASIA-STOLEN", "SecretAccessKey": "stolen-by-ssrf"}'


class RecordingServer:
    """``http://127.0.0.1:PORT``: answers every request with SECRET_BODY and records it (path, headers)."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                owner.requests.append({"method": self.command, "path": self.path, "headers": dict(self.headers)})
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(SECRET_BODY)))
                self.end_headers()
                self.wfile.write(SECRET_BODY)

            do_GET = do_HEAD = do_POST = do_PUT = _answer

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> RecordingServer:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()


def aws_connection(endpoint: str) -> str:
    """An ``AIRFLOW_CONN_<ID>`` value (JSON form) for moto: keys, region and endpoint in the Connection."""
    return json.dumps(
        {
            "conn_type": "aws",
            "login": CONN_KEY,
            "password": CONN_SECRET,
            "extra": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        }
    )


def s3_client(endpoint: str):
    """A boto3 client with explicit keys (the test's own setup, never the process environment)."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=CONN_KEY,
        aws_secret_access_key=CONN_SECRET,
        region_name="us-east-1",
    )


class TranscodingGCS:
    """A GCS JSON API on ``http://127.0.0.1:PORT`` for one bucket ``b`` of gzip-encoded objects, as GCS serves them
    (its "decompressive transcoding"): an object read with ``Accept-Encoding: gzip`` (aiohttp, so gcsfs, sends it)
    comes as stored, with ``Content-Encoding: gzip``; read without it, decompressed. ``objects``: name -> stored
    bytes. ``state_encoding``: whether the object's metadata names its encoding (False: an object replaced between
    the metadata request and the read, a race a writer of the bucket can try)."""

    def __init__(self, objects: dict[str, bytes], state_encoding: bool = True) -> None:
        import gzip
        import re

        owner = self
        self.objects, self.state_encoding = objects, state_encoding

        def meta(name: str) -> dict:
            m = {"kind": "storage#object", "bucket": "b", "name": name, "size": str(len(owner.objects[name]))}
            m |= {"generation": "1", "updated": "2026-01-01T00:00:00Z", "etag": "e1", "contentType": "text/plain"}
            return m | ({"contentEncoding": "gzip"} if owner.state_encoding else {})

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path, _, query = self.path.partition("?")
                name = re.sub(r"^.*/b/b/o/?", "", path).replace("%2F", "/")
                if name and name not in owner.objects:
                    return self._send(404, b"{}")
                if "alt=media" in query:
                    stored = owner.objects[name]
                    as_stored = "gzip" in self.headers.get("Accept-Encoding", "")
                    body = stored if as_stored else gzip.decompress(stored)
                    if rng := re.match(r"bytes=(\d+)-(\d*)", self.headers.get("Range", "")):
                        body = body[int(rng[1]) : int(rng[2]) + 1 if rng[2] else None]
                    return self._send(206 if rng else 200, body, {"Content-Encoding": "gzip"} if as_stored else {})
                listed = meta(name) if name else {"kind": "storage#objects", "items": [meta(n) for n in owner.objects]}
                self._send(200, json.dumps(listed).encode(), {"Content-Type": "application/json"})

            def _send(self, code: int, body: bytes, headers: dict | None = None) -> None:
                self.send_response(code)
                for k, v in {**(headers or {}), "Content-Length": str(len(body))}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.options = {"endpoint_url": f"http://127.0.0.1:{self._server.server_address[1]}", "token": "anon"}
        self.options["project"] = "test"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> TranscodingGCS:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
