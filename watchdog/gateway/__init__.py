"""``llm-watchdog gateway``: an OpenAI-compatible proxy that obeys the routing flags and logs events.

Layout: ``config`` (the ``gateway:`` section, pydantic; events go through
``watchdog.ingest.emitter``), ``app`` (the raw ASGI application: routing, proxying, shadows), ``cli`` (the command).
"""
