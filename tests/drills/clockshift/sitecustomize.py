"""Drills only: shift this process's ``time.time()`` by the seconds in ``$LLMWD_DRILL_CLOCK_FILE``.

The clock drills put this folder first on the daemon's PYTHONPATH, so Python imports it at start-up
(``site``) and the whole process, its Kafka and Redis clients included, sees a host clock that steps
when the drill rewrites the file. ``sleep`` and ``monotonic`` stay real (libfaketime fakes those too,
which breaks the process). Nothing in ``watchdog/`` knows about it.
"""

import os
import time

_path = os.environ.get("LLMWD_DRILL_CLOCK_FILE")
if _path:
    _real_time = time.time
    _real_ns = time.time_ns
    _mono = time.monotonic
    _state = [-1.0, 0.0]  # last read (monotonic), offset (s)

    def _offset() -> float:
        now = _mono()
        if now - _state[0] >= 0.05:
            _state[0] = now
            try:
                with open(_path) as f:
                    _state[1] = float(f.read().strip() or 0.0)
            except (OSError, ValueError):
                pass
        return _state[1]

    def _time() -> float:
        return _real_time() + _offset()

    def _time_ns() -> int:
        return _real_ns() + int(_offset() * 1e9)

    time.time = _time
    time.time_ns = _time_ns
