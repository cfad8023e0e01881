"""Peak resident memory of a code region, on Linux, without a GPU allocator to ask.

The process's high-water mark (VmHWM) is reset through /proc/self/clear_refs before the region
and read after it. glibc is told to serve every allocation of 64 KiB or more with mmap, so freed
buffers leave the resident set at once and the high-water mark tracks live tensors, not the
allocator's cache.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 64 * 1024


def use_exact_allocation_tracking() -> None:
    """Make large allocations map and unmap memory eagerly (call once, before measuring)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed; memory numbers would be meaningless")


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} missing from /proc/self/status")


class PeakMemory:
    """``with PeakMemory() as peak: ...`` then ``peak.extra_bytes``: the high-water mark of the
    region above the resident set at its start."""

    extra_bytes: int = 0

    def __enter__(self) -> "PeakMemory":
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        self._start = _status_bytes("VmRSS:")
        return self

    def __exit__(self, *exc) -> None:
        self.extra_bytes = max(0, _status_bytes("VmHWM:") - self._start)
