"""A concurrent.futures pool of 8 threads that runs 16 tasks, each while
holding one baton token: however many threads, the broker's limit (shared
with every build on the machine) is how many tasks run at once.

    baton serve --jobs 2 &
    python examples/pool.py
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from baton_client import Client

local = threading.local()
lock = threading.Lock()
running = peak = 0


def client() -> Client:
    # One client per thread: a waiting acquire holds its connection.
    if not hasattr(local, "client"):
        local.client = Client(label=f"pool.py {threading.current_thread().name}")
    return local.client


def task(i: int) -> int:
    global running, peak
    with client().acquire():
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.05)  # the job
        with lock:
            running -= 1
    return i * i


if __name__ == "__main__":
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(task, range(16)))
    print(f"16 tasks done, sum of squares {sum(results)}, at most {peak} at once")
