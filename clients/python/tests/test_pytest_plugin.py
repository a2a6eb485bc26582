"""The pytest plugin (baton_client.pytest_plugin) under pytest-xdist, beside
a real make build under `baton run`, against a real broker with a limit of
2. Tests and make's jobs append `start NAME` and `end NAME` to one log
(O_APPEND: one write a line), inside the token they hold, so the order of
its lines is the order of the events and the overlap counted from it is
exact."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest

from conftest import baton_bin

TESTS = 8

# A suite of its own: each test logs its start and end; BATON_BARRIER is a
# number of tests that must have started before any goes on.
SUITE = '''
import os, time, pytest

LOG = os.environ["BATON_TEST_LOG"]

def log(line):
    fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, (line + "\\n").encode())
    os.close(fd)

def wait_until(what, cond):
    until = time.monotonic() + 120
    while not cond():
        assert time.monotonic() < until, "timed out waiting for " + what
        time.sleep(0.005)

def lines():
    with open(LOG) as f:
        return f.read().splitlines()

@pytest.mark.parametrize("i", range({tests}))
def test_logged(i):
    log(f"start test{{i}}")
    barrier = int(os.environ.get("BATON_BARRIER", "0"))
    wait_until(f"{{barrier}} tests started", lambda: sum(l.startswith("start test") for l in lines()) >= barrier)
    time.sleep(0.1)
    log(f"end test{{i}}")
'''.format(tests=TESTS)

# Run as `baton run -- make` (no -j: a make given -jN starts a jobserver of
# its own). make's first job, in make's own slot, waits until a test has
# started, so that the two surely overlap; the short jobs come after it,
# while the tests run.
MAKEFILE = """\
SHORT = j1 j2 j3 j4 j5 j6 j7 j8 j9 j10 j11 j12
all: $(SHORT)
hold:
\techo "start $@" >> $(LOG); i=0; until grep -q '^start test' $(LOG); do \\
\t  i=$$((i + 1)); [ $$i -lt 24000 ] || exit 1; sleep 0.005; done; echo "end $@" >> $(LOG)
$(SHORT): hold
\techo "start $@" >> $(LOG); sleep 0.1; echo "end $@" >> $(LOG)
.PHONY: all hold $(SHORT)
"""


def max_overlap(lines: list) -> int:
    running = peak = 0
    for line in lines:
        if line.startswith("start "):
            running += 1
            peak = max(peak, running)
        elif line.startswith("end "):
            running -= 1
    return peak


def run_suite(tmp_path: pathlib.Path, env: dict, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "4", *options, str(tmp_path / "suite" / "test_suite.py")],
        cwd=tmp_path / "suite",
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def wait_for_line(log: pathlib.Path, line: str, proc: subprocess.Popen) -> None:
    from conftest import wait_for

    def seen() -> bool:
        assert proc.poll() is None, f"the build ended before logging {line!r}"
        return log.exists() and line in log.read_text().splitlines()

    wait_for(f"{line!r} in {log}", seen, limit=120)


@pytest.fixture
def suite(tmp_path):
    pytest.importorskip("xdist", reason="pytest-xdist is not installed (scripts/test installs it)")
    (tmp_path / "suite").mkdir()
    (tmp_path / "suite" / "test_suite.py").write_text(SUITE)
    return tmp_path


def test_tests_and_make_jobs_share_the_limit_with_the_plugin_and_not_without(suite, start_broker):
    broker = start_broker(2)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "PYTEST_ADDOPTS")}
    env["BATON_SOCKET"] = broker.socket

    # With the plugin: pytest -n 4 beside a make build under baton run.
    log = suite / "with.log"
    (suite / "Makefile").write_text(MAKEFILE)
    make = os.environ.get("BATON_TEST_MAKE43") or "/usr/bin/make"
    build = subprocess.Popen(
        [baton_bin(), "run", "--socket", broker.socket, "--", make, "-C", str(suite), f"LOG={log}"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_line(log, "start hold", build)
        run = run_suite(suite, {**env, "BATON_TEST_LOG": str(log)})
        assert run.returncode == 0, run.stdout + run.stderr
        _, err = build.communicate(timeout=300)
        assert build.returncode == 0, err
    finally:
        if build.poll() is None:
            os.kill(build.pid, signal.SIGKILL)
            build.wait()
    lines = log.read_text().splitlines()
    assert sum(line.startswith("end test") for line in lines) == TESTS, lines
    assert sum(line.startswith("end j") for line in lines) == 12, lines
    assert max_overlap(lines) == 2, f"tests and make's jobs ran {max_overlap(lines)} at once under a limit of 2:\n" + "\n".join(lines)
    assert "baton: each pytest-xdist worker takes one token per test" in run.stdout, run.stdout
    status = json.loads(subprocess.run([baton_bin(), "status", "--json", "--socket", broker.socket], capture_output=True, check=True).stdout)
    assert (status["held"], status["free"]) == (0, 2), status

    # Without it: the same suite, the same broker, four tests at once (each
    # waits until four have started, which could not happen under the limit).
    log = suite / "without.log"
    run = run_suite(suite, {**env, "BATON_TEST_LOG": str(log), "BATON_BARRIER": "4"}, "-p", "no:baton")
    assert run.returncode == 0, run.stdout + run.stderr
    lines = log.read_text().splitlines()
    assert max_overlap(lines) == 4, "\n".join(lines)


@pytest.mark.parametrize(
    "env_name,fallback,style",
    [
        ("BATON_TEST_MAKE43", "/usr/bin/make", r"\d+,\d+"),
        ("BATON_TEST_MAKE44", os.path.join(os.path.dirname(sys.executable), "make"), "fifo:"),
    ],
)
def test_xdist_workers_take_their_tokens_from_a_real_make_jobserver(suite, tmp_path, env_name, fallback, style):
    """pytest -n 4 in a recipe of make -j3 and no broker: the recipe's own
    slot stays with the controller, so two tests at once, from the two
    tokens in make's jobserver (a pipe with make 4.3, which the workers
    reach through the controller; a FIFO with make 4.4). Each test waits
    until two have started, so two at once is sure to happen."""
    from test_jobserver import make

    log = tmp_path / "jobserver.log"
    (tmp_path / "suite" / "Makefile").write_text(
        "all:\n\t@echo \"auth: $(filter --jobserver-auth=%,$(MAKEFLAGS))\"\n"
        "\t+@$(PY) -m pytest -p no:cacheprovider -n 4 test_suite.py\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "PYTEST_ADDOPTS")}
    env.update(BATON_SOCKET=str(tmp_path / "no-broker-here"), BATON_TEST_LOG=str(log), BATON_BARRIER="2")
    run = subprocess.run(
        [make(env_name, fallback), "-j3", "-C", str(tmp_path / "suite"), f"PY={sys.executable}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert re.search(f"--jobserver-auth={style}", out), out
    assert f"{TESTS} passed" in out, out
    assert "INTERNAL" not in out, out  # make's own check: every token back at exit
    lines = log.read_text().splitlines()
    assert max_overlap(lines) == 2, "\n".join(lines)


KILLED = '''
import os, signal, time, pytest
from baton_client import Client

LOG = os.environ["BATON_TEST_LOG"]

def log(line):
    fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, (line + "\\n").encode())
    os.close(fd)

def wait_until(what, cond):
    until = time.monotonic() + 120
    while not cond():
        assert time.monotonic() < until, "timed out waiting for " + what
        time.sleep(0.005)

@pytest.mark.xdist_group("killed")
def test_killed():
    log("killing my worker")
    os.kill(os.getpid(), signal.SIGKILL)

@pytest.mark.xdist_group("watcher")
def test_watcher():
    wait_until("the other test", lambda: os.path.exists(LOG))
    with Client(label="watcher") as client:
        # Both tokens are held (ours and the killed test's) until its
        # worker dies; then only ours, while pytest still runs.
        wait_until("the killed worker's token back", lambda: client.status()["held"] == 1)
'''


def test_a_killed_worker_gives_its_token_back_while_pytest_runs(tmp_path, start_broker):
    pytest.importorskip("xdist", reason="pytest-xdist is not installed (scripts/test installs it)")
    broker = start_broker(2)
    (tmp_path / "test_killed.py").write_text(KILLED)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "PYTEST_ADDOPTS")}
    env.update(BATON_SOCKET=broker.socket, BATON_TEST_LOG=str(tmp_path / "killed.log"))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup", "-rA", str(tmp_path / "test_killed.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = run.stdout + run.stderr
    assert re.search(r"PASSED .*test_watcher", out), out
    assert re.search(r"crashed while running .*test_killed", out), out
    status = json.loads(subprocess.run([baton_bin(), "status", "--json", "--socket", broker.socket], capture_output=True, check=True).stdout)
    assert (status["held"], status["free"]) == (0, 2), status


def pytest_under_a_make_43_recipe_line_without_plus(tmp_path, pytest_args):
    """Runs the suite's pytest (with `pytest_args`) from a make 4.3 -j3
    recipe line without '+', no broker listening; checks that MAKEFLAGS
    named R,W and that every test passed, and returns what was printed."""
    from test_jobserver import make

    (tmp_path / "suite" / "Makefile").write_text(
        "all:\n\t@echo \"auth: $(filter --jobserver-auth=%,$(MAKEFLAGS))\"\n"
        f"\t@$(PY) -m pytest -p no:cacheprovider {' '.join(pytest_args)} test_suite.py\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "PYTEST_ADDOPTS")}
    env.update(BATON_SOCKET=str(tmp_path / "no-broker-here"), BATON_TEST_LOG=str(tmp_path / "pytest.log"))
    run = subprocess.run(
        [make("BATON_TEST_MAKE43", "/usr/bin/make"), "-j3", "-C", str(tmp_path / "suite"), f"PY={sys.executable}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = run.stdout + run.stderr
    assert re.search(r"--jobserver-auth=\d+,\d+", out), out
    assert run.returncode == 0, out
    assert f"{TESTS} passed" in out, out
    return out


def test_pytest_under_a_recipe_line_without_plus_runs_its_tests_without_makes_pipe(suite, tmp_path):
    """make 4.3 -j3 runs plain pytest from a recipe line without '+': make
    closes its pipe's descriptors for the recipe, yet MAKEFLAGS still names
    R,W, and pytest's capture has reused those numbers for its own files by
    the time the plugin looks. The plugin must see that they are no
    jobserver's pipe, say so, and run the tests without tokens, not read
    a token out of its capture file (an INTERNALERROR: "no writers left")."""
    out = pytest_under_a_make_43_recipe_line_without_plus(tmp_path, [])
    assert "not a jobserver's pipe" in out, out


def test_an_xdist_worker_never_takes_makes_pipe_numbers_for_its_own(suite, tmp_path):
    """make 4.3 -j3 runs pytest -n 2 from a recipe line without '+': make
    closes its pipe's descriptors for the recipe, so the controller has
    nothing to pass on, yet MAKEFLAGS still names R,W. In a worker those
    numbers are execnet's descriptors, or nothing: the worker must say the
    jobserver did not reach it and run its tests as without the plugin,
    never read or write tokens on whatever those numbers are there."""
    out = pytest_under_a_make_43_recipe_line_without_plus(tmp_path, ["-n", "2"])
    assert "did not reach this pytest-xdist worker" in out, out
    assert "cannot be opened" not in out, out
