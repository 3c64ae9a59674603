"""Command-line entry points: ``llm-watchdog`` (``main``), ``flags`` (``flags``), ``policy
validate|backtest`` (``policy``) and ``init`` (``init``). User errors end in one line naming the
cause, never a traceback.
"""
