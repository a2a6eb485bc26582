"""The native protocol's framing (docs/protocol.md): where the socket is,
request lines, reply lines, and a blocking connection with deadlines."""

from __future__ import annotations

import os
import re
import select
import socket
import stat
import struct
import time
from typing import NamedTuple, Optional

VERSION = 1
MAX_LABEL = 200


class BatonError(Exception):
    """Something went wrong talking to the broker or the jobserver."""


class NoBrokerError(BatonError, ConnectionError):
    """Nothing listens at the socket path (and no jobserver to fall back on)."""


class DisconnectedError(BatonError, ConnectionError):
    """The broker closed the connection (it stopped, or refused us fatally)."""


class RefusedError(BatonError):
    """The broker answered ``ERR <code> <message>``; ``code`` is the
    protocol's error code (``range``, ``over-release``, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"baton: broker refused: {message} ({code})")
        self.code = code
        self.message = message


class NotOurBrokerError(BatonError):
    """A process of another user answers at the socket, or the socket sits
    in one of baton's own directories that another user made: it is not
    our broker, and it is refused before a word is sent."""


def check_directory(path: str) -> None:
    """Refuses a socket in baton's own directories ($XDG_RUNTIME_DIR/baton,
    /tmp/baton-$UID) unless that directory is a private one of ours:
    another user may have made it first (docs/security.md)."""
    directory = os.path.dirname(path) or "."
    defaults = {f"/tmp/baton-{os.getuid()}"}
    if os.environ.get("XDG_RUNTIME_DIR"):
        defaults.add(os.path.join(os.environ["XDG_RUNTIME_DIR"], "baton"))
    if directory not in defaults:
        return
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return
    me = os.getuid()
    if stat.S_ISLNK(st.st_mode):
        raise NotOurBrokerError(f"baton: {directory} is a symbolic link, which anyone who owns it could point elsewhere: refusing it")
    if st.st_uid != me:
        raise NotOurBrokerError(f"baton: {directory} belongs to uid {st.st_uid}, not to you (uid {me}): refusing to use a broker there")
    if st.st_mode & 0o077:
        raise NotOurBrokerError(f"baton: {directory} is open to other users (mode {st.st_mode & 0o7777:04o}): refusing to use a broker there (if it is yours: chmod 700 {directory})")


def check_peer(sock: socket.socket, path: str) -> None:
    """Refuses a peer that is neither our own uid nor root (SO_PEERCRED: the
    kernel's word, whatever the socket file says)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    me = os.getuid()
    if uid not in (me, 0) and uid != named_broker_uid():
        raise NotOurBrokerError(
            f"baton: {path} is answered by a process of uid {uid}, not by your own broker (uid {me}) or root's: "
            "refusing to talk to it (someone else's broker or an impostor; remove the socket or choose another path; "
            "if it is the broker you mean to use, seen from a user namespace or run by a CI runner's user, "
            f"say so with BATON_BROKER_UID={uid})"
        )


def named_broker_uid():
    """$BATON_BROKER_UID: a broker's uid to trust although it is neither
    ours nor root's (the host's broker seen from a user namespace that does
    not map its uid shows as 65534; docs/containers.md). None if unset or
    not a number."""
    named = os.environ.get("BATON_BROKER_UID", "").strip()
    return int(named) if named.isdigit() else None


def refused_at_connect(path: str, e: RefusedError) -> RefusedError:
    """A refusal of HELLO in words that name the broker."""
    if e.code == "full":
        most = re.search(r"\d+", e.message)
        text = (
            f"baton: the broker at {path} serves its maximum of {most.group(0) if most else 'its'} clients "
            "(try again when some finish, or raise it: baton serve --max-clients N, and the broker's open-file limit)"
        )
    elif e.code == "denied":
        text = f"baton: the broker at {path} refuses you: {e.message}"
    else:
        return e
    worded = RefusedError(e.code, e.message)
    worded.args = (text,)
    return worded


def socket_path(explicit: Optional[str] = None) -> str:
    """`explicit`, else $BATON_SOCKET, else $XDG_RUNTIME_DIR/baton/socket,
    else /tmp/baton-$UID/socket: the same order as the ``baton`` CLI."""
    if explicit:
        return explicit
    if os.environ.get("BATON_SOCKET"):
        return os.environ["BATON_SOCKET"]
    if os.environ.get("XDG_RUNTIME_DIR"):
        return os.path.join(os.environ["XDG_RUNTIME_DIR"], "baton", "socket")
    return f"/tmp/baton-{os.getuid()}/socket"


def hello_line(label: Optional[str]) -> bytes:
    """``HELLO 1 [label]``, the label cut to what the broker accepts:
    printable, at most MAX_LABEL bytes."""
    if not label:
        return b"HELLO %d\n" % VERSION
    text = "".join(c for c in label if c.isprintable())
    raw = text.encode()[:MAX_LABEL].decode(errors="ignore").encode()
    return b"HELLO %d %s\n" % (VERSION, raw) if raw else b"HELLO %d\n" % VERSION


def request_line(verb: str, n: Optional[int] = None) -> bytes:
    return f"{verb}\n".encode() if n is None else f"{verb} {n}\n".encode()


class Reply(NamedTuple):
    """One decoded reply: its first word, its numbers, and for ``ERR`` the
    code and message; for ``STATUS`` the JSON body."""

    kind: str
    numbers: tuple
    code: str = ""
    message: str = ""
    body: str = ""


_ARITY = {"OK": 3, "GRANTED": 2, "BUSY": 1, "RELEASED": 2, "CANCELLED": 1, "STATUS": 1, "LIMIT": 2}


def expect(reply: Reply, *kinds: str) -> Reply:
    """The reply if it is one of `kinds`; a refusal or anything else raises."""
    if reply.kind == "ERR":
        raise RefusedError(reply.code, reply.message)
    if reply.kind not in kinds:
        raise BatonError(f"baton: unexpected reply from the broker: {reply}")
    return reply


def parse_reply(line: bytes) -> Reply:
    """Decodes one reply line (without its newline)."""
    text = line.decode("utf-8", errors="replace")
    kind, _, rest = text.partition(" ")
    if kind == "ERR":
        code, _, message = rest.partition(" ")
        return Reply(kind, (), code, message)
    words = rest.split(" ") if rest else []
    if kind not in _ARITY or len(words) != _ARITY[kind] or not all(w.isdigit() for w in words):
        raise BatonError(f"baton: unexpected reply from the broker: {text!r}")
    return Reply(kind, tuple(int(w) for w in words))


class Connection:
    """A blocking connection to the broker; every read takes a deadline
    (time.monotonic() seconds, or None to wait as long as it takes)."""

    def __init__(self, path: str) -> None:
        self.path = path
        check_directory(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.connect(path)
            check_peer(self.sock, path)
        except (FileNotFoundError, ConnectionRefusedError) as e:
            self.sock.close()
            raise NoBrokerError(f"baton: no broker at {path} (start one with: baton serve --jobs N)") from e
        except PermissionError as e:
            self.sock.close()
            raise BatonError(f"baton: permission denied connecting to {path} (the broker belongs to another user? its owner admits others with baton serve --allow-uid UID or --allow-group GROUP)") from e
        except (OSError, NotOurBrokerError):
            self.sock.close()
            raise
        self.buf = bytearray()

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError) as e:
            raise DisconnectedError("baton: the broker closed the connection") from e

    def read_line(self, deadline: Optional[float]) -> bytes:
        """The next line, newline included; b"" at end of file.
        TimeoutError when the deadline passes first."""
        while b"\n" not in self.buf:
            if not self._fill(deadline):
                return b""
        end = self.buf.index(b"\n") + 1
        line = bytes(self.buf[:end])
        del self.buf[:end]
        return line

    def read_exact(self, n: int, deadline: Optional[float]) -> bytes:
        while len(self.buf) < n:
            if not self._fill(deadline):
                raise DisconnectedError("baton: the broker closed the connection mid-reply")
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data

    def read_reply(self, deadline: Optional[float]) -> Reply:
        """The next reply, decoded; the STATUS body read with it."""
        line = self.read_line(deadline)
        if not line.endswith(b"\n"):
            raise DisconnectedError("baton: the broker closed the connection")
        reply = parse_reply(line[:-1])
        if reply.kind == "STATUS":
            body = self.read_exact(reply.numbers[0] + 1, deadline)
            if not body.endswith(b"\n"):
                raise BatonError("baton: status body not followed by a newline")
            reply = reply._replace(body=body[:-1].decode())
        return reply

    def _fill(self, deadline: Optional[float]) -> bool:
        """Reads what has arrived, waiting until the deadline; False at
        end of file."""
        if not wait_readable(self.sock.fileno(), deadline):
            raise TimeoutError("baton: deadline passed waiting for the broker")
        try:
            chunk = self.sock.recv(65536)
        except ConnectionResetError:
            chunk = b""
        self.buf += chunk
        return bool(chunk)


def wait_readable(fd: int, deadline: Optional[float]) -> bool:
    """Waits in poll() until fd is readable; False if the deadline passes."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while True:
        if deadline is None:
            wait_ms = None
        else:
            wait_ms = max(0, int((deadline - time.monotonic()) * 1000 + 0.999))
        if poller.poll(wait_ms):
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False


def deadline_after(timeout: Optional[float]) -> Optional[float]:
    return None if timeout is None else time.monotonic() + timeout
