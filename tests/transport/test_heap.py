"""``transport.heap`` (issue 32): in a simulation's processes a freed 4 MiB buffer is reused,
not mapped afresh, so copying a chunk into a new buffer does not fault its pages in again;
the embedded broker's process gets the same through its environment."""

from __future__ import annotations

import subprocess
import sys

import pytest

from transport.heap import KEEP_BELOW, heap_environment

PROBE = """
import resource, sys
from transport.heap import keep_large_buffers
if sys.argv[1] == "keep":
    assert keep_large_buffers()
chunk = bytes(4 << 20)

def copies():  # a chunk's way out: encoded, framed, packed (three buffers, then freed)
    encoded = bytearray(chunk)
    framed = bytes(encoded)
    packed = bytearray(framed)
    del encoded, framed, packed

for _ in range(3):
    copies()  # warm up: the first buffers are new memory either way
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    copies()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str, env: dict[str, str] | None = None) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         check=True, env=env, timeout=60)
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings")
def test_a_freed_chunk_buffer_is_reused_not_faulted_in_again() -> None:
    import os

    pages = 30 * (4 << 20) // 4096  # what 30 fresh 4 MiB buffers fault in
    fresh = _faults("default")
    if fresh < pages // 2:
        pytest.skip(f"this C library reuses freed 4 MiB blocks already ({fresh} faults)")
    assert _faults("keep") < pages // 20
    assert _faults("default", {**os.environ, **heap_environment()}) < pages // 20
    assert heap_environment()["MALLOC_MMAP_THRESHOLD_"] == str(KEEP_BELOW)
