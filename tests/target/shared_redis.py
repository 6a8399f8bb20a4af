"""A per-test key prefix in the shared Redis (127.0.0.1:6379) and a private redis-server,
for the shared KV tier's tests: no test touches another user's keys or stops the shared server."""

from __future__ import annotations

import socket
import subprocess
import time
import uuid

import pytest
import redis

URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
def kv_prefix():
    """A key prefix no other test or user of the shared Redis has; its keys are deleted after."""
    name = f"specmesh-test:{uuid.uuid4().hex}"
    yield name
    client = redis.Redis.from_url(URL)
    for key in client.scan_iter(f"{name}:*"):
        client.delete(key)
    client.close()


def free_port() -> int:
    """A loopback port nothing listens on (now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrivateRedis:
    """A redis-server of this test's own on a free port (no persistence), to stop mid-run."""

    def __init__(self) -> None:
        self.port = free_port()
        self.process = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                                         "--save", "", "--appendonly", "no"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        client.close()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)
