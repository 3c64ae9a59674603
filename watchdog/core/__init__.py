"""Plain data and pure helpers every stage shares, with no I/O: the event contract (``events``),
signals and actions (``signals``), the Redis key layout (``keys``), the metric registry
(``metrics``), the bounded YAML reader (``safe_yaml``), CLI argument types (``argtypes``), text
tokenisation (``text``) and where the starter files live (``starter``). It imports nothing else of
the project; ``probes/`` may import this package and no other part of ``watchdog``.
"""
