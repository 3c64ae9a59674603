"""Run a module with every Python thread's name given to its OS thread (``prctl(PR_SET_NAME)``, first 15
characters), so that ``/proc/PID/task/TID/comm`` says which thread a tid is: Python 3.11 leaves them all
``python``. ``bench/ingest_process.py --threads`` runs the daemon through it to split its CPU by thread.

    python bench/named_threads.py MODULE [ARGS...]    (as ``python -m MODULE ARGS...``)
"""

from __future__ import annotations

import ctypes
import os
import runpy
import sys
import threading

_PR_SET_NAME = 15
_libc = ctypes.CDLL(None, use_errno=True)


def _set_name(name: str) -> None:
    _libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


_inner = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]


def short_name(name: str) -> str:
    """The OS name of a thread: kafka-python's IO threads (``kafka-io-<client id>``) by their client's role, as
    the daemon names its clients (reading consumer, log-end consumer ``-offsets``, dead-letter producer ``-dlq``);
    request threads of a ``ThreadingHTTPServer`` as ``Thread-N``; the rest as named."""
    if name.startswith("kafka-io-"):
        return "kio-" + ("offsets" if name.endswith("-offsets") else "dlq" if name.endswith("-dlq") else "consumer")
    if name.startswith("Thread-"):
        return "Thread-N"
    return name


def _named_bootstrap_inner(self: threading.Thread) -> None:
    _set_name(short_name(self.name))
    _inner(self)


threading.Thread._bootstrap_inner = _named_bootstrap_inner  # type: ignore[attr-defined]

if __name__ == "__main__":
    _set_name("MainThread")
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    # as ``-m`` does: the working directory first, not bench/ (whose modules would shadow others)
    sys.path[0] = os.getcwd()
    runpy.run_module(module, run_name="__main__", alter_sys=True)
