"""The blocking client and its tokens."""

from __future__ import annotations

import json
import threading
import warnings
from typing import Any, Optional

from . import _jobserver
from ._wire import (
    expect,
    BatonError,
    Connection,
    DisconnectedError,
    NoBrokerError,
    RefusedError,
    Reply,
    deadline_after,
    hello_line,
    refused_at_connect,
    request_line,
    socket_path,
)

NOT_A_BROKER = "baton: status needs the broker; this client takes its tokens from the jobserver in MAKEFLAGS"


class Token:
    """``n`` tokens, given back by :meth:`release`, at the end of a ``with``
    block, or (with a ResourceWarning) when garbage collected."""

    def __init__(self, owner: Any, n: int, data: bytes = b"") -> None:
        self._owner = owner
        self.n = n
        self._data = data  # the bytes read from a jobserver, to write back
        self.released = False

    def release(self) -> None:
        """Gives the tokens back now. Releasing twice does nothing."""
        if not self.released:
            self.released = True
            self._owner._give_back(self.n, self._data)

    def __enter__(self) -> "Token":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        if not getattr(self, "released", True):
            self.released = True
            warnings.warn(f"baton: {self.n} token(s) never released; giving them back now", ResourceWarning, stacklevel=2)
            self._owner._give_back_later(self.n, self._data)

    def __repr__(self) -> str:
        return f"<baton_client.Token n={self.n}{' released' if self.released else ''}>"


class Client:
    """A connection to the baton broker (``socket``: else ``$BATON_SOCKET``,
    ``$XDG_RUNTIME_DIR/baton/socket``, ``/tmp/baton-$UID/socket``). When no
    broker is reachable at the default path and MAKEFLAGS names a GNU make
    jobserver, the same methods take tokens from that jobserver instead.

    One client serves one thread at a time (calls are serialized; a waiting
    acquire holds the client): give each thread its own client.
    """

    def __init__(self, socket: Optional[str] = None, label: Optional[str] = None) -> None:
        self._lock = threading.Lock()
        self._unreleased = 0  # tokens of tokens collected while a call ran
        self._conn: Optional[Connection] = None
        self._jobserver: Optional[_jobserver.Jobserver] = None
        self.limit: Optional[int] = None
        try:
            self._conn = Connection(socket_path(socket))
        except NoBrokerError:
            self._jobserver = _jobserver.from_environment() if socket is None else None
            if self._jobserver is None:
                raise
            return
        try:
            hello = self._call(hello_line(label), "OK")
        except RefusedError as e:
            self._conn.close()
            raise refused_at_connect(self._conn.path, e) from None
        except BaseException:
            self._conn.close()
            raise
        self.limit = hello.numbers[2]

    @property
    def source(self) -> str:
        """``"broker"`` or ``"jobserver"``: where tokens come from."""
        return "broker" if self._conn else "jobserver"

    def acquire(self, n: int = 1, timeout: Optional[float] = None) -> Token:
        """Waits until ``n`` tokens are ours; TimeoutError (with nothing
        taken) if ``timeout`` seconds pass first."""
        deadline = deadline_after(timeout)
        with self._lock:
            if self._jobserver:
                data = self._jobserver.take(n, deadline)
                if data is None:
                    raise TimeoutError(f"baton: no {n} token(s) within {timeout} s")
                return Token(self, n, data)
            self._flush()
            self._send(request_line("ACQUIRE", n))
            if not self._wait_for_grant(n, deadline):
                raise TimeoutError(f"baton: no {n} token(s) within {timeout} s")
            return Token(self, n)

    def try_acquire(self, n: int = 1) -> Optional[Token]:
        """``n`` tokens if they are free now (and nobody waits), else None."""
        with self._lock:
            if self._jobserver:
                data = self._jobserver.take_now(n)
                return None if data is None else Token(self, n, data)
            self._flush()
            reply = self._call(request_line("TRY", n), "GRANTED", "BUSY")
            return Token(self, n) if reply.kind == "GRANTED" else None

    def release(self, token: Token) -> None:
        """Gives ``token`` back (the same as ``token.release()``)."""
        token.release()

    def status(self) -> dict:
        """The broker's state, the document ``baton status --json`` prints."""
        with self._lock:
            if self._conn is None:
                raise BatonError(NOT_A_BROKER)
            self._flush()
            return json.loads(self._call(request_line("STATUS"), "STATUS").body)

    def close(self) -> None:
        """Closes the connection; the broker takes back whatever it held."""
        if self._conn:
            self._conn.close()
        if self._jobserver:
            self._jobserver.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _give_back(self, n: int, data: bytes) -> None:
        if self._jobserver:
            self._jobserver.give(data)
            return
        with self._lock:
            self._flush()
            self._call(request_line("RELEASE", n), "RELEASED")

    def _give_back_later(self, n: int, data: bytes) -> None:
        """From a finalizer, which may run in the middle of one of our own
        calls: release now if the connection is free, else with the next
        call."""
        if self._jobserver:
            self._jobserver.give(data)
        elif self._lock.acquire(blocking=False):
            try:
                self._call(request_line("RELEASE", n), "RELEASED")
            except (OSError, BatonError):
                pass  # a broken connection: the broker has them back already
            finally:
                self._lock.release()
        else:
            self._unreleased += n

    def _flush(self) -> None:
        if self._unreleased:
            n, self._unreleased = self._unreleased, 0
            self._call(request_line("RELEASE", n), "RELEASED")

    def _wait_for_grant(self, n: int, deadline: Optional[float]) -> bool:
        """After ACQUIRE: True once granted; False if the deadline passed
        and the request was withdrawn. Interrupted (KeyboardInterrupt, say),
        it withdraws the request and gives back a grant that won the race."""
        assert self._conn
        try:
            expect(self._conn.read_reply(deadline), "GRANTED")
            return True
        except TimeoutError:
            return self._withdraw()
        except BaseException:
            if self._withdraw():
                self._call(request_line("RELEASE", n), "RELEASED")
            raise

    def _withdraw(self) -> bool:
        """CANCEL; True if the grant won the race and the tokens are ours."""
        assert self._conn
        self._send(request_line("CANCEL"))
        reply = self._conn.read_reply(None)
        if reply.kind == "GRANTED":
            expect(self._conn.read_reply(None), "CANCELLED")
            return True
        expect(reply, "CANCELLED")
        return False

    def _send(self, line: bytes) -> None:
        assert self._conn
        self._conn.send(line)

    def _call(self, line: bytes, *kinds: str) -> Reply:
        assert self._conn
        try:
            self._conn.send(line)
        except DisconnectedError:
            pass  # a broker that turned us away (ERR full) may have closed first: its reply is still there to read
        return expect(self._conn.read_reply(None), *kinds)

