"""A local S3-compatible server (moto) on 127.0.0.1 for tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    def __init__(self):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def __enter__(self):
        # free_port() releases the port before moto binds it: another test's server may take it meanwhile (xdist).
        # Such a server answers the health check for this one, whose own process then fails to bind and exits;
        # this test's requests go to the other server until its test stops it (connection refused). So the
        # port must be listened on by this process; otherwise another port.
        bindir = os.path.dirname(sys.executable)
        for _ in range(5):
            self.proc = subprocess.Popen(
                [os.path.join(bindir, "moto_server"), "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if self._listening():
                return self
            self.proc.kill()
            self.proc.wait(10)
            self.port = free_port()
            self.endpoint = f"http://127.0.0.1:{self.port}"
        raise RuntimeError("moto_server did not start")

    def _listening(self) -> bool:
        """Whether this server's own process listens on its port and answers (False once the process exited)."""
        import psutil

        for _ in range(300):
            if self.proc.poll() is not None:
                return False
            try:
                conns = psutil.Process(self.proc.pid).net_connections("tcp")
            except psutil.Error:
                conns = []
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == self.port for c in conns):
                try:
                    urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=1)
                    return True
                except OSError:
                    pass
            time.sleep(0.1)
        return False

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(10)

    @property
    def storage_options(self) -> dict:
        return {
            "key": "testing",
            "secret": "testing",
            "endpoint_url": self.endpoint,
            "client_kwargs": {"region_name": "us-east-1"},
        }

    @property
    def deployment_env(self) -> dict[str, str]:
        """The deployment way to reach this server: environment (botocore honours AWS_ENDPOINT_URL), no spec option.

        s3fs caches file systems by their arguments, and with the endpoint in the environment these
        are the same for every server: the caches are cleared here, before a test sets the variables (s3fs's,
        and ``core.storage``'s by URI and options, which held an earlier module's server when an xdist worker
        ran two such modules: connection refused to a port no server listens on any more).
        """
        import s3fs

        from airflow_provider_vllm.core import storage

        s3fs.S3FileSystem.clear_instance_cache()
        storage._FS_CACHE.clear()
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def make_bucket(self, name: str) -> None:
        import boto3

        boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        ).create_bucket(Bucket=name)
