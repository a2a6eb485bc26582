"""The shared-memory fast path, through libbaton (clients/c) and ctypes.

The fast path (docs/fastpath.md of the baton project) passes single tokens
between the processes of one build with 64-bit compare-and-swaps on memory
the broker shares with them, and a futex to wake a waiter. Pure Python has
no compare-and-swap on shared memory, so this module does not touch the
region itself: it binds the C library, which implements it
(``baton_fastpath()`` in baton.h), and wraps one of its connections.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import json
import os
import re
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional

from ._wire import BatonError, DisconnectedError, NoBrokerError, NotOurBrokerError, RefusedError

# How to get the library, for the error that says it is missing.
BUILD_HINT = (
    "build and install it from a baton clone with: make -C clients/c install PREFIX=$HOME/.local, "
    "then name it with BATON_LIBRARY=$HOME/.local/lib/libbaton.so.0 (or library=...), "
    "or install it where the dynamic linker looks (PREFIX=/usr, or ldconfig)"
)


class NoLibraryError(BatonError, OSError):
    """libbaton, which the fast path needs, could not be found or loaded."""


class Timespec(ctypes.Structure):
    """``struct timespec``: time_t and long are both a C long on Linux
    (glibc's 64-bit time_t on 32-bit machines aside)."""

    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


# Incremented in the child of every os.fork(): a client remembers the value
# it was made under, and refuses to be used (or closed) in a child (see
# FastClient's docstring).
_forks = 0


def _forked() -> None:
    global _forks
    _forks += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Every function's argument and result types, as baton.h has them:
    without them ctypes would pass and return C ints, and cut pointers."""
    p, uint, ts = ctypes.c_void_p, ctypes.c_uint, ctypes.POINTER(Timespec)
    signatures = {
        "baton_socket_path": ([ctypes.c_char_p, ctypes.c_size_t], ctypes.c_int),
        "baton_connect": ([ctypes.c_char_p, ctypes.c_char_p, ts], p),
        "baton_acquire": ([p, uint, ts], ctypes.c_int),
        "baton_try_acquire": ([p, uint, ts], ctypes.c_int),
        "baton_release": ([p, uint, ts], ctypes.c_int),
        # A pointer, not c_char_p: ctypes would copy a c_char_p into bytes
        # and lose the address that must be given back to free().
        "baton_status_json": ([p, ts], p),
        "baton_held": ([p], uint),
        "baton_limit": ([p], uint),
        "baton_refusal": ([p], ctypes.c_char_p),
        "baton_errmsg": ([], ctypes.c_char_p),
        "baton_fastpath": ([p], ctypes.c_int),
        "baton_fastpath_pile": ([p], ctypes.c_int),
        "baton_uses_fastpath": ([p], ctypes.c_int),
        "baton_close": ([p], None),
    }
    for name, (args, result) in signatures.items():
        function = getattr(lib, name)
        function.argtypes = args
        function.restype = result
    return lib


@functools.lru_cache(maxsize=None)
def _libc_free() -> Any:
    """libc's free(), for baton_status_json()'s document: the library
    allocates it with malloc(), in this process's one libc (CDLL(None):
    the symbols the process has loaded)."""
    free = ctypes.CDLL(None).free
    free.argtypes = [ctypes.c_void_p]
    free.restype = None
    return free


_loaded: dict = {}
_loading = threading.Lock()


def library_path(library: Optional[str] = None) -> str:
    """Which libbaton to load: ``library``, else $BATON_LIBRARY, else the
    one the dynamic linker finds (``ctypes.util.find_library("baton")``)."""
    found = library or os.environ.get("BATON_LIBRARY") or ctypes.util.find_library("baton")
    if not found:
        raise NoLibraryError(f"baton: libbaton not found (no library=, no BATON_LIBRARY, and the dynamic linker knows none): {BUILD_HINT}")
    return found


def load(library: Optional[str] = None) -> ctypes.CDLL:
    """libbaton, loaded once per path, its functions declared."""
    path = library_path(library)
    with _loading:
        if path not in _loaded:
            try:
                # use_errno: ctypes keeps each call's errno for get_errno().
                lib = ctypes.CDLL(path, use_errno=True)
            except OSError as e:
                raise NoLibraryError(f"baton: cannot load libbaton from {path} ({e}): {BUILD_HINT}") from None
            try:
                _loaded[path] = _declare(lib)
            except AttributeError as e:
                raise NoLibraryError(f"baton: {path} is not a libbaton with the fast path ({e}): {BUILD_HINT}") from None
        return _loaded[path]


def deadline(timeout: Optional[float]) -> Optional[Timespec]:
    """``timeout`` seconds from now, on CLOCK_MONOTONIC as baton.h wants;
    None (a NULL deadline: wait as long as it takes) for None."""
    if timeout is None:
        return None
    at = time.clock_gettime_ns(time.CLOCK_MONOTONIC) + max(0, int(timeout * 1_000_000_000))
    return Timespec(at // 1_000_000_000, at % 1_000_000_000)


def _by_ref(when: Optional[Timespec]) -> Any:
    return None if when is None else ctypes.byref(when)


# baton.h: a refusal reads "broker refused: <its words> (<code>)".
_REFUSED = re.compile(r"broker refused: (?P<message>.*) \((?P<code>[a-z-]+)\)", re.S)


def error(code: int, words: str, at_connect: bool = False) -> Exception:
    """The exception for a failed call: its errno (``code``) and what
    baton_errmsg() said (``words``), in the classes the socket client
    raises, with ``errno`` set for programs that look at it."""
    text = f"baton: {words}"
    refused = _REFUSED.fullmatch(words)
    if code == errno.ETIMEDOUT:
        e: Exception = TimeoutError(text)
    elif code in (errno.ENOENT, errno.ECONNREFUSED) and at_connect:
        e = NoBrokerError(text)
    elif code == errno.EPERM and at_connect:
        e = NotOurBrokerError(text)
    elif code == errno.ECONNRESET:
        e = DisconnectedError(text)
    elif refused:
        e = RefusedError(refused["code"], refused["message"])
    elif at_connect and code == errno.EUSERS:
        e = _worded_refusal("full", words, text)
    elif at_connect and code == errno.EACCES and "refuses you: " in words:
        e = _worded_refusal("denied", words.split("refuses you: ", 1)[1], text)
    else:
        e = BatonError(text)
    e.errno = code  # type: ignore[attr-defined]
    return e


def _worded_refusal(code: str, message: str, text: str) -> RefusedError:
    """A refusal at connect (ERR full, ERR denied), in the library's words
    that name the socket, as the socket client's refused_at_connect has
    them."""
    e = RefusedError(code, message)
    e.args = (text,)
    return e


class FastClient:
    """A libbaton connection to the broker that may take a seat in the
    shared-memory fast path: after :meth:`enable_fastpath`, ``acquire(1)``,
    ``try_acquire(1)`` and ``release`` take and give single tokens in memory
    the broker shares with the build's other fast-path clients, with no
    round trip to the broker. Everything else (n > 1, status) and whatever
    the region refuses goes over the socket. Tokens taken either way are
    the connection's: the broker takes them back when the process dies,
    even by SIGKILL.

    It needs libbaton (``library=``, else $BATON_LIBRARY, else the dynamic
    linker's) and a broker of its own uid (another user's process never
    shares the broker's memory: the seat is refused, and the client goes on
    over the socket). There is no jobserver fallback: use :class:`Client`
    for that.

    One thread at a time: calls (properties and close() too) are
    serialized, and a waiting acquire holds the client (baton.h: a
    connection is one thread's at a time): give each thread its own. A
    wait in the library is not interrupted by a signal (it waits again
    after EINTR): Ctrl-C raises KeyboardInterrupt once the call returns,
    so give long waits a timeout.

    Fork: baton.h says the child of a fork() must not use a connection that
    has a seat, not even baton_close(): the region is not mapped in the
    child (the library maps it MADV_DONTFORK) and the socket is its
    parent's; exec or _exit drops it. So in a child of ``os.fork()`` (or a
    ``multiprocessing`` fork) every call raises BatonError and ``close()``
    only forgets the connection: connect a new client there. The child
    still holds a copy of the socket until it execs or exits (the library
    opens it close-on-exec), and the broker takes the parent's tokens back
    when both have closed it.
    """

    def __init__(self, handle: int, lib: ctypes.CDLL, socket: str) -> None:
        """Use :meth:`connect`."""
        self._handle: Optional[int] = handle
        self._lib = lib
        self._free = _libc_free()
        self._lock = threading.Lock()
        self._made_in = _forks
        self.socket = socket
        self.fastpath_refusal = ""

    @classmethod
    def connect(
        cls, socket: Optional[str] = None, label: Optional[str] = None, library: Optional[str] = None, timeout: Optional[float] = None
    ) -> "FastClient":
        """Connects to the broker at ``socket`` (None: as the C library's
        baton_socket_path(): $BATON_SOCKET, $XDG_RUNTIME_DIR/baton/socket,
        /tmp/baton-$UID/socket) and says HELLO with ``label``."""
        lib = load(library)
        path = socket or _default_socket(lib)
        handle = lib.baton_connect(os.fsencode(path), label.encode() if label else None, _by_ref(deadline(timeout)))
        if not handle:
            raise error(ctypes.get_errno(), _errmsg(lib), at_connect=True)
        return cls(handle, lib, path)

    def enable_fastpath(self, pile: bool = False) -> bool:
        """Asks for a seat in the fast path of this connection's build.
        True when seated (or already). False when the broker offers none
        (another user's process, a full or closed region, a build whose
        first fast-path client chose the other layout): its words are in
        :attr:`fastpath_refusal`, and the client goes on over the socket. A
        broken connection, or a broker too old for the fast path, raises.

        ``pile=True`` asks for a pile (docs/fastpath.md, "The pile"): a
        freed token goes to whoever comes for it first, as with a
        semaphore, not to the oldest waiter; a waiter can be passed over
        while others keep coming back, and a process that gives a token
        back and takes one again wakes nobody."""
        ask = self._lib.baton_fastpath_pile if pile else self._lib.baton_fastpath
        with self._lock:
            handle = self._live()
            if ask(handle) == 0:
                return True
            code = ctypes.get_errno()
            words = _errmsg(self._lib)
            if code != errno.ENOTSUP:
                raise error(code, words)
            self.fastpath_refusal = words
            return False

    @property
    def uses_fastpath(self) -> bool:
        """Whether the connection has a seat it still uses (False if none
        was asked for, it was refused, or given up after the broker revoked
        it or died)."""
        return bool(self._read("baton_uses_fastpath"))

    def acquire(self, n: int = 1, timeout: Optional[float] = None) -> None:
        """Waits until ``n`` more tokens are ours; TimeoutError (with
        nothing taken) if ``timeout`` seconds pass first."""
        when = deadline(timeout)
        self._call("baton_acquire", _count(n), _by_ref(when))

    def try_acquire(self, n: int = 1) -> bool:
        """Takes ``n`` tokens if they are free now (and nobody waits)."""
        return self._call("baton_try_acquire", _count(n), None) == 1

    def release(self, n: int = 1) -> None:
        """Gives ``n`` tokens back. More than we hold raises RefusedError
        (``over-release``) and gives back nothing."""
        self._call("baton_release", _count(n), None)

    @contextmanager
    def token(self, n: int = 1, timeout: Optional[float] = None) -> Iterator[None]:
        """``with client.token(): run_one_job()``: ``n`` tokens for the
        block, given back at its end however it ends."""
        self.acquire(n, timeout)
        try:
            yield
        finally:
            self.release(n)

    @property
    def held(self) -> int:
        """Tokens this connection holds now, through the fast path too."""
        return int(self._read("baton_held"))

    @property
    def limit(self) -> int:
        """The pool's limit when the connection was made."""
        return int(self._read("baton_limit"))

    @property
    def refusal(self) -> str:
        """The broker's words for the last request it refused ("" if none)."""
        return self._read("baton_refusal").decode(errors="replace")

    def status(self, timeout: Optional[float] = None) -> dict:
        """The broker's state, the document ``baton status --json`` prints."""
        with self._lock:
            handle = self._live()
            document = self._lib.baton_status_json(handle, _by_ref(deadline(timeout)))
            if not document:
                raise error(ctypes.get_errno(), _errmsg(self._lib))
            try:
                text = ctypes.string_at(document)
            finally:
                self._free(document)  # baton.h: the caller free()s it
        return json.loads(text)

    def close(self) -> None:
        """Closes the connection; the broker takes back whatever it held.
        Closing twice does nothing; in a forked child it only forgets it."""
        with self._lock:
            handle, self._handle = self._handle, None
            if handle and self._made_in == _forks:
                self._lib.baton_close(handle)

    def __enter__(self) -> "FastClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Not under the lock: nothing else can hold a client being collected.
        handle, self._handle = getattr(self, "_handle", None), None
        if handle and getattr(self, "_made_in", None) == _forks:
            self._lib.baton_close(handle)

    def __repr__(self) -> str:
        # No call into the library: a repr must not wait for another thread's acquire.
        return f"<baton_client.FastClient {self.socket}{' closed' if self._handle is None else ''}>"

    def _live(self) -> int:
        """The C connection, if this process may use it."""
        if self._handle is None:
            raise BatonError("baton: the client is closed")
        if self._made_in != _forks:
            raise BatonError("baton: this FastClient was made before a fork(); the child must connect its own (baton.h)")
        return self._handle

    def _read(self, name: str) -> Any:
        """An accessor, under the lock too: close() in another thread must
        not free the connection while it is read."""
        with self._lock:
            return getattr(self._lib, name)(self._live())

    def _call(self, name: str, n: int, when: Any) -> int:
        """A call that returns -1 and sets errno on failure."""
        with self._lock:
            done = getattr(self._lib, name)(self._live(), n, when)
            if done < 0:
                raise error(ctypes.get_errno(), _errmsg(self._lib))
            return done


def _count(n: int) -> int:
    """A token count as C's unsigned: ctypes would wrap a negative one."""
    if not 0 <= n <= 0xFFFFFFFF:
        raise ValueError(f"baton: {n} tokens: a count is 0 to 4294967295")
    return n


def _errmsg(lib: ctypes.CDLL) -> str:
    """baton_errmsg(), read at once: the next failure in this thread
    overwrites it."""
    return lib.baton_errmsg().decode(errors="replace")


def _default_socket(lib: ctypes.CDLL) -> str:
    """baton_socket_path(): the path baton_connect(NULL, ...) would use."""
    buf = ctypes.create_string_buffer(4096)
    if lib.baton_socket_path(buf, len(buf)) < 0:
        raise error(ctypes.get_errno(), _errmsg(lib), at_connect=True)
    return os.fsdecode(buf.value)
