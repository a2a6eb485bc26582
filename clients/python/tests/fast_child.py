"""A client process of test_fast.py, through FastClient and the fast path:

    fast_child.py jobs LIBRARY SOCKET LOCKFILE INDEX JOBS LIMIT ROUNDS
        says `seated`, waits for a line on stdin, then runs
        ROUNDS jobs one token at a time, each counted with the others from
        POSIX record locks (as crates/baton-broker/tests/fastpath_served.rs
        counts them); exit 3 with the file LOCKFILE.over if more ran at once
        than LIMIT.
    fast_child.py hold LIBRARY SOCKET
        takes one token through the region, prints `held`, and waits on
        stdin until the test kills it.
"""

from __future__ import annotations

import fcntl
import os
import sys

from baton_client import FastClient

# How long a wait may take before the child gives up rather than hangs
# (a hang guard, not a timing check).
PATIENCE = 20.0

SCAN = 0  # byte 0: the scan lock; byte 1 + i: job i's lock


def lock(fd: int, byte: int) -> None:
    fcntl.lockf(fd, fcntl.LOCK_EX, 1, byte)


def unlock(fd: int, byte: int) -> None:
    fcntl.lockf(fd, fcntl.LOCK_UN, 1, byte)


def locked_by_another(fd: int, byte: int) -> bool:
    """Whether another process holds `byte`: a probe that takes it without
    waiting and drops it at once. Only under the scan lock, as every job
    takes and drops its own byte, so the probe never stands in its way."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, byte)
    except OSError:
        return True
    unlock(fd, byte)
    return False


def job(fd: int) -> None:
    """The job: a write and a yield, so that a job lasts long enough for
    another process to take the scan lock and see it running."""
    os.pwrite(fd, b"j", SCAN)  # the data, not the lock: locks do not stop writes
    os.sched_yield()


def seated(library: str, socket: str, label: str) -> FastClient:
    client = FastClient.connect(socket, label=label, library=library)
    if not client.enable_fastpath(pile=os.environ.get("BATON_TEST_PILE") == "1"):
        sys.exit(f"no seat: {client.fastpath_refusal}")
    return client


def jobs(library: str, socket: str, lockfile: str, index: str, count: str, limit: str, rounds: str) -> None:
    """The job loop. A job's byte is taken and dropped only under the scan
    lock, and the count is taken under it too: no job starts or ends during
    a count, so a count never sees one job twice nor misses one."""
    me, others = 1 + int(index), [1 + j for j in range(int(count)) if j != int(index)]
    fd = os.open(lockfile, os.O_RDWR)
    with seated(library, socket, f"job {index}") as client:
        print("seated", flush=True)
        sys.stdin.readline()  # the test's go, once every job process is seated
        for _ in range(int(rounds)):
            client.acquire(timeout=PATIENCE)
            lock(fd, SCAN)
            lock(fd, me)
            running = 1 + sum(locked_by_another(fd, byte) for byte in others)
            if running > int(limit):
                with open(lockfile + ".over", "w") as over:
                    over.write(f"{running} jobs on {limit} tokens")
                print(f"{running} jobs at once on {limit} tokens", file=sys.stderr)
                sys.exit(3)
            unlock(fd, SCAN)
            job(fd)
            lock(fd, SCAN)
            unlock(fd, me)
            unlock(fd, SCAN)
            client.release()
        if client.held != 0 or not client.uses_fastpath:
            sys.exit(f"at the end: held {client.held}, fast path {client.uses_fastpath}")


def hold(library: str, socket: str) -> None:
    client = seated(library, socket, "holder")
    client.acquire(timeout=PATIENCE)
    print("held" if client.uses_fastpath and client.held == 1 else "not through the region", flush=True)
    sys.stdin.read()  # until killed


if __name__ == "__main__":
    {"jobs": jobs, "hold": hold}[sys.argv[1]](*sys.argv[2:])
