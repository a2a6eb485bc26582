"""docs/protocol-vectors.json replayed against the real broker through this
library's framing and reply decoder."""

from __future__ import annotations

import json
import socket
import time

import pytest
from conftest import REPO

from baton_client._wire import Connection, parse_reply

VECTORS = json.loads((REPO / "docs" / "protocol-vectors.json").read_text())["vectors"]
HANG_GUARD = 10.0


def matches(expected, actual) -> bool:
    """Every key given matches, recursively; lists element by element."""
    if isinstance(expected, dict):
        return isinstance(actual, dict) and all(k in actual and matches(v, actual[k]) for k, v in expected.items())
    if isinstance(expected, list):
        return isinstance(actual, list) and len(expected) == len(actual) and all(map(matches, expected, actual))
    return expected == actual


def status(conn: Connection) -> dict:
    conn.send(b"STATUS\n")
    reply = conn.read_reply(_deadline())
    assert reply.kind == "STATUS", reply
    return json.loads(reply.body)


def _deadline() -> float:
    return time.monotonic() + HANG_GUARD


def replay(vector: dict, path: str) -> None:
    conns: dict[str, Connection] = {}
    fillers: list[socket.socket] = []
    try:
        for step in vector["steps"]:
            who, op, arg = step[0], step[1], (step[2] if len(step) > 2 else None)
            if op == "fill":
                for _ in range(arg):
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    fillers.append(s)
                    s.connect(path)
                continue
            conn = conns.get(who) or conns.setdefault(who, Connection(path))
            if op == "send":
                conn.send(arg.encode())
            elif op == "recv":
                line = conn.read_line(_deadline())
                assert line == arg.encode(), f"{vector['name']}: {who} read {line!r}, expected {arg!r}"
                decoded = parse_reply(line[:-1])
                assert decoded.kind == arg.split(" ")[0]
                if decoded.kind == "ERR":
                    assert decoded.code == arg.split(" ")[1]
            elif op == "status":
                got = status(conn)
                assert matches(arg, got), f"{vector['name']}: {who}'s status {got} does not match {arg}"
            elif op == "status_until":
                until = time.monotonic() + HANG_GUARD
                while not matches(arg, status(conn)):
                    assert time.monotonic() < until, f"{vector['name']}: status never matched {arg}"
                    time.sleep(0.002)
            elif op == "closed":
                assert conn.read_line(_deadline()) == b"", f"{vector['name']}: {who} still open"
            elif op == "close":
                conn.close()
            else:
                pytest.fail(f"unknown op {op!r} in {vector['name']}")
    finally:
        for conn in conns.values():
            conn.close()
        for s in fillers:
            s.close()


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_vector(vector, start_broker):
    extra = ["--max-clients", str(vector["max_clients"])] if "max_clients" in vector else []
    broker = start_broker(vector["jobs"], *extra)
    replay(vector, broker.socket)
