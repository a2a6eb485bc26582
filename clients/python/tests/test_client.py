"""Client and AsyncClient against the real broker."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading

import pytest
from conftest import REPO, wait_for

from baton_client import AsyncClient, Client, NoBrokerError, RefusedError, socket_path


def all_free(broker) -> dict:
    with Client(broker.socket, "check") as c:
        s = c.status()
    assert (s["free"], s["held"], s["waiters"]) == (s["limit"], 0, []), f"tokens missing at the end: {s}"
    return s


def status(broker) -> dict:
    with Client(broker.socket, "status") as c:
        return c.status()


def test_a_token_is_held_inside_with_and_back_after(start_broker):
    broker = start_broker(2)
    with Client(broker.socket, "py test") as client:
        assert (client.source, client.limit) == ("broker", 2)
        with client.acquire(2) as token:
            assert token.n == 2
            s = client.status()
            assert s["free"] == 0
            assert [(h["command"], h["tokens"]) for h in s["holders"]] == [("py test", 2)]
        assert token.released
        assert client.status()["free"] == 2
    all_free(broker)


def test_try_acquire_takes_only_what_is_free(start_broker):
    broker = start_broker(1)
    with Client(broker.socket, "a") as a, Client(broker.socket, "b") as b:
        held = a.try_acquire()
        assert held is not None
        assert b.try_acquire() is None
        b.release(held)  # release is the token's own: any client may pass it on
        again = b.try_acquire()
        assert again is not None
        again.release()
    all_free(broker)


def test_a_token_from_try_acquire_of_several_gives_all_of_them_back(start_broker):
    """try_acquire(n)'s token is n tokens: released, the client holds none."""
    broker = start_broker(3)
    with Client(broker.socket, "several") as client:
        token = client.try_acquire(2)
        assert token is not None and token.n == 2
        assert [(h["command"], h["tokens"]) for h in client.status()["holders"]] == [("several", 2)]
        token.release()
        assert client.status()["holders"] == []

    async def main() -> None:
        async with AsyncClient(broker.socket, "several async") as client:
            token = await client.try_acquire(2)
            assert token is not None and token.n == 2
            await token.release()
            assert (await client.status())["holders"] == []

    asyncio.run(main())
    all_free(broker)


def test_an_expired_timeout_takes_nothing(start_broker):
    broker = start_broker(1)
    with Client(broker.socket, "holder") as holder, Client(broker.socket, "waiter") as waiter:
        token = holder.acquire()
        with pytest.raises(TimeoutError):
            waiter.acquire(timeout=0.05)
        assert status(broker)["waiters"] == []
        token.release()
        s = waiter.status()  # the withdrawn request was not served meanwhile
        assert (s["free"], s["holders"]) == (1, [])
        with waiter.acquire(timeout=10):
            pass
    all_free(broker)


def test_a_refused_request_raises_its_code_and_the_client_stays_usable(start_broker):
    broker = start_broker(2)
    with Client(broker.socket, "greedy") as client:
        with pytest.raises(RefusedError) as refused:
            client.acquire(3)
        assert refused.value.code == "range"
        with client.acquire(2):
            pass
    all_free(broker)


def test_a_forgotten_token_warns_and_goes_back_when_collected(start_broker):
    broker = start_broker(1)
    with Client(broker.socket, "forgetful") as client:
        with pytest.warns(ResourceWarning, match="never released"):
            client.acquire()
            gc.collect()
        assert client.status()["free"] == 1
    all_free(broker)


HOLDER = textwrap.dedent(
    """
    import sys, time
    from baton_client import Client
    client = Client(sys.argv[1], "doomed")
    token = client.acquire(2)
    print("held", flush=True)
    time.sleep(600)
    """
)


def test_tokens_of_a_holder_killed_with_9_come_back(start_broker):
    broker = start_broker(3)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, broker.socket], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        assert status(broker)["free"] == 1
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=10)
        wait_for("the killed holder's tokens", lambda: status(broker)["free"] == 3)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert all_free(broker)["totals"]["reclaimed"] == 2


def test_no_broker_at_an_explicit_path_says_so(tmp_path):
    with pytest.raises(NoBrokerError, match=r"no broker at .* \(start one with: baton serve"):
        Client(str(tmp_path / "nothing"))


