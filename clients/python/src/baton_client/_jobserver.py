"""The fallback: a GNU make jobserver named in MAKEFLAGS.

GNU make documents the protocol ("POSIX Jobserver Interaction" in its
manual): `--jobserver-auth=fifo:PATH` (make 4.4 and later) names a FIFO,
`--jobserver-auth=R,W` (older: `--jobserver-fds=R,W`) two inherited file
descriptors of a pipe, and negative numbers mean no jobserver. A token is one
byte read from it; the same byte goes back when the job ends. The last such
option in MAKEFLAGS wins.
"""

from __future__ import annotations

import errno
import os
from typing import Optional

from ._wire import BatonError, wait_readable


def auth_from_makeflags(makeflags: Optional[str]) -> Optional[str]:
    """The value of the last ``--jobserver-auth=`` or ``--jobserver-fds=``
    option in MAKEFLAGS, or None."""
    auth = None
    for word in (makeflags or "").split():
        for option in ("--jobserver-auth=", "--jobserver-fds="):
            if word.startswith(option):
                auth = word[len(option):]
    return auth


class Jobserver:
    """Non-blocking file descriptors of our own on the jobserver, so that
    waiting never blocks in read() on a byte another process took first,
    and make's own descriptors keep their flags."""

    def __init__(self, auth: str) -> None:
        self.auth = auth
        if auth.startswith("fifo:"):
            fd = os.open(auth[len("fifo:"):], os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
            self.read_fd, self.write_fd = fd, fd
        else:
            read_fd, write_fd = (int(x) for x in auth.split(","))
            if read_fd < 0 or write_fd < 0:
                raise BatonError("baton: the jobserver in MAKEFLAGS is disabled")
            os.fstat(write_fd)  # OSError if make did not pass it to us (no '+' on the recipe line)
            # A new open file description of the same pipe, non-blocking
            # without changing make's own.
            self.read_fd = os.open(f"/proc/self/fd/{read_fd}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            self.write_fd = write_fd

    def take(self, n: int, deadline: Optional[float]) -> Optional[bytes]:
        """n bytes, waiting until the deadline (None: forever; a deadline
        already passed: only what is free now). All or nothing: if the
        deadline passes first, the bytes taken so far go back and None
        comes back."""
        got = b""
        try:
            while len(got) < n:
                byte = self._read_one()
                if byte:
                    got += byte
                elif not wait_readable(self.read_fd, deadline):
                    self.give(got)
                    return None
        except BaseException:
            self.give(got)
            raise
        return got

    def take_now(self, n: int) -> Optional[bytes]:
        got = b""
        while len(got) < n:
            byte = self._read_one()
            if not byte:
                self.give(got)
                return None
            got += byte
        return got

    def give(self, tokens: bytes) -> None:
        if tokens:
            os.write(self.write_fd, tokens)

    def _read_one(self) -> bytes:
        try:
            byte = os.read(self.read_fd, 1)
        except BlockingIOError:
            return b""
        except OSError as e:
            if e.errno == errno.EINTR:
                return b""
            raise
        if not byte:
            raise BatonError("baton: the jobserver in MAKEFLAGS has no writers left (did make exit?)")
        return byte

    def close(self) -> None:
        # Only our own descriptor: the write end of a pipe is make's.
        os.close(self.read_fd)


def from_environment() -> Optional[Jobserver]:
    """The jobserver MAKEFLAGS names, if any and if it can be opened."""
    auth = auth_from_makeflags(os.environ.get("MAKEFLAGS"))
    if auth is None:
        return None
    try:
        return Jobserver(auth)
    except (OSError, ValueError, BatonError):
        return None
