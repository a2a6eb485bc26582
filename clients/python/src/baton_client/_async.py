"""The asyncio client: the same methods as Client, as coroutines."""

from __future__ import annotations

import asyncio
import json
import warnings
from typing import Any, Generator, Optional

from . import _jobserver
from ._client import NOT_A_BROKER
from ._wire import (
    expect,
    BatonError,
    DisconnectedError,
    NoBrokerError,
    RefusedError,
    Reply,
    deadline_after,
    check_directory,
    check_peer,
    hello_line,
    parse_reply,
    refused_at_connect,
    request_line,
    socket_path,
)


class AsyncToken:
    """``n`` tokens, given back by ``await release()``, at the end of an
    ``async with`` block, or (with a ResourceWarning) by the client's next
    call after it is garbage collected."""

    def __init__(self, owner: "AsyncClient", n: int, data: bytes = b"") -> None:
        self._owner = owner
        self.n = n
        self._data = data
        self.released = False

    async def release(self) -> None:
        if not self.released:
            self.released = True
            await self._owner._give_back(self.n, self._data)

    async def __aenter__(self) -> "AsyncToken":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()

    def __del__(self) -> None:
        if not getattr(self, "released", True):
            self.released = True
            warnings.warn(f"baton: {self.n} token(s) never released; giving them back", ResourceWarning, stacklevel=2)
            self._owner._give_back_later(self.n, self._data)


class _Acquiring:
    """What acquire() returns: await it for the token, or use it directly
    in ``async with client.acquire():``."""

    def __init__(self, coro: Any) -> None:
        self._coro = coro
        self._token: Optional[AsyncToken] = None

    def __await__(self) -> Generator[Any, None, AsyncToken]:
        return self._coro.__await__()

    async def __aenter__(self) -> AsyncToken:
        self._token = await self._coro
        return self._token

    async def __aexit__(self, *exc: object) -> None:
        assert self._token
        await self._token.release()


