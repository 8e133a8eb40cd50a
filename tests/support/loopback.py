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
