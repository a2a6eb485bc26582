"""A real `baton serve` per test, in a temporary directory, stopped by pid;
and libbaton (clients/c), built, for the fast-path client's tests."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]


def baton_bin() -> str:
    path = os.environ.get("BATON_BIN") or str(REPO / "target" / "debug" / "baton")
    if not os.access(path, os.X_OK):
        pytest.fail(f"{path} not found (BATON_BIN unset or wrong): run scripts/test, which builds it")
    return path


@pytest.fixture(scope="session")
def libbaton() -> str:
    """clients/c/build/libbaton.so.0, built first (`make -C clients/c`, the
    `all` that scripts/test's `make check` builds too; nothing to do when
    it is up to date), so that the tests load the library of this tree."""
    c = REPO / "clients" / "c"
    built = subprocess.run(["make", "-C", str(c)], capture_output=True, text=True, timeout=600)
    if built.returncode != 0:
        pytest.fail(f"make -C {c} failed:\n{built.stdout}{built.stderr}")
    return str(c / "build" / "libbaton.so.0")


class Broker:
    def __init__(self, jobs: int, *extra: str) -> None:
        # A short directory of our own: a socket path must fit in 108 bytes.
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="baton-py-"))
        tmp = self.dir
        self.socket = str(tmp / "run" / "socket")
        self.log = tmp / "broker.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([baton_bin(), "serve", "--jobs", str(jobs), "--socket", self.socket, *extra], stderr=log)
        self._wait_until_listening()

    def _wait_until_listening(self) -> None:
        # A bare connect, no HELLO: the probe takes no client id.
        until = time.monotonic() + 10
        while True:
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(self.socket)
                return
            except OSError:
                assert time.monotonic() < until, "the broker did not listen within 10 s (hang guard)"
                time.sleep(0.005)
            finally:
                probe.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def start_broker():
    """start_broker(jobs, *serve_options) -> a running Broker, stopped when the test ends."""
    started = []

    def start(jobs: int, *extra: str) -> Broker:
        broker = Broker(jobs, *extra)
        started.append(broker)
        return broker

    yield start
    for broker in started:
        broker.stop()


def wait_for(what: str, cond, limit: float = 10.0) -> None:
    """Polls cond until it holds; fails after `limit` seconds (a hang guard)."""
    until = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < until, f"timed out waiting for {what}"
        time.sleep(0.002)
