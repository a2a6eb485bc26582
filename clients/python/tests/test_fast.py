"""FastClient: the fast path through libbaton (built from clients/c by the
`libbaton` fixture), against the real broker. Counted from the broker's
books (STATUS) and, for two processes, from the jobs themselves (a POSIX
record lock per running job, which the kernel drops when its process dies).

The clients of a test join one build: the test's own process says BUILD on
a connection it keeps (raw protocol: neither client has a call for it), and
the broker puts every later connection of it and of its children in that
build. A region serves one build: without BUILD each connection would be a
build of its own, and the broker would keep every region closed.
"""

from __future__ import annotations

import ctypes.util
import errno
import json
import os
import pathlib
import select
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import wait_for

from baton_client import BatonError, FastClient, NoBrokerError, NoLibraryError, RefusedError

CHILD = pathlib.Path(__file__).with_name("fast_child.py")

# How long a test waits for what must happen at once, before it fails
# rather than hangs (a hang guard, not a timing check).
PATIENCE = 20.0

OTHER_UID = 65534


@pytest.fixture
def build_root():
    """build_root(broker): a connection that started a build, kept open
    until the test ends."""
    roots = []

    def start(broker) -> socket.socket:
        root = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        roots.append(root)
        root.settimeout(PATIENCE)
        root.connect(broker.socket)
        root.sendall(b"HELLO 1 py fast-path test\nBUILD 1 py fast-path test\n")
        said = b""
        while said.count(b"\n") < 2:
            chunk = root.recv(256)
            assert chunk, f"the broker closed the connection after {said!r}"
            said += chunk
        assert said.startswith(b"OK ") and b"\nBUILD " in said, f"HELLO and BUILD answered {said!r}"
        return root

    yield start
    for root in roots:
        root.close()


def seated(broker, libbaton: str, label: str) -> FastClient:
    client = FastClient.connect(broker.socket, label=label, library=libbaton)
    assert client.enable_fastpath() is True, client.fastpath_refusal
    assert client.uses_fastpath
    return client


def booked_on(status: dict, label: str) -> int:
    """The tokens STATUS lists for the connection labelled `label`."""
    return sum(h["tokens"] for h in status["holders"] if h["command"] == label)


def all_back(broker, libbaton: str) -> None:
    """Every token back in the pool and nobody waiting, as STATUS says
    (the broker ends a region when its last seated client's connection
    closes, which it learns in its own time)."""
    with FastClient.connect(broker.socket, label="check", library=libbaton) as check:

        def back() -> bool:
            status = check.status()
            return status["held"] == 0 and status["free"] == status["limit"] and not status["waiters"]

        wait_for("every token back in the pool", back, PATIENCE)


def child(*args: str, **popen: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(CHILD), *args], **popen)


