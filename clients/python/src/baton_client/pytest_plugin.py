"""A pytest plugin: each test takes one token before it runs and gives it
back after, so tests (``pytest -n N`` with pytest-xdist, or one at a time)
count towards the same limit as the builds beside them.

Registered as ``baton`` through the ``pytest11`` entry point. It is on when
a broker answers (``$BATON_SOCKET``, else the default socket) or MAKEFLAGS
names a GNU make jobserver; ``--baton`` insists (an error if neither is
there), ``--no-baton`` or ``-p no:baton`` turns it off.

Under pytest-xdist the controller runs no tests and takes nothing; each
worker holds its own connection, so a worker killed in the middle of a test
gives its token back as any client does when its socket closes. Workers
cannot inherit a pipe jobserver's descriptors (``--jobserver-auth=R,W``,
make 4.3: execnet closes them), so the controller hands them the same pipe
through ``/proc/PID/fd``.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any, Iterator, Optional, Union

import pytest

from . import _jobserver
from ._client import Client
from ._wire import BatonError, NoBrokerError, socket_path

# The key in pytest-xdist's workerinput under which the controller passes a
# pipe jobserver on to its workers.
WORKER_JOBSERVER = "baton_jobserver"


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("baton", "take a baton token for each test")
    group.addoption(
        "--baton",
        action="store_const",
        const="on",
        dest="baton",
        default="auto",
        help="each test takes a token from the baton broker or the jobserver in MAKEFLAGS; "
        "an error if neither is there (default: only if one is)",
    )
    group.addoption("--no-baton", action="store_const", const="off", dest="baton", help="take no tokens")


def pytest_configure(config: Any) -> None:
    mode = config.getoption("baton")
    if mode == "off":
        return
    if _is_xdist_controller(config):
        if mode == "on" and not _something_to_take_from():
            _none_or_fail(mode, _NOTHING.format(socket_path()))
        return
    source = _token_source(config, mode)
    if source is not None:
        config.pluginmanager.register(TokenPerTest(source), "baton-token-per-test")


def pytest_report_header(config: Any) -> str:
    plugin = config.pluginmanager.get_plugin("baton-token-per-test")
    if plugin is not None:
        return f"baton: each test takes one token from {plugin.source.describe()}"
    if config.getoption("baton") == "off":
        return "baton: off (--no-baton)"
    if _is_xdist_controller(config) and _something_to_take_from():
        return "baton: each pytest-xdist worker takes one token per test from the broker or jobserver it finds"
    return f"baton: off (no broker answers at {socket_path()} and MAKEFLAGS names no jobserver)"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """pytest-xdist, in the controller, for each worker it starts: pass a
    pipe jobserver on by path, since the worker will not inherit it."""
    auth = _jobserver.auth_from_makeflags(os.environ.get("MAKEFLAGS"))
    if auth and not auth.startswith("fifo:"):
        try:
            read_fd, write_fd = (int(x) for x in auth.split(","))
            _jobserver.check_pipe(read_fd, write_fd)
        except (ValueError, OSError):
            return  # not ours to pass on: the worker's own check says so
        node.workerinput[WORKER_JOBSERVER] = f"fifo:/proc/{os.getpid()}/fd/{read_fd}"


class BrokerSource:
    def __init__(self, client: Client) -> None:
        self.client = client

    def take(self) -> Any:
        return self.client.acquire()

    def give(self, token: Any) -> None:
        token.release()

    def describe(self) -> str:
        return f"the broker at {socket_path()}"


class JobserverSource:
    """The jobserver in MAKEFLAGS, or the one a pytest-xdist controller
    passed on (see pytest_configure_node)."""

    def __init__(self, jobserver: _jobserver.Jobserver) -> None:
        self.jobserver = jobserver

    def take(self) -> Any:
        return self.jobserver.take(1, None)

    def give(self, token: Any) -> None:
        self.jobserver.give(token)

    def describe(self) -> str:
        return f"the jobserver {self.jobserver.auth}"


class TokenPerTest:
    def __init__(self, source: Union[BrokerSource, JobserverSource]) -> None:
        self.source = source

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item: Any, nextitem: Any) -> Iterator[None]:
        # Setup, call and teardown all run inside the token: fixtures are
        # work too.
        token = self.source.take()
        try:
            yield
        finally:
            self.source.give(token)


def _is_xdist_controller(config: Any) -> bool:
    """True in the pytest-xdist process that hands tests to workers and
    runs none itself."""
    if hasattr(config, "workerinput"):
        return False
    try:
        return bool(config.getoption("numprocesses")) and config.getoption("dist") != "no"
    except ValueError:
        return False  # no pytest-xdist


def _token_source(config: Any, mode: str) -> Optional[Union[BrokerSource, JobserverSource]]:
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    label = f"pytest {worker}" if worker else "pytest"
    try:
        # The socket named, so that Client does not fall back on MAKEFLAGS
        # itself: in a worker, its R,W numbers are descriptors of execnet's.
        return BrokerSource(Client(socket_path(), label=label))
    except NoBrokerError:
        pass
    except BatonError as e:
        return _none_or_fail(mode, f"baton: the broker at {socket_path()} turned pytest away: {e}")
    auth = _jobserver_here(config)
    if auth:
        try:
            return JobserverSource(_jobserver.Jobserver(auth))
        except (OSError, ValueError, BatonError) as e:
            return _none_or_fail(mode, f"baton: no broker at {socket_path()}, and the jobserver {auth} cannot be opened: {e}")
    if _jobserver.auth_from_makeflags(os.environ.get("MAKEFLAGS")):
        return _none_or_fail(
            mode,
            f"baton: no broker at {socket_path()}, and the jobserver MAKEFLAGS names did not reach this "
            "pytest-xdist worker (a make 4.3 pipe reaches pytest only with '+' in front of its recipe line)",
        )
    if mode == "on":
        raise pytest.UsageError(_NOTHING.format(socket_path()))
    return None


def _jobserver_here(config: Any) -> Optional[str]:
    """The jobserver this process may use: in a pytest-xdist worker, the one
    its controller passed on, else a FIFO MAKEFLAGS names (never MAKEFLAGS'
    descriptor numbers, which execnet closed and may have used again);
    anywhere else, what MAKEFLAGS names."""
    auth = _jobserver.auth_from_makeflags(os.environ.get("MAKEFLAGS"))
    if hasattr(config, "workerinput"):
        passed_on = config.workerinput.get(WORKER_JOBSERVER)
        return passed_on or (auth if auth and auth.startswith("fifo:") else None)
    return auth


_NOTHING = (
    "baton: --baton, but no broker answers at {} and MAKEFLAGS names no jobserver "
    "(start one with: baton serve --jobs N, or run pytest from a make recipe)"
)


def _something_to_take_from() -> bool:
    """A broker listens, or MAKEFLAGS names a jobserver: a probe for the
    pytest-xdist controller, which holds no connection of its own."""
    if _jobserver.auth_from_makeflags(os.environ.get("MAKEFLAGS")):
        return True
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(socket_path())
        return True
    except OSError:
        return False
    finally:
        probe.close()


def _none_or_fail(mode: str, message: str) -> None:
    """With --baton, an error; else a word on stderr, and tests run as
    without the plugin."""
    if mode == "on":
        raise pytest.UsageError(message)
    print(message, file=sys.stderr)
    return None
