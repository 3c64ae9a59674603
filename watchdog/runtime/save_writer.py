"""The checkpoint writer thread: encodes a partition save and runs its Lua script off the loop thread.

The loop thread builds a save (``Checkpointer.build_save``: window snapshots, engine-state JSON of the
dirty routes, the offset), consistent with the offset it records, and hands it here; this thread encodes
the window snapshots (``PendingSave.encode``) and runs ``CheckpointStore.save``. The outcome waits for
the loop (``finished``), which alone acts on it (offset mirror, fencing, ``RESYNC``), in the commit order
of ``runtime/checkpointer.py``. One save per partition is in flight at a time; saves run in submit order.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

from watchdog.state.checkpoint import CheckpointStore, PendingSave
from watchdog.state.partitions import PartitionKey

log = logging.getLogger(__name__)

#: the writer thread's name (the daemon watches its long-lived threads by name)
THREAD_NAME = "checkpoint-writer"


@dataclass
class Outcome:
    pk: PartitionKey
    token: str
    save: PendingSave
    #: SAVED / DUPLICATE / FENCED / RESYNC, or None with ``error``
    status: str | None
    error: BaseException | None
    #: seconds this thread spent encoding and writing
    seconds: float
    #: seconds the loop spent building it
    built_s: float
    #: the loop's clock when it was handed over (the partition's ``last_save``)
    at: float


class SaveWriter:
    def __init__(self, checkpoints: CheckpointStore) -> None:
        self.checkpoints = checkpoints
        self._jobs: queue.Queue[tuple[PartitionKey, str, PendingSave, float, float] | None] = queue.Queue()
        self._cond = threading.Condition()
        self._busy: set[PartitionKey] = set()
        self._done: dict[PartitionKey, Outcome] = {}
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._jobs.put(None)
            thread.join(timeout)
        self._thread = None

    def submit(self, pk: PartitionKey, token: str, save: PendingSave, built_s: float, at: float) -> None:
        with self._cond:
            assert pk not in self._busy, f"partition {pk[1]}: a save is in flight already"
            self._busy.add(pk)
        self.start()
        self._jobs.put((pk, token, save, built_s, at))

    def busy(self, pk: PartitionKey) -> bool:
        """A save of ``pk`` was submitted and its outcome not taken yet."""
        return pk in self._busy

    def any_busy(self) -> bool:
        return bool(self._busy)

    def finished(self) -> list[Outcome]:
        """The outcomes ready now (taken: each is returned once)."""
        with self._cond:
            out = list(self._done.values())
            self._done.clear()
            for o in out:
                self._busy.discard(o.pk)
        return out

    def wait(self, pk: PartitionKey, timeout: float | None = None) -> Outcome | None:
        """Block until the save of ``pk`` in flight has an outcome, and take it (None: none in flight,
        or ``timeout`` passed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while pk in self._busy and pk not in self._done:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(left)
            outcome = self._done.pop(pk, None)
            if outcome is not None:
                self._busy.discard(pk)
            return outcome

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            pk, token, save, built_s, at = job
            t0 = time.perf_counter()
            status: str | None = None
            error: BaseException | None = None
            try:
                status = self.checkpoints.save(pk[1], token, save)
            except BaseException as exc:  # noqa: BLE001 - handed to the loop, which raises what it cannot handle
                error = exc
            outcome = Outcome(pk, token, save, status, error, time.perf_counter() - t0, built_s, at)
            with self._cond:
                self._done[pk] = outcome
                self._cond.notify_all()
