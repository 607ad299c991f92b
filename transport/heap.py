"""Large buffers reused, not mapped afresh, in the processes of a simulation (issue 32).

glibc's ``malloc`` maps every block above its mmap threshold (128 KiB at start) afresh and
unmaps it when it is freed, so each 1 MiB frame and 4 MiB chunk the transport copies pays
its pages' first-touch faults again: on the 2-core VM of docs/performance.md, three copies
of 4 MiB into fresh buffers took 12.6-13.1 ms, against 3.3-3.7 ms into reused heap. In a
simulation's processes (the server's, its workers', the embedded broker's) blocks below
``KEEP_BELOW`` come from the heap and are reused, and up to twice that of free heap stays
mapped. Another C library keeps its own behaviour (``keep_large_buffers`` says so).
"""

from __future__ import annotations

import ctypes

KEEP_BELOW = 32 << 20
"""Blocks below this many bytes are reused from the heap: frames (1 MiB), streamed chunks
(4 MiB) and vectors up to 8 x 10^6 32-bit elements; larger vectors stay mapped once."""
_M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
_M_MMAP_THRESHOLD = -3


def keep_large_buffers(limit: int = KEEP_BELOW) -> bool:
    """In this process, blocks below ``limit`` bytes come from the heap and are reused, and
    up to ``2 * limit`` bytes of free heap stay mapped; True if the C library took it
    (glibc's ``mallopt``), False if it has no such setting."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, limit)) and bool(
        mallopt(_M_TRIM_THRESHOLD, 2 * limit))


def heap_environment(limit: int = KEEP_BELOW) -> dict[str, str]:
    """``keep_large_buffers`` for a child process started with ``exec``: the environment
    variables glibc reads at start-up (other C libraries ignore them)."""
    return {"MALLOC_MMAP_THRESHOLD_": str(limit), "MALLOC_TRIM_THRESHOLD_": str(2 * limit)}
