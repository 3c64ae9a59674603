"""``llm-watchdog gateway``: an OpenAI-compatible proxy that obeys the routing flags and logs events.

Layout: ``config`` (the ``gateway:`` section, pydantic), ``emitter`` (bounded, batched event
producer), ``app`` (the raw ASGI application: routing, proxying, shadows), ``cli`` (the command).
"""
