"""gloo's worker threads finish releasing their last collective before interpreter finalization.

A gloo worker thread frees a finished collective's work object on its own
time; when the program no longer holds the collective's tensors, freeing them
needs the GIL. If the interpreter is already finalizing then, Python ends the
thread with ``pthread_exit`` in the middle of C++ code and the process aborts
("terminate called without an active exception", SIGABRT). It happens when the
group outlives ``destroy_process_group()`` (FSDP2 and DTensor keep a reference
to the default group) and the worker was not scheduled between the last
collective and the end of the script: seen at 4 ranks on 2 busy cores, about
one run in five.

``wait_until_idle`` releases the GIL until every gloo worker sleeps without
waking across one poll, bounded by a timeout. The exit flush calls it last.
Threads are found by the name ``torch`` gives them (``pt_gloo_runloop``) in
``/proc``; where that is not available, nothing waits.
"""

from __future__ import annotations

import os
import time

WORKER_NAME = "pt_gloo_runloop"
EXIT_IDLE_TIMEOUT_S = 2.0
POLL_S = 0.01


def _status(tid: str) -> dict[str, str]:
    with open(f"/proc/self/task/{tid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def workers() -> dict[str, tuple[str, int]]:
    """gloo's worker threads in this process: thread id -> (scheduler state letter, context switches so far)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    found = {}
    for tid in tids:
        try:
            st = _status(tid)
        except OSError:  # the thread ended meanwhile
            continue
        if st.get("Name") == WORKER_NAME:
            switches = int(st.get("voluntary_ctxt_switches", 0)) + int(st.get("nonvoluntary_ctxt_switches", 0))
            found[tid] = (st.get("State", "?")[:1], switches)
    return found


def is_idle(before: dict[str, tuple[str, int]], after: dict[str, tuple[str, int]]) -> bool:
    """Every worker sleeps in both samples and none woke in between (a thread waiting for the GIL wakes)."""
    return all(state == "S" and tid in before and before[tid][1] == n for tid, (state, n) in after.items())


def wait_until_idle(timeout_s: float = EXIT_IDLE_TIMEOUT_S, poll_s: float = POLL_S) -> bool:
    """Sleep (the GIL released) until gloo's workers are idle; False if they are not within ``timeout_s``."""
    before = workers()
    deadline = time.monotonic() + timeout_s
    while before:
        time.sleep(poll_s)
        after = workers()
        if is_idle(before, after):
            return True
        if time.monotonic() >= deadline:
            return False
        before = after
    return True
