"""A real `redis-server` for tests: started on a free loopback port in a temp dir, stopped after.

Use from a test module (the tests folder is on sys.path under pytest):

    from redis_server import redis_server_fixture
    redis_server = redis_server_fixture()           # session-scoped by default

    def test_x(redis_server):
        client = redis_server.client()

Tests sharing the server keep apart by namespace (or call `redis_server.flush()`).
Without a `redis-server` binary the tests using the fixture are skipped, saying how to
install it.
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis

from baton.launch.up import stop_process

START_TIMEOUT_S = 10.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """One redis-server process with no persistence, owned by the test session."""

    def __init__(self, workdir: Path, binary: str = "redis-server"):
        self.workdir = Path(workdir)
        self.binary = binary
        self.port: int | None = None
        self._process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, decode_responses: bool = True) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=decode_responses)

    def start(self) -> RedisServer:
        # The port may be taken between probing and binding: retry on a fresh one.
        for _ in range(5):
            self.port = _free_port()
            log = self.workdir / f"redis-{self.port}.log"
            self._process = subprocess.Popen(
                [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                 "--dir", str(self.workdir), "--save", "", "--appendonly", "no",
                 "--logfile", str(log)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if self._wait_ready():
                return self
            self.stop()
        raise RuntimeError(f"redis-server did not start; see the logs in {self.workdir}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + START_TIMEOUT_S
        probe = self.client()
        try:
            while time.monotonic() < deadline:
                if self._process.poll() is not None:
                    return False
                try:
                    if probe.ping():
                        return True
                except redis.exceptions.ConnectionError:
                    time.sleep(0.01)
            return False
        finally:
            probe.close()

    def flush(self) -> None:
        with self.client() as client:
            client.flushall()

    def restart(self) -> None:
        """Stop and start again on the same port, empty (no persistence): what a Redis pod does."""
        port = self.port
        self.stop()
        self._process = subprocess.Popen(
            [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(self.workdir), "--save", "",
             "--appendonly", "no", "--logfile", str(self.workdir / f"redis-{port}.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not self._wait_ready():
            raise RuntimeError(f"redis-server did not restart on port {port}; see the logs in {self.workdir}")

    def stop(self) -> None:
        if self._process is None:
            return
        stop_process(self._process, timeout=5)
        self._process = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def redis_server_fixture(scope: str = "session"):
    """Build a pytest fixture yielding a started `RedisServer`; assign it to a module name."""

    @pytest.fixture(scope=scope)
    def _redis_server(tmp_path_factory):
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed: apt-get install redis-server (or `make setup`)")
        with RedisServer(tmp_path_factory.mktemp("redis"), binary) as server:
            yield server

    return _redis_server
