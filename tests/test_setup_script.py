"""scripts/setup.sh waits for another apt/dpkg's lock with a message instead of failing at once.

The lock wait (scripts/dpkg_lock.sh) runs for real against a temp file that another process holds
the way apt does (a POSIX fcntl lock) or with flock(1); apt_get runs a stand-in apt-get on PATH.
Nothing here needs root or touches the system's package state."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIB = ROOT / "scripts" / "dpkg_lock.sh"

HOLD = ("import fcntl, sys, time\nf = open(sys.argv[1], 'w')\nfcntl.lockf(f, fcntl.LOCK_EX)\n"
        "print('held', flush=True)\ntime.sleep(float(sys.argv[2]))\n")


def _bash(script: str, lock: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    out = subprocess.run(["bash", "-c", f". {LIB}; {script}"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "LLMWD_DPKG_LOCKS": str(lock), "LLMWD_DPKG_LOCK_POLL": "0.1", **env})
    return out, time.monotonic() - start


def _hold(lock: Path, seconds: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(lock), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def test_scripts_parse() -> None:
    for script in (ROOT / "scripts/setup.sh", LIB):
        assert subprocess.run(["bash", "-n", str(script)], capture_output=True, timeout=30).returncode == 0


def test_every_apt_get_in_setup_goes_through_the_waiting_wrapper() -> None:
    text = (ROOT / "scripts/setup.sh").read_text()
    assert ". scripts/dpkg_lock.sh" in text
    code = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    assert [line for line in code if re.search(r"\bapt-get\b", line)] == []
    assert sum("apt_get " in line for line in code) >= 5


def test_a_free_lock_is_no_wait_and_no_message(tmp_path: Path) -> None:
    lock = tmp_path / "lock-frontend"
    lock.write_text("")
    out, took = _bash("wait_for_dpkg_lock && echo go", lock)
    assert out.returncode == 0 and out.stdout == "go\n" and out.stderr == "" and took < 5


@pytest.mark.parametrize("how", ["fcntl", "flock"])
def test_a_held_lock_is_waited_for_with_one_message(tmp_path: Path, how: str) -> None:
    lock = tmp_path / "lock-frontend"
    lock.write_text("")
    if how == "fcntl":  # as apt and dpkg take it
        holder = _hold(lock, 1.5)
    else:
        if not shutil.which("flock"):
            pytest.skip("flock(1) not installed")
        holder = subprocess.Popen(["flock", str(lock), "sleep", "1.5"])
        time.sleep(0.3)
    try:
        out, took = _bash("wait_for_dpkg_lock && echo go", lock)
    finally:
        holder.wait(timeout=30)
    assert out.returncode == 0 and out.stdout == "go\n", out.stderr
    assert out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(f"setup: waiting for the dpkg lock: {lock} is held by pid "), out.stderr
    assert 0.5 < took < 10


def test_a_lock_held_past_the_timeout_fails_with_a_hint(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    lock.write_text("")
    holder = _hold(lock, 5)
    try:
        out, took = _bash("apt_get update", lock, LLMWD_DPKG_LOCK_TIMEOUT="1")
    finally:
        holder.kill()
        holder.wait()
    assert out.returncode == 1 and took < 4, out.stderr
    assert f"pid {holder.pid}" in out.stderr and "still held" in out.stderr and "make setup again" in out.stderr


def test_apt_get_also_asks_apt_itself_to_wait(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    lock.write_text("")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "apt-get").write_text('#!/bin/sh\necho "apt-get $*"\n')
    (fake / "apt-get").chmod(0o755)
    out, _ = _bash("SUDO=''; apt_get install -y redis-server", lock, PATH=f"{fake}:{os.environ['PATH']}")
    assert out.returncode == 0 and out.stdout == "apt-get -o DPkg::Lock::Timeout=600 install -y redis-server\n"


def test_the_lock_check_reads_proc_locks_not_root_only_files(tmp_path: Path) -> None:
    """The holder is found without opening the lock file for writing (dpkg's lock is root's, mode 0640)."""
    lock = tmp_path / "lock"
    lock.write_text("")
    holder = _hold(lock, 3)
    try:
        lock.chmod(0o000)
        out, _ = _bash(f"lock_holder {lock}", lock)
    finally:
        lock.chmod(0o644)
        holder.kill()
        holder.wait()
    assert out.stdout.strip() == str(holder.pid)
    with open(lock, "w") as f:  # and released: free again
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