def end(proc: subprocess.Popen) -> None:
    """Every process a test starts is ended by it, however it fails."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=PATIENCE)


def test_a_seat_takes_and_gives_tokens_in_the_region_and_status_shows_the_holder(start_broker, build_root, libbaton):
    broker = start_broker(2)
    build_root(broker)
    watch = FastClient.connect(broker.socket, label="watch", library=libbaton)
    with seated(broker, libbaton, "py fast") as client:
        assert client.limit == 2
        assert client.enable_fastpath() is True, "a second call on a seated connection does nothing"
        client.acquire(timeout=PATIENCE)
        assert client.held == 1
        # The broker lends the pool's free tokens at its next round: until
        # then a TRY finds none, in the region or the pool.
        wait_for("the region to be lent the free token", client.try_acquire, PATIENCE)
        status = watch.status()
        assert client.held == 2 and booked_on(status, "py fast") == 2
        assert status["free"] == 0 and any(h["pid"] == os.getpid() and h["command"] == "py fast" for h in status["holders"])
        # What passes in the region is no grant of the pool's.
        grants = status["totals"]["granted"]
        client.release()
        with client.token():
            assert client.held == 2
        assert client.try_acquire() and client.held == 2
        client.release(2)
        assert client.held == 0 and booked_on(watch.status(), "py fast") == 0
        assert watch.status()["totals"]["granted"] == grants
        assert client.uses_fastpath
    watch.close()
    all_back(broker, libbaton)


def test_a_deadline_is_honoured_in_the_region_and_refusals_raise(start_broker, build_root, libbaton):
    broker = start_broker(1)
    build_root(broker)
    with seated(broker, libbaton, "holder") as holder, seated(broker, libbaton, "waiter") as waiter:
        holder.acquire(timeout=PATIENCE)
        with pytest.raises(TimeoutError, match=r"fast path\): the wait was withdrawn") as timed_out:
            waiter.acquire(timeout=0.05)
        assert timed_out.value.errno == errno.ETIMEDOUT and waiter.held == 0 and waiter.uses_fastpath
        assert not waiter.try_acquire()
        # n > 1 goes over the socket, and the broker refuses what could never be granted.
        with pytest.raises(RefusedError, match=r"\(range\)") as too_many:
            waiter.acquire(2)
        assert too_many.value.code == "range" and waiter.refusal.endswith("(range)")
        with pytest.raises(RefusedError) as over:
            waiter.release()
        assert over.value.code == "over-release"
        with pytest.raises(ValueError):
            waiter.acquire(-1)
        holder.release()
        waiter.acquire(timeout=PATIENCE)
        assert waiter.held == 1 and holder.held == 0
        waiter.release()
    all_back(broker, libbaton)


def test_a_deadline_in_seconds_is_never_early(start_broker, build_root, libbaton):
    """``timeout`` is seconds: the wait is withdrawn only once that long
    has passed, in the region and over the socket (CLOCK_MONOTONIC, the
    clock both the library and time.monotonic() read)."""
    broker = start_broker(2)
    build_root(broker)
    with seated(broker, libbaton, "holder") as holder, seated(broker, libbaton, "waiter") as waiter:
        holder.acquire(timeout=PATIENCE)
        wait_for("the region to be lent the free token", holder.try_acquire, PATIENCE)
        for n in (1, 2):
            began = time.monotonic()
            with pytest.raises(TimeoutError):
                waiter.acquire(n, timeout=0.3)
            waited = time.monotonic() - began
            assert waited >= 0.3, f"acquire({n}, timeout=0.3) gave up after {waited:.6f} s"
            assert waiter.held == 0
        holder.release(2)
    all_back(broker, libbaton)


def test_no_broker_at_a_missing_or_stale_socket_is_no_broker_error(libbaton, tmp_path):
    """Nothing at the path, or a socket file nobody listens at (a broker
    killed with SIGKILL leaves one): NoBrokerError, as the socket client
    raises, so that a caller can start a broker or fall back."""
    missing = str(tmp_path / "missing")
    with pytest.raises(NoBrokerError) as nothing:
        FastClient.connect(missing, library=libbaton)
    assert nothing.value.errno == errno.ENOENT
    stale = str(tmp_path / "stale")
    left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    left.bind(stale)
    left.close()
    with pytest.raises(NoBrokerError) as refused:
        FastClient.connect(stale, library=libbaton)
    assert refused.value.errno == errno.ECONNREFUSED


def layout_env(pile: bool) -> dict:
    """A child's environment: BATON_TEST_PILE=1 makes it ask for a pile."""
    return {**os.environ, "BATON_TEST_PILE": "1" if pile else "0"}


