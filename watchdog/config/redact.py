"""Secrets out of anything we print or log: the one redactor of the project.

``redacted`` takes a config dump (nested dicts and lists) or a single string such as a Redis URL
and returns a copy with secrets replaced by ``***``: values of fields whose name says secret
(``password``, ``token``, ``routing_key``, ...), every HTTP header value, the password in a URL's
userinfo (``redis://user:***@host``), secret query parameters (``?sentinel_password=***``) and
webhook paths (a Slack incoming-webhook URL is itself the credential). Collections of keys
(``api_keys``, ``metrics_keys``, ``tokens``, ...) are hidden whole: a list's items, a mapping's keys
(the gateway's ``api_keys`` maps the secret key to a route; the routes stay). ``config check``, the
``flags`` CLI and the Redis connection errors all go through it.
"""

from __future__ import annotations

import re
from typing import Any

#: field or query-parameter names whose value is a secret
_SECRET_NAME = r"(?:password|passwd|secret|token|routing_key|api_key|apikey|credentials?)"
_SECRET_KEY = re.compile(_SECRET_NAME + "$", re.I)
#: a list of secrets, or a mapping keyed by them (``api_keys: {sk-...: route}``)
_SECRET_COLLECTION = re.compile(r"(?:^|_)(?:keys|tokens|passwords|secrets)$", re.I)
#: ``//user:password@host``: the password runs to the last ``@`` before any space, ``?`` or ``#``
#: (an unencoded ``@`` or ``/`` in it must not leak its tail; a path holding ``@`` is hidden too)
_URL_PASSWORD = re.compile(r"(//[^:/@\s?#]*):[^\s?#]*@")
#: ``?sentinel_password=...`` / ``&token=...``
_QUERY_SECRET = re.compile(r"([?&;][\w.-]*" + _SECRET_NAME + r"=)[^&;#\s]*", re.I)
_SECRET_PATH = re.compile(r"(hooks\.slack\.com/services/|/hooks/|/webhook/)\S+")


def redacted(value: Any, key: str = "") -> Any:
    """A copy of ``value`` (a string, or a config dump of dicts and lists) with its secrets
    replaced by ``***``; ``key`` is the name ``value`` was found under."""
    if isinstance(value, dict):
        if _SECRET_COLLECTION.search(key):
            return {f"***{i}": redacted(v) for i, v in enumerate(value.values(), 1)}
        return {k: ("***" if v and (key == "headers" or _SECRET_KEY.search(str(k))) else redacted(v, str(k)))
                for k, v in value.items()}
    if isinstance(value, list):
        if _SECRET_COLLECTION.search(key):
            return ["***" if isinstance(v, str) else redacted(v) for v in value]
        return [redacted(v, key) for v in value]
    if isinstance(value, str):
        text = _URL_PASSWORD.sub(r"\1:***@", value)
        text = _QUERY_SECRET.sub(r"\1***", text)
        return _SECRET_PATH.sub(r"\1***", text)
    return value
