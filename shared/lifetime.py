"""Child processes that do not outlive their parent.

A supervisor killed with SIGKILL runs no cleanup, so its children would keep serving as orphans (a router
still answering on its port, workers heartbeating into a store nobody restarts). Linux can tie a child's
life to its parent's: PR_SET_PDEATHSIG delivers a signal to the child when the parent dies.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def die_with_parent_hook(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A `preexec_fn` that asks the kernel to send `sig` to the child when this process dies; None where
    that is unsupported (not Linux) or unsafe.

    The kernel fires the signal when the *thread* that forked exits, not the process, so the hook is only
    offered on the main thread (a child forked from a short-lived thread would be killed with it).
    """
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    import ctypes
    prctl = ctypes.CDLL(None, use_errno=True).prctl   # resolved before fork: the hook runs in the child
    parent = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:                     # the parent died before the prctl took effect
            os._exit(1)
    return hook