class AsyncClient:
    """Client for asyncio. Connects on first use (or ``await connect()``,
    or ``async with AsyncClient() as client``). Cancelling a task waiting
    in acquire withdraws its request (CANCEL) and keeps nothing: a grant
    that won the race is given straight back.

    Calls on one client run one at a time; a waiting acquire holds the
    client, so give each concurrent waiter its own client.
    """

    def __init__(self, socket: Optional[str] = None, label: Optional[str] = None) -> None:
        self._socket = socket
        self._label = label
        self._lock = asyncio.Lock()
        self._unreleased = 0
        self._reader: Optional[asyncio.StreamReader] = None
        self._writer: Optional[asyncio.StreamWriter] = None
        self._jobserver: Optional[_jobserver.Jobserver] = None
        self.limit: Optional[int] = None

    @property
    def source(self) -> str:
        return "jobserver" if self._jobserver else "broker"

    async def connect(self) -> "AsyncClient":
        async with self._lock:
            await self._connect()
        return self

    async def __aenter__(self) -> "AsyncClient":
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def acquire(self, n: int = 1, timeout: Optional[float] = None) -> _Acquiring:
        """Waits until ``n`` tokens are ours; TimeoutError (with nothing
        taken) if ``timeout`` seconds pass first."""
        return _Acquiring(self._acquire(n, timeout))

    async def try_acquire(self, n: int = 1) -> Optional[AsyncToken]:
        async with self._lock:
            await self._connect()
            if self._jobserver:
                data = self._jobserver.take_now(n)
                return None if data is None else AsyncToken(self, n, data)
            reply = await self._call(request_line("TRY", n), "GRANTED", "BUSY")
            return AsyncToken(self, n) if reply.kind == "GRANTED" else None

    async def release(self, token: AsyncToken) -> None:
        await token.release()

    async def status(self) -> dict:
        async with self._lock:
            await self._connect()
            if self._jobserver:
                raise BatonError(NOT_A_BROKER)
            return json.loads((await self._call(request_line("STATUS"), "STATUS")).body)

    async def close(self) -> None:
        if self._writer:
            self._writer.close()
            await self._writer.wait_closed()
            self._writer = None
        if self._jobserver:
            self._jobserver.close()
            self._jobserver = None

    async def _connect(self) -> None:
        if self._writer or self._jobserver:
            await self._flush()
            return
        path = socket_path(self._socket)
        check_directory(path)
        try:
            self._reader, self._writer = await asyncio.open_unix_connection(path)
        except (FileNotFoundError, ConnectionRefusedError) as e:
            self._jobserver = _jobserver.from_environment() if self._socket is None else None
            if self._jobserver is None:
                raise NoBrokerError(f"baton: no broker at {path} (start one with: baton serve --jobs N)") from e
            return
        try:
            check_peer(self._writer.get_extra_info("socket"), path)
            self.limit = (await self._call(hello_line(self._label), "OK")).numbers[2]
        except RefusedError as e:
            await self.close()
            raise refused_at_connect(path, e) from None
        except BaseException:
            await self.close()
            raise

    async def _acquire(self, n: int, timeout: Optional[float]) -> AsyncToken:
        async with self._lock:
            await self._connect()
            if self._jobserver:
                return AsyncToken(self, n, await self._take_from_jobserver(n, timeout))
            await self._send(request_line("ACQUIRE", n))
            if not await self._wait_for_grant(n, timeout):
                raise TimeoutError(f"baton: no {n} token(s) within {timeout} s")
            return AsyncToken(self, n)

    async def _wait_for_grant(self, n: int, timeout: Optional[float]) -> bool:
        # The read runs as a task of its own, so that a timeout or a
        # cancellation can tell whether the GRANTED line was already read
        # (asyncio.wait_for may drop a result that races its timeout).
        read = asyncio.ensure_future(self._read_reply())
        try:
            await asyncio.wait({read}, timeout=timeout)
        except asyncio.CancelledError:
            if await self._stop(read) or await self._withdraw():
                await self._call(request_line("RELEASE", n), "RELEASED")
            raise
        if not read.done() and not await self._stop(read):
            return await self._withdraw()
        expect(read.result(), "GRANTED")
        return True

    @staticmethod
    async def _stop(read: "asyncio.Future[Reply]") -> bool:
        """Stops a pending read; True if it had read GRANTED meanwhile."""
        read.cancel()
        try:
            reply = await read
        except asyncio.CancelledError:
            return False
        expect(reply, "GRANTED")
        return True

    async def _withdraw(self) -> bool:
        """CANCEL; True if the grant won the race and the tokens are ours."""
        await self._send(request_line("CANCEL"))
        reply = await self._read_reply()
        if reply.kind == "GRANTED":
            expect(await self._read_reply(), "CANCELLED")
            return True
        expect(reply, "CANCELLED")
        return False

    async def _take_from_jobserver(self, n: int, timeout: Optional[float]) -> bytes:
        assert self._jobserver
        js, deadline, got = self._jobserver, deadline_after(timeout), b""
        loop = asyncio.get_running_loop()
        try:
            while len(got) < n:
                more = js.take_now(1)
                if more:
                    got += more
                    continue
                readable = loop.create_future()
                loop.add_reader(js.read_fd, lambda: readable.done() or readable.set_result(None))
                try:
                    remaining = None if deadline is None else max(0.0, deadline - loop.time())
                    await asyncio.wait_for(readable, remaining)
                finally:
                    loop.remove_reader(js.read_fd)
        except asyncio.TimeoutError:
            js.give(got)
            raise TimeoutError(f"baton: no {n} token(s) within {timeout} s") from None
        except BaseException:
            js.give(got)
            raise
        return got

    async def _give_back(self, n: int, data: bytes) -> None:
        if self._jobserver:
            self._jobserver.give(data)
            return
        async with self._lock:
            await self._flush()
            await self._call(request_line("RELEASE", n), "RELEASED")

    def _give_back_later(self, n: int, data: bytes) -> None:
        """From a finalizer: a coroutine cannot run here, so the release
        goes out with the client's next call (or closing the client)."""
        if self._jobserver:
            self._jobserver.give(data)
        else:
            self._unreleased += n

    async def _flush(self) -> None:
        if self._unreleased:
            n, self._unreleased = self._unreleased, 0
            await self._call(request_line("RELEASE", n), "RELEASED")

    async def _send(self, line: bytes) -> None:
        assert self._writer
        self._writer.write(line)
        await self._writer.drain()

    async def _read_reply(self) -> Reply:
        assert self._reader
        line = await self._reader.readline()
        if not line.endswith(b"\n"):
            raise DisconnectedError("baton: the broker closed the connection")
        reply = parse_reply(line[:-1])
        if reply.kind == "STATUS":
            body = await self._reader.readexactly(reply.numbers[0] + 1)
            reply = reply._replace(body=body[:-1].decode())
        return reply

    async def _call(self, line: bytes, *kinds: str) -> Reply:
        try:
            await self._send(line)
        except (BrokenPipeError, ConnectionResetError):
            pass  # a broker that turned us away (ERR full) may have closed first: its reply is still there to read
        return expect(await self._read_reply(), *kinds)

