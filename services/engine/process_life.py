"""A child process's life tied to its parent's (the launcher's, or rank 0's)."""
from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent (the launcher) dies, however it died."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    if os.getppid() == 1:  # the launcher died before prctl took effect
        os._exit(1)
