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
import fcntl
import os
import stat
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


def check_pipe(read_fd: int, write_fd: int) -> None:
    """OSError unless R and W are the two ends of one pipe, R open for
    reading and W for writing. make passes its pipe only to a recipe line
    with '+' (make 4.3); elsewhere MAKEFLAGS still names the numbers, and
    by the time we look they may be another file's: pytest's capture dups
    stdout and stderr into the lowest free descriptors. A token read from
    such a file would be a byte of it, or its end."""
    r, w = os.fstat(read_fd), os.fstat(write_fd)
    readable = fcntl.fcntl(read_fd, fcntl.F_GETFL) & os.O_ACCMODE in (os.O_RDONLY, os.O_RDWR)
    writable = fcntl.fcntl(write_fd, fcntl.F_GETFL) & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)
    if not (stat.S_ISFIFO(r.st_mode) and (r.st_dev, r.st_ino) == (w.st_dev, w.st_ino) and readable and writable):
        raise OSError(
            errno.EBADF,
            f"descriptors {read_fd},{write_fd} are not a jobserver's pipe here "
            "(make passes its pipe only to a recipe line with '+' in front)",
        )


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
            check_pipe(read_fd, write_fd)
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
