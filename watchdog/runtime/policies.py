"""The policies in force: loaded at start (invalid ones stop the daemon), reloaded while it runs.

The loader watches the policy files off the main loop; the loop polls it every ``policy_poll_s`` and
swaps a valid edit into the engine (``PolicyEngine.set_policy_set`` keeps the state of unchanged
rules). SIGHUP asks for a reload now (``request``, safe from a signal handler). A rejected edit leaves
the last good policies in force and raises one ops alert naming file:line:col. A policy whose
``actions.notify``/``page`` names a channel the daemon does not have is invalid like any other.
"""

from __future__ import annotations

import logging
import threading

from watchdog.alerting.alerter import Alerter
from watchdog.config.settings import Config
from watchdog.core.metrics import Metrics
from watchdog.policy import PolicyEngine, PolicyLoader

log = logging.getLogger(__name__)


class PolicyReloader:
    def __init__(self, cfg: Config, metrics: Metrics, alerter: Alerter) -> None:
        self.poll_s = cfg.policy_poll_s
        self.metrics = metrics
        self.alerter = alerter
        # a policy may route its alerts to the daemon's channels only (none configured: nothing is sent,
        # no name is checked); reloads run off the main loop
        channels = alerter.channel_names() or None
        # PolicyError on invalid policies: the caller reports it once, as a start-up failure
        self.loader = PolicyLoader(cfg.policies, background=True, channels=channels, precisions=cfg.precisions,
                                   raise_at_start=True, settle_s=cfg.policy_poll_s)
        self.loader.on_error = self._rejected
        self.engine = PolicyEngine(self.loader.policy_set)
        self._requested = threading.Event()
        self._last_check = 0.0
        self.metrics.policies_loaded.set(len(self.loader.policy_set.policies))

    def request(self) -> None:
        """Safe from a signal handler: the main loop re-reads the policy files next iteration."""
        self._requested.set()

    def reload(self) -> None:
        """Re-read the policy files now."""
        if self.loader.reload():
            self._apply()

    def check(self, now: float) -> None:
        """Called by the main loop: a requested reload, or a poll of the files every ``poll_s``."""
        if self._requested.is_set():
            self._requested.clear()
            self.reload()
            return
        if now - self._last_check < self.poll_s:
            return
        self._last_check = now
        if self.loader.check():
            self._apply()

    def _apply(self) -> None:
        self.engine.set_policy_set(self.loader.policy_set)
        self.metrics.policy_reloads.labels("ok").inc()
        self.metrics.policies_loaded.set(len(self.loader.policy_set.policies))
        self.alerter.ops_resolve("policy-reload")
        log.info("policies reloaded: %d in force", len(self.loader.policy_set.policies))

    def _rejected(self, errors: list[str]) -> None:
        self.metrics.policy_reloads.labels("rejected").inc()
        log.error("policy edit rejected, previous policies stay in force:\n%s", "\n".join(errors))
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        first = errors[0] if errors else "unknown error"  # starts with file:line:col
        self.alerter.ops_alert("policy-reload", f"policy edit rejected: {first}{more}; the last good policies "
                               "stay in force", "warning", {"errors": errors[:20]})
