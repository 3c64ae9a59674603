"""Integrations with serving stacks the watchdog does not run itself (LiteLLM)."""