@pytest.mark.parametrize("pile", [False, True], ids=["ring", "pile"])
def test_two_processes_on_one_token_never_run_two_jobs_at_once(start_broker, build_root, libbaton, tmp_path, pile):
    broker = start_broker(1)
    build_root(broker)
    lockfile = tmp_path / "locks"
    lockfile.write_bytes(b"\0" * 3)
    env = layout_env(pile)
    procs = [
        child("jobs", libbaton, broker.socket, str(lockfile), str(i), "2", "1", "300", stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        for i in range(2)
    ]
    try:
        # Both seated before either starts: their rounds overlap.
        for proc in procs:
            ready, _, _ = select.select([proc.stdout], [], [], PATIENCE)
            assert ready and proc.stdout.readline() == b"seated\n", f"a job process did not get a seat: {proc.stderr.read().decode()}"
        for proc in procs:
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
        for proc in procs:
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, f"a job process exited {proc.returncode}: {err.decode()}"
    finally:
        for proc in procs:
            end(proc)
    over = pathlib.Path(f"{lockfile}.over")
    assert not over.exists(), over.read_text()
    all_back(broker, libbaton)


@pytest.mark.parametrize("pile", [False, True], ids=["ring", "pile"])
def test_a_holder_killed_with_sigkill_has_its_region_token_back_in_the_pool(start_broker, build_root, libbaton, pile):
    broker = start_broker(1)
    build_root(broker)
    holder = child("hold", libbaton, broker.socket, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=layout_env(pile))
    try:
        ready, _, _ = select.select([holder.stdout], [], [], PATIENCE)
        assert ready, f"the holder said nothing within {PATIENCE} s (hang guard)"
        assert holder.stdout.readline() == b"held\n"
        with FastClient.connect(broker.socket, label="watch", library=libbaton) as watch:
            status = watch.status()
            assert [h["tokens"] for h in status["holders"] if h["pid"] == holder.pid] == [1], status["holders"]
            repairs = status["totals"]["fastpath_repairs"]
            os.kill(holder.pid, signal.SIGKILL)
            holder.wait(timeout=PATIENCE)
            all_back(broker, libbaton)
            # Back through the repair of its seat: the token was the region's.
            assert watch.status()["totals"]["fastpath_repairs"] > repairs
    finally:
        end(holder)


def as_other_uid(libbaton: str, socket_path: str) -> dict:
    """What a client of uid OTHER_UID saw, run in a forked child of this
    process, not an exec'd one: the library is already loaded here, and the
    Python that runs the tests may sit where that uid cannot read (a
    pyenv under /root), which an exec would need."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setresgid(OTHER_UID, OTHER_UID, OTHER_UID)
            os.setresuid(OTHER_UID, OTHER_UID, OTHER_UID)
            with FastClient.connect(socket_path, label="other user", library=libbaton) as client:
                saw = {"uid": os.getuid(), "seated": client.enable_fastpath(), "words": client.fastpath_refusal}
                saw.update(refusal=client.refusal, uses_fastpath=client.uses_fastpath)
                client.acquire(timeout=PATIENCE)
                saw["held"] = client.held
                client.release()
                saw["held_after"] = client.held
            os.write(write, json.dumps(saw).encode())
            code = 0
        except BaseException as e:
            os.write(write, json.dumps({"error": repr(e)}).encode())
        finally:
            os._exit(code)
    os.close(write)
    try:
        with os.fdopen(read, "rb") as said:
            ready, _, _ = select.select([said], [], [], PATIENCE)
            assert ready, f"the client of uid {OTHER_UID} said nothing within {PATIENCE} s (hang guard)"
            saw = json.loads(said.read() or b"{}")
    finally:
        if os.waitpid(pid, os.WNOHANG) == (0, 0):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return saw


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a client as another uid")
def test_another_uid_is_refused_a_seat_and_the_socket_serves_it_on(start_broker, libbaton):
    broker = start_broker(1, "--allow-uid", str(OTHER_UID))
    # The broker's directory is the test's (0700): opened to the other user.
    os.chmod(broker.dir, 0o755)
    os.chmod(os.path.dirname(broker.socket), 0o755)
    os.chmod(broker.socket, 0o777)
    saw = as_other_uid(libbaton, broker.socket)
    assert "error" not in saw, saw["error"]
    assert saw["uid"] == OTHER_UID and saw["seated"] is False and saw["uses_fastpath"] is False
    assert saw["refusal"].endswith(f"only its own user gets it, not uid {OTHER_UID} (unavailable)")
    assert saw["words"] == f"broker refused: {saw['refusal']}"
    assert (saw["held"], saw["held_after"]) == (1, 0)
    all_back(broker, libbaton)


def test_a_child_of_fork_refuses_its_parents_client_and_leaves_it_whole(start_broker, build_root, libbaton):
    broker = start_broker(1)
    build_root(broker)
    with seated(broker, libbaton, "parent") as client:
        client.acquire(timeout=PATIENCE)
        pid = os.fork()
        if pid == 0:
            # The child: refused before the library touches the region,
            # which is not mapped here; close() only forgets it.
            code = 1
            try:
                try:
                    client.release()
                except BatonError as e:
                    code = 0 if "fork" in str(e) else 2
                client.close()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert client.held == 1 and client.uses_fastpath
        client.release()
        assert client.held == 0
    all_back(broker, libbaton)


def test_a_missing_library_says_how_to_build_it(monkeypatch, tmp_path):
    missing = str(tmp_path / "libbaton.so.0")
    with pytest.raises(NoLibraryError, match=r"make -C clients/c install PREFIX="):
        FastClient.connect("/nowhere", library=missing)
    monkeypatch.setenv("BATON_LIBRARY", missing)
    with pytest.raises(NoLibraryError, match=f"cannot load libbaton from {missing}"):
        FastClient.connect("/nowhere")
    monkeypatch.delenv("BATON_LIBRARY")
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    with pytest.raises(NoLibraryError, match=r"libbaton not found .*make -C clients/c install PREFIX=.*BATON_LIBRARY="):
        FastClient.connect("/nowhere")
