"""OS signals (SIGTERM, SIGINT, SIGHUP) handled on a thread of their own, never inside a Python
signal handler.

A Python signal handler runs in the main thread between two bytecodes, so it may run while that
thread holds the very lock the handler needs: ``threading.Event.set`` takes its condition's lock,
and a second SIGINT that lands inside the first handler's ``Event.set`` (``timeout -s INT`` sends
two; so does an impatient Ctrl-C) waited on that lock forever. Here the Python-level handlers do
nothing; CPython's C handler writes the signal number to a pipe (``signal.set_wakeup_fd``) and the
``llmwd-signals`` thread reads it and calls the callbacks, where taking locks and logging is safe.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Mapping
from types import FrameType

log = logging.getLogger(__name__)


def _noop(_signum: int, _frame: FrameType | None) -> None:
    """The Python-level handler: the work happens on the signal thread."""


class SignalThread:
    """Calls ``handlers[sig](sig)`` on a daemon thread for each signal received between ``start``
    and ``close``. ``start`` must run on the main thread (``signal.signal`` requires it); ``close``
    restores the previous handlers and wake-up fd."""

    def __init__(self, handlers: Mapping[signal.Signals, Callable[[signal.Signals], None]]) -> None:
        self.handlers = dict(handlers)
        self._previous: dict[signal.Signals, object] = {}
        self._previous_fd = -1
        self._write_fd = -1
        self._thread: threading.Thread | None = None

    def start(self) -> SignalThread:
        read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)  # set_wakeup_fd requires it: a full pipe drops, never blocks
        self._previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        for sig in self.handlers:
            self._previous[sig] = signal.signal(sig, _noop)
        self._thread = threading.Thread(target=self._run, args=(read_fd,), name="llmwd-signals", daemon=True)
        self._thread.start()
        return self

    def _run(self, read_fd: int) -> None:
        try:
            while data := os.read(read_fd, 64):  # b"" once close() closed the write end
                for number in data:
                    try:
                        sig = signal.Signals(number)
                    except ValueError:
                        continue
                    handler = self.handlers.get(sig)
                    if handler is None:
                        continue
                    try:
                        handler(sig)
                    except Exception:  # noqa: BLE001 - one failed callback must not stop the next signal
                        log.exception("handling %s failed", sig.name)
        finally:
            os.close(read_fd)

    def close(self) -> None:
        if self._write_fd < 0:
            return
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)  # type: ignore[arg-type]
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._write_fd)
        self._write_fd = -1
        if self._thread is not None:
            self._thread.join(5.0)
