"""Free memory inside glibc's malloc heaps handed back to the system from the main loop
(watchdog/runtime/heap_trim.py): on a schedule, measured in ``llmwd_malloc_trim_seconds``, and a real
reduction of the process's resident memory when freed blocks sit below live ones."""

from __future__ import annotations

import platform

import pytest

from tests.daemon_harness import make_config, running_daemon, write_policy
from tests.helpers import wait_until
from watchdog.runtime import heap_trim
from watchdog.runtime.heap_trim import HeapTrimmer

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS"))


def test_it_trims_once_per_interval():
    now = [100.0]
    trimmer = HeapTrimmer(every_s=10.0, clock=lambda: now[0])
    if not trimmer.available:
        assert trimmer.maybe_trim() is None
        return
    assert trimmer.maybe_trim() is None  # the first trim comes one interval after the start
    now[0] = 110.0
    took = trimmer.maybe_trim()
    assert took is not None and took >= 0.0
    now[0] = 115.0
    assert trimmer.maybe_trim() is None
    now[0] = 120.5
    assert trimmer.maybe_trim() is not None


def test_a_large_free_brings_the_trim_forward_but_not_twice_a_second():
    now = [100.0]
    trimmer = HeapTrimmer(every_s=10.0, clock=lambda: now[0])
    if not trimmer.available:
        return
    now[0] = 102.0
    trimmer.freed(heap_trim.TRIM_FREED_BYTES - 1)
    assert trimmer.maybe_trim() is None  # not enough let go of
    trimmer.freed(1)
    assert trimmer.maybe_trim() is not None  # a save Redis answered: its text is trimmed away now
    now[0] = 102.5
    trimmer.freed(heap_trim.TRIM_FREED_BYTES)
    assert trimmer.maybe_trim() is None  # within TRIM_SOON_S of the last trim
    now[0] = 103.1
    assert trimmer.maybe_trim() is not None
    now[0] = 110.0
    assert trimmer.maybe_trim() is None  # the schedule counts from the last trim
    now[0] = 113.2
    assert trimmer.maybe_trim() is not None


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_freed_blocks_below_live_ones_leave_the_resident_set():
    trimmer = HeapTrimmer(every_s=0.0)
    assert trimmer.available
    trimmer.maybe_trim()
    # 2 KiB strings come from malloc (CPython's own allocator takes 512 bytes and less); keeping one in 64
    # alive pins the top of the heap, so glibc cannot give the freed ones back on its own
    blocks = [bytes(2048) for _ in range(60_000)]  # ~120 MiB
    keep = blocks[::64]
    del blocks
    before = _rss_kb()
    trimmer.maybe_trim()
    after = _rss_kb()
    assert before - after > 60 * 1024, (before, after)
    assert len(keep) == 938


@pytest.mark.services
@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_the_loop_trims_and_times_it(kafka_service, redis_service, topic, tmp_path, monkeypatch):
    monkeypatch.setattr(heap_trim.HEAP_TRIM, "every_s", 0.2)
    cfg = make_config(kafka_service.address, redis_service.port, topic, write_policy(tmp_path / "p.yaml"), None)
    with running_daemon(cfg) as (daemon, _server):
        hist = daemon.metrics.malloc_trim_seconds
        wait_until(lambda: hist._sum.get() > 0, 30, what="the loop's trims timed")


_PIN_SCRIPT = """
import sys
from watchdog.runtime.heap_trim import fix_mmap_threshold
if sys.argv[1] == "pin":
    assert fix_mmap_threshold()
def rss():
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS"))
big = bytes(20 * 2**20)
del big  # unpinned, glibc now serves blocks up to 20 MiB from its heaps
blocks, keep = [], []
for _ in range(100):
    blocks.append(bytearray(2**20))
    keep.append(bytearray(600))  # a live block above each one: the heap cannot shrink from the top
before = rss()
del blocks
print(before - rss())
"""


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_a_pinned_mmap_threshold_gives_large_freed_blocks_back_at_once():
    import subprocess
    import sys

    def freed_kb(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", _PIN_SCRIPT, mode], capture_output=True, text=True, check=True)
        return int(out.stdout.strip())

    assert freed_kb("pin") > 80 * 1024
    assert freed_kb("dynamic") < 20 * 1024


def test_the_threshold_is_left_to_glibc_beside_an_in_process_engine():
    from watchdog.config.settings import GoldenConfig, GoldenJobConfig

    def job(kind: str) -> GoldenJobConfig:
        return GoldenJobConfig(name="j", set="s", model="m", routes=["r"], candidate={"kind": kind},
                               baseline={"kind": "openai"})

    assert not GoldenConfig().in_process()
    assert not GoldenConfig(jobs=[job("openai")]).in_process()
    assert GoldenConfig(jobs=[job("openai"), job("torch")]).in_process()
