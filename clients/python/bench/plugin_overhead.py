#!/usr/bin/env python3
"""What the pytest plugin costs per test: 1,000 trivial tests run by pytest
with the plugin (a token from a real broker around each test) and without
it (-p no:baton), alternating, several rounds in the same run; the figure is
(median with - median without) / 1,000. Outside the test suite: the tests
assert what happens, never a time.

    BATON_BIN=target/debug/baton python3 clients/python/bench/plugin_overhead.py [ROUNDS]

Needs pytest and baton_client (with its entry point) installed in this
Python.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

TESTS = 1000
REPO = pathlib.Path(__file__).resolve().parents[3]


def start_broker(directory: pathlib.Path) -> tuple:
    baton = os.environ.get("BATON_BIN") or str(REPO / "target" / "debug" / "baton")
    path = str(directory / "socket")
    proc = subprocess.Popen([baton, "serve", "--jobs", "2", "--socket", path], stderr=subprocess.DEVNULL)
    until = time.monotonic() + 10
    while True:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
            return proc, path
        except OSError:
            if time.monotonic() > until:
                proc.kill()
                sys.exit(f"{baton} did not listen at {path} within 10 s")
            time.sleep(0.01)
        finally:
            probe.close()


def run(suite: pathlib.Path, env: dict, *options: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *options, str(suite)], env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def round_trips(path: str) -> float:
    """Seconds per acquire + release with nothing in between, the median
    of rounds of TESTS: the broker's part of the plugin's cost."""
    from baton_client import Client

    per_round = []
    with Client(path, label="bench") as client:
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(TESTS):
                client.acquire().release()
            per_round.append((time.perf_counter() - start) / TESTS)
    return statistics.median(per_round)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    directory = pathlib.Path(tempfile.mkdtemp(prefix="baton-bench-"))
    broker, path = start_broker(directory)
    try:
        suite = directory / "test_trivial.py"
        suite.write_text(f"import pytest\n\n@pytest.mark.parametrize('i', range({TESTS}))\ndef test_trivial(i):\n    pass\n")
        env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "PYTEST_ADDOPTS")}
        env["BATON_SOCKET"] = path
        with_plugin, without = [], []
        for _ in range(rounds):
            with_plugin.append(run(suite, env, "--baton"))
            without.append(run(suite, env, "-p", "no:baton"))
        on, off = statistics.median(with_plugin), statistics.median(without)
        load = os.getloadavg()[0]
        print(f"{TESTS} trivial tests, {rounds} alternating rounds, load average {load:.1f} on {os.cpu_count()} CPUs:")
        print(f"median {on:.3f} s with the plugin, {off:.3f} s without")
        print(f"plugin overhead: {(on - off) / TESTS * 1e6:.0f} µs per test (ACQUIRE and RELEASE, one round trip each)")
        print(f"for comparison, acquire + release back to back in one process: {round_trips(path) * 1e6:.0f} µs (median of 7 rounds of {TESTS})")
    finally:
        broker.send_signal(signal.SIGTERM)
        broker.wait()
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
