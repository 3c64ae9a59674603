"""Who may use the gateway and pick which route: the client table and the route decision. Pure.

A route decides which precision serves a request and whose statistics it feeds, so a client does
not choose it freely (issue 20): a known bearer key decides its route, and the route header may
pick only that route or one of the key's ``allow_routes``; a client without a known key may pick
one of ``gateway.routes``. Anything else is refused with an OpenAI-style error (or ignored, with
``unknown_route: default``); no route is ever created by a client, so the routes in events and on
``/metrics`` are the configured ones.

Keys are compared in constant time: each presented token is hashed (SHA-256) and compared with
``hmac.compare_digest`` against the digest of every configured key, all of them, so neither the
time nor an early exit says how much of a key matched, or which one.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from watchdog.gateway.config import ClientConfig, GatewayConfig, check_route

__all__ = ["Access", "Refusal", "bearer_token"]


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request the gateway will not serve: HTTP status, OpenAI error ``code`` and a message."""

    status: int
    code: str
    message: str

    @property
    def kind(self) -> str:
        """The OpenAI error ``type``."""
        return {401: "authentication_error", 403: "permission_error",
                503: "server_error"}.get(self.status, "invalid_request_error")


def bearer_token(authorization: bytes | None) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    token = token.strip()
    return token or None


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


class Access:
    """The route decision for one gateway configuration."""

    def __init__(self, cfg: GatewayConfig) -> None:
        self.required = cfg.auth.required
        self.refuse_unknown = cfg.unknown_route == "refuse"
        self.known = cfg.known_routes()
        self.open_routes = frozenset(cfg.routes)
        self.model_routes = dict(cfg.model_routes)
        self.default_route = cfg.default_route
        self.header_name = cfg.route_header
        self._clients = [(_digest(c.api_key.encode()), c) for c in cfg.all_clients()]
        self._metrics_keys = [_digest(k.encode()) for k in cfg.auth.metrics_keys]

    def client(self, authorization: bytes | None) -> ClientConfig | None:
        """The client whose key the ``Authorization`` header presents, or None."""
        token = bearer_token(authorization)
        if token is None or not self._clients:
            return None
        digest = _digest(token)
        found = None
        for key, client in self._clients:  # no early exit
            if hmac.compare_digest(key, digest) and found is None:
                found = client
        return found

    def may_read_metrics(self, authorization: bytes | None) -> bool:
        """``/metrics`` on the proxy port: open unless ``auth.required``; then only ``metrics_keys``."""
        if not self.required:
            return True
        token = bearer_token(authorization)
        if token is None:
            return False
        digest = _digest(token)
        return any([hmac.compare_digest(k, digest) for k in self._metrics_keys])  # all compared

    def authenticate(self, authorization: bytes | None) -> ClientConfig | Refusal | None:
        """The known client, None for an anonymous one that may pass, or a 401."""
        client = self.client(authorization)
        if client is None and self.required:
            return Refusal(401, "invalid_api_key", "a valid API key is required (Authorization: Bearer <key>)")
        return client

    def route(self, client: ClientConfig | None, header: bytes | None, model: str) -> str | Refusal:
        """The route of a request from ``client`` (None: anonymous) with ``header`` (the route
        header's raw value, if sent) for ``model``."""
        if header:
            picked, refusal = self._picked(client, header)
            if picked is not None:
                return picked
            if self.refuse_unknown:
                assert refusal is not None
                return refusal
        if client is not None:
            return client.route
        return self.model_routes.get(model, self.default_route)

    def _picked(self, client: ClientConfig | None, header: bytes) -> tuple[str | None, Refusal | None]:
        try:
            route = check_route(header.decode("utf-8"))
        except UnicodeDecodeError:
            return None, Refusal(400, "invalid_route", f"{self.header_name} is not valid UTF-8")
        except ValueError as exc:
            return None, Refusal(400, "invalid_route", f"{self.header_name}: {exc}")
        if client is not None:
            if route == client.route or route in client.allow_routes or (
                    "*" in client.allow_routes and route in self.known):
                return route, None
            return None, Refusal(403, "route_not_allowed",
                                 f"this API key may not use route {route!r} ({self.header_name})")
        if route in self.open_routes:
            return route, None
        return None, Refusal(400, "unknown_route",
                             f"route {route!r} ({self.header_name}) is not open to clients on this gateway")

    def label(self, route: str) -> str:
        """The ``route`` label on the gateway's metrics: a configured route, else ``other``."""
        return route if route in self.known else "other"
