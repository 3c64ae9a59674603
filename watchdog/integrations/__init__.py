"""Glue for serving stacks the watchdog plugs into (LiteLLM). Optional extras; nothing here is
imported by the daemon."""
