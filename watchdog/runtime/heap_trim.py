"""Free memory inside glibc's malloc heaps handed back to the system, from the main loop.

CPython's small objects live in its own arenas; everything above 512 bytes (dict tables, lists, strings,
the checkpoint text, kafka-python's fetched batches) comes from malloc. glibc returns freed memory to
the system only from the top of a heap, so a long-lived allocation above a freed one keeps the freed
pages resident. At 10,000 routes (`bench/growth.py`, docs/BENCHMARKS.md "Memory glibc kept") the heaps
held 148 MiB of which 115 MiB were free, and RSS fell from 447 to 340 MB at one ``malloc_trim(0)``,
which releases the free pages anywhere in every arena. The loop calls ``maybe_trim`` once per iteration;
it trims every ``TRIM_EVERY_S`` seconds. Where the C library has no ``malloc_trim`` (musl, macOS) it
does nothing.

``fix_mmap_threshold`` (the daemon's start) pins glibc's mmap threshold at ``MMAP_THRESHOLD``: glibc
raises it to the size of any mmapped block freed (up to 32 MiB), after which the checkpoint text and other
large transient buffers come from the heaps and leave holes there; below the pinned threshold they are
mapped and unmapped whole. Not where a golden job runs an in-process torch engine: its tensors above the
threshold would each be mapped and faulted in anew (a CPU matmul loop with 512 KiB results ran 6-19 % slower).
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable

#: seconds between two trims: a trim of ~100 MiB of free heap takes milliseconds (measured), and what
#: the loop frees again in that time is a window's worth of transient buffers
TRIM_EVERY_S = 10.0
#: a trim comes sooner, though not within ``TRIM_SOON_S`` of the last, once this much was freed in large
#: pieces (``freed``: a partition save Redis answered, up to ~25 MB of small strings at 10,000 routes): a
#: saturated replica's heaps otherwise held ~50 MiB free between two trims
TRIM_FREED_BYTES = 8 * 1024 * 1024
TRIM_SOON_S = 1.0


#: bytes from which glibc maps a block on its own (its default start; pinned: no dynamic raise)
MMAP_THRESHOLD = 128 * 1024
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def _libc(name: str, *argtypes: type) -> Callable[..., int] | None:
    """The C library's function ``name`` returning an int, or None where it has none (not glibc)."""
    try:
        fn = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = list(argtypes)
    fn.restype = ctypes.c_int
    return fn


def fix_mmap_threshold() -> bool:
    """Pin glibc's mmap threshold (module docstring); False where there is no glibc ``mallopt``."""
    mallopt = _libc("mallopt", ctypes.c_int, ctypes.c_int)
    return mallopt is not None and bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))


class HeapTrimmer:
    def __init__(self, every_s: float = TRIM_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self._clock = clock
        self._trim = _libc("malloc_trim", ctypes.c_size_t)
        self._lock = threading.Lock()
        self._next = clock() + every_s
        self._last = clock()
        self._freed = 0

    @property
    def available(self) -> bool:
        return self._trim is not None

    def freed(self, nbytes: int) -> None:
        """``nbytes`` were just let go of in one piece of work: the next ``maybe_trim`` may come sooner."""
        self._freed += nbytes

    def maybe_trim(self) -> float | None:
        """Trim when it is time: the seconds it took, or None when it did not run."""
        if self._trim is None:
            return None
        now = self._clock()
        with self._lock:  # several daemons of one process (tests, the demo): one trim per interval
            soon = self._freed >= TRIM_FREED_BYTES and now >= self._last + TRIM_SOON_S
            if now < self._next and not soon:
                return None
            self._next, self._last, self._freed = now + self.every_s, now, 0
        t = time.perf_counter()
        self._trim(0)
        return time.perf_counter() - t


HEAP_TRIM = HeapTrimmer()