def test_the_socket_is_found_as_the_cli_finds_it(monkeypatch):
    monkeypatch.setenv("BATON_SOCKET", "/x/s")
    assert socket_path("/explicit") == "/explicit"
    assert socket_path() == "/x/s"
    monkeypatch.delenv("BATON_SOCKET")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/7")
    assert socket_path() == "/run/user/7/baton/socket"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert socket_path() == f"/tmp/baton-{os.getuid()}/socket"


def test_a_default_directory_that_is_a_link_open_to_others_or_not_ours_is_refused(start_broker, tmp_path, monkeypatch):
    """$XDG_RUNTIME_DIR/baton is baton's own directory: the client talks to a
    broker there only if it is a real directory (never through a link, which
    whoever owns it could point elsewhere), ours, and private
    (docs/security.md). Here it is first a link to the live broker's own
    private directory, which is refused although everything behind the link
    would pass; then a directory open to others; then (as root) another
    uid's."""
    from baton_client import NotOurBrokerError

    broker = start_broker(1)
    real = os.path.dirname(broker.socket)
    os.chmod(real, 0o700)
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    monkeypatch.delenv("BATON_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    default = runtime / "baton"
    default.symlink_to(real)
    with pytest.raises(NotOurBrokerError, match="is a symbolic link"):
        Client(label="through a link")
    default.unlink()
    default.mkdir()
    os.chmod(default, 0o750)
    with pytest.raises(NotOurBrokerError, match=r"is open to other users \(mode 0750\)"):
        Client(label="open dir")
    if os.getuid() == 0:
        os.chmod(default, 0o700)
        os.chown(default, 65534, 65534)
        with pytest.raises(NotOurBrokerError, match="belongs to uid 65534"):
            Client(label="their dir")
    all_free(broker)


def test_async_acquire_and_release(start_broker):
    broker = start_broker(2)

    async def main() -> None:
        async with AsyncClient(broker.socket, "async") as client:
            async with client.acquire(2) as token:
                assert token.n == 2
                assert (await client.status())["free"] == 0
            assert (await client.status())["free"] == 2
            token = await client.acquire()
            async with AsyncClient(broker.socket, "other") as other:
                assert await other.try_acquire(2) is None
            await client.release(token)

    asyncio.run(main())
    all_free(broker)


def test_cancelling_a_waiting_async_acquire_gives_nothing_away(start_broker):
    broker = start_broker(1)

    async def main() -> None:
        async with AsyncClient(broker.socket, "holder") as holder, AsyncClient(broker.socket, "cancelled") as waiter:
            token = await holder.acquire()
            task = asyncio.ensure_future(waiter.acquire())
            while not (await holder.status())["waiters"]:
                await asyncio.sleep(0.002)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            s = await holder.status()
            assert s["waiters"] == []
            with pytest.raises(TimeoutError):
                await waiter.acquire(timeout=0.05)
            await token.release()
            s = await waiter.status()
            assert (s["free"], s["holders"], s["waiters"]) == (1, [], [])

    asyncio.run(main())
    all_free(broker)


def test_a_full_broker_turns_the_client_away_with_its_code(tmp_path):
    # Filling a real broker takes 60,000 connections, more than most systems
    # allow one process (test_vectors.py replays it where they do); a stand-in
    # sends the vector's bytes at connect and closes, as the broker does.
    vectors = json.loads((REPO / "docs" / "protocol-vectors.json").read_text())["vectors"]
    full = next(step[2] for v in vectors for step in v["steps"] if step[1] == "recv" and step[2].startswith("ERR full "))
    path = str(tmp_path / "full.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()

    def turn_away() -> None:
        conn, _ = server.accept()
        conn.sendall(full.encode())
        conn.close()

    stand_in = threading.Thread(target=turn_away)
    stand_in.start()
    with pytest.raises(RefusedError) as refused:
        Client(path, "one too many")
    stand_in.join()
    server.close()
    assert refused.value.code == "full"


def test_a_label_is_cut_to_what_the_broker_accepts_and_shown_as_cut(start_broker):
    """A label with control characters and more than 200 bytes, of
    two-byte characters: the client drops the control characters and cuts
    at a character's end, so the real broker takes it (it refuses control
    characters and longer labels) and lists the holder under that label."""
    broker = start_broker(1)
    label = "build!\x07\t" + "é" * 150
    with Client(broker.socket, label) as client:
        with client.acquire():
            holders = client.status()["holders"]
    assert [h["command"] for h in holders] == ["build!" + "é" * 97]
    all_free(broker)
