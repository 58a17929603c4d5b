"""glibc malloc settings for a process that receives large answers, as the C++ binaries set
for themselves (core/base/process_setup.cc).

Every answer arrives as a fresh ``bytes`` object of a few hundred KiB to MiBs, and gRPC's
threads allocate their receive buffers in per-thread arenas. With glibc's defaults those
buffers are mapped and unmapped (or their heaps trimmed) call after call, and each call
page-faults them in again: measured on a 512 x 128 EmbeddingBag answer (256 KiB), the Python
client spent ~560 µs of CPU per call with the defaults and ~250 µs with these settings. They
keep up to 64 MiB of freed memory in the process for reuse instead.

The settings are process-wide. :class:`shardserve.Client` applies them once unless asked not
to (``tune_malloc=False``, or ``SHARDSERVE_TUNE_MALLOC=0`` in the environment).
"""

import ctypes
import os
import threading

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

_lock = threading.Lock()
_done = False


def tune_malloc() -> bool:
    """Applies the settings (once per process); False where this is not glibc or it is
    switched off by ``SHARDSERVE_TUNE_MALLOC=0``."""
    global _done
    if os.environ.get("SHARDSERVE_TUNE_MALLOC", "1") == "0":
        return False
    with _lock:
        if _done:
            return True
        try:
            mallopt = ctypes.CDLL(None).mallopt
        except (OSError, AttributeError):
            return False
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        # 32 MiB is the largest mmap threshold glibc accepts (half its per-thread heap size).
        ok = mallopt(_M_MMAP_THRESHOLD, 32 << 20) == 1
        ok = mallopt(_M_TRIM_THRESHOLD, 64 << 20) == 1 and ok
        # One arena: per-thread arenas live in 64 MiB heaps that glibc shrinks as they empty.
        ok = mallopt(_M_ARENA_MAX, 1) == 1 and ok
        _done = ok
        return ok
