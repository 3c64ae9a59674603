"""fp8-watchdog's LiteLLM hook under its own import name (see this distribution's README).

``fp8_watchdog_litellm.handler`` is the proxy's callback (``litellm_settings.callbacks``), built on
first access from the file named by ``LLMWD_LITELLM_CONFIG``. Importing this package imports
neither LiteLLM nor the hook: attributes are resolved on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["CONFIG_ENV", "LiteLLMSettings", "WatchdogLogger", "failure_status", "handler"]

_IMPL = "fp8_watchdog_litellm._watchdog.integrations.litellm"


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(_IMPL), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
