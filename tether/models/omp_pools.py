"""Which threads own an OpenMP pool, and a passing thread for work that must not leave one behind.

libgomp, torch's OpenMP runtime, gives every thread that runs a parallel region its own pool of workers
and keeps it until that thread exits. Once the pools' threads outnumber the cores, it lets an idle worker
spin only 100 times before it sleeps, so every parallel region then wakes its workers through the kernel.
On the 2-core development machine, after the main thread had run one parallel torch op, 2,000
silu-and-multiply ops on [32, 1536] took 265 ms in another thread against 48 ms in the main thread (52 ms
in that thread while the main thread had no pool), and `tether serve`'s engine thread decoded 32 streams
about 20% slower per step than the same engine stepped in the main thread.

So a server or an in-process client whose model computes in a thread of its own (`AsyncEngine`) loads
that model in a passing thread (`in_passing_thread`): its pool ends with it, and the engine thread's pool
is the only one; and RL's multi-turn rollouts step their CPU engine in the thread their learner trains in
(`LLMEngine.step_async`). This does not help where two threads really compute at once (an async RL
learner beside its engine): those share the cores whatever their pools.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def in_passing_thread(work: Callable[[], T], name: str = "tether-load") -> T:
    """`work()` run in a new thread that ends with it (taking any OpenMP pool it made along); its result,
    or its exception re-raised here. The calling thread waits."""
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(work())
        except BaseException as error:  # handed to the caller, whatever it is
            failure.append(error)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]
