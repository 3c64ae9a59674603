"""Prometheus metrics of the daemon, in a registry of its own (never the global one)."""

from __future__ import annotations

import contextlib
import heapq
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: bucket bounds of the reaction-time histograms (seconds)
REACTION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

#: at most this many (policy, model, route, rule) series of llmwd_rule_judged / llmwd_rule_mde
MAX_JUDGEABILITY_ROWS = 500


def _worst_first(row: dict[str, Any]) -> tuple[int, float]:
    return row["judged"], -float(row.get("mde") or row.get("horizon_mde") or 0.0)


def worst_judgeability(rows: list[dict[str, Any]], n: int = MAX_JUDGEABILITY_ROWS) -> list[dict[str, Any]]:
    """The ``n`` rows ``Metrics.set_judgeability`` exports, in its order: not judged first, then the
    largest MDEs, ties in the order given (``heapq.nsmallest`` is stable). Taken over consecutive parts
    of the rows in turn (the kept rows first, then the next part), the same rows in the same order as
    over all of them at once: a pass over every route keeps ``n`` rows, not 100k+."""
    return heapq.nsmallest(n, rows, key=_worst_first)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.events = Counter("llmwd_events_total", "Inference-log events read, by result", ["result"], registry=r)
        self.dlq = Counter("llmwd_dead_letters_total", "Invalid events sent to the dead-letter topic, by reason",
                           ["reason"], registry=r)
        self.windows_closed = Counter("llmwd_windows_closed_total", "Live windows closed", registry=r)
        self.verdicts = Counter("llmwd_actions_total", "Actions decided by the policy engine",
                                ["kind", "policy", "dry_run"], registry=r)
        self.flips = Counter("llmwd_flips_total", "Precision flags written to Redis, by result",
                             ["result"], registry=r)
        self.pending = Gauge("llmwd_pending_decisions", "Flag changes waiting for Redis", registry=r)
        self.judging_backlog_routes = Gauge("llmwd_judging_backlog_routes",
                                            "Routes whose closed windows wait to be judged", registry=r)
        self.judging_backlog_seconds = Gauge(
            "llmwd_judging_backlog_seconds", "How long the longest-waiting closed window has waited to be judged "
            "(0 when none waits)", registry=r)
        self.reading_held = Gauge(
            "llmwd_reading_held", "1 while reading from Kafka is held because judging or checkpoints run behind "
            "(what the replica cannot judge and save in time waits in Kafka, not in memory)", registry=r)
        self.lag = Gauge("llmwd_consumer_lag", "Kafka consumer lag in messages", ["partition"], registry=r)
        self.redis_up = Gauge("llmwd_redis_up", "1 when the last Redis operation succeeded", registry=r)
        self.redis_round_trip = Gauge(
            "llmwd_redis_round_trip_seconds", "Seconds the last PING took (the maintenance reader's, about every "
            "second, off the loop): the link's round trip", registry=r)
        self.kafka_up = Gauge("llmwd_kafka_up", "1 when the last Kafka poll succeeded", registry=r)
        self.policy_reloads = Counter("llmwd_policy_reloads_total", "Policy file reloads, by result",
                                      ["result"], registry=r)
        self.policies_loaded = Gauge("llmwd_policies_loaded", "Policies in force", registry=r)
        self.route_precision = Gauge("llmwd_route_precision_is_candidate",
                                     "1 when the route serves the candidate precision (fp8), 0 for baseline",
                                     ["model", "route"], registry=r)
        self.commits = Counter("llmwd_offset_commits_total", "Kafka offset commits, by result", ["result"],
                               registry=r)
        self.loop_seconds = Histogram("llmwd_loop_iteration_seconds", "Time of one main-loop iteration",
                                      buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5), registry=r)
        self.loop_busy_seconds = Histogram(
            "llmwd_loop_busy_seconds",
            "Time of one main-loop iteration less its time inside the Kafka consumer's poll call (waiting for "
            "records): the loop's own work, what stalls decisions", buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25,
                                                                           0.5, 1, 2.5, 5, 10), registry=r)
        self.gc_seconds = Histogram(
            "llmwd_gc_seconds", "One pass of the cyclic collector (the main loop runs them once per iteration; a "
            "pass on another thread stalls the loop as well), by generation: 0 young, 1 middle, 2 full",
            ["generation"], buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5), registry=r)
        self.malloc_trim_seconds = Histogram(
            "llmwd_malloc_trim_seconds", "One hand-back of the free memory inside glibc's malloc heaps to the system "
            "(malloc_trim, on the main loop every 10 s; absent where the C library has none)",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25), registry=r)
        # how long a window's verdict takes to reach Redis, from two starts (docs/OPERATIONS.md, "Reaction time")
        self.close_to_flip_seconds = Histogram(
            "llmwd_close_to_flip_seconds", "From the loop iteration in which the event-time watermark passed the "
            "window's end plus its grace (the window closed; wall clock of this replica) to the flip it caused "
            "written in Redis", buckets=REACTION_BUCKETS, registry=r)
        self.window_end_to_flip_seconds = Histogram(
            "llmwd_window_end_to_flip_seconds", "From a window's end (event time) to the flip it caused written in "
            "Redis: the out-of-order grace, the watermark's lag and the close -> flip time together",
            buckets=REACTION_BUCKETS, registry=r)
        # readiness and reliability (the metric contract in docs/OPERATIONS.md; rules in deploy/ use these names)
        self.ready = Gauge("llmwd_ready", "1 when the daemon is ready (no not-ready reason active)", registry=r)
        self.not_ready = Gauge("llmwd_not_ready", "1 per active not-ready reason", ["reason"], registry=r)
        self.loop_last = Gauge("llmwd_loop_last_timestamp_seconds", "Unix time of the last main-loop iteration",
                               registry=r)
        self.budget_exhausted = Counter("llmwd_flip_budget_exhausted_total",
                                        "Flips blocked because the policy's daily flip budget is spent",
                                        ["policy"], registry=r)
        self.ops_alerts = Counter("llmwd_ops_alerts_total", "Operational alerts raised (one per outage)",
                                  ["reason"], registry=r)
        self.checkpoints = Counter("llmwd_checkpoints_total", "Partition checkpoint saves, by result",
                                   ["result"], registry=r)
        self.checkpoint_seconds = Histogram("llmwd_checkpoint_seconds",
                                            "Time of one partition checkpoint save: building it (loop thread) and "
                                            "encoding and writing it (writer thread or loop)",
                                            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
                                            registry=r)
        self.checkpoint_loop_seconds = Histogram(
            "llmwd_checkpoint_loop_seconds",
            "Loop-thread time of one partition checkpoint save (building it; a forced save writes it there too)",
            # 0.15 and 0.2: the capacity target is a p99 of 200 ms (docs/BENCHMARKS.md); 0.25 could not show it
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.5, 1, 2.5, 5),
            registry=r)
        self.checkpoint_age = Gauge(
            "llmwd_checkpoint_age_seconds",
            "Per partition, how long since Redis last confirmed its checkpoint while it holds changes not saved "
            "(0 when it holds none): what a restart would read from Kafka again", ["partition"], registry=r)
        self.checkpoint_bytes = Gauge("llmwd_checkpoint_bytes", "Size of the last checkpoint save, per partition",
                                      ["partition"], registry=r)
        self.watermark = Gauge("llmwd_watermark_seconds", "Event-time watermark per partition (unix seconds)",
                               ["partition"], registry=r)
        self.pages = Counter("llmwd_pages_total",
                             "Alert messages per channel, by result: delivered, failed (given up after retries or "
                             "refused) or dropped (queue full, or undelivered at stop)", ["result"], registry=r)
        self.evidence = Counter("llmwd_evidence_records_total",
                                "Evidence record writes (docs/EVIDENCE.md), by result: written, failed (Redis "
                                "refused the write; retried) or dropped (too many waiting)", ["result"], registry=r)
        self.evidence_history_evictions = Counter(
            "llmwd_evidence_history_evictions_total", "Calm routes whose windows the evidence recorder dropped "
            "(more than evidence.history_routes kept); their next record says its history was cut", registry=r)
        self.channel_pages = Counter("llmwd_channel_pages_total",
                                     "Alert messages per channel, by result: delivered, failed, dropped, or retried "
                                     "(one failed attempt that will be tried again)", ["channel", "result"],
                                     registry=r)
        self.pages_backlog = Gauge("llmwd_pages_backlog", "Pages from the outbox a channel has not yet delivered "
                                   "(its Redis page stream's length)", ["channel"], registry=r)
        # what each rule can judge at its route's traffic (watchdog/policy/status.py judgeability_rows)
        self.rule_judged = Gauge("llmwd_rule_judged", "1 when the rule is judged at the route's traffic (per window "
                                 "or over its horizon), 0 when it cannot be", ["policy", "model", "route", "rule"],
                                 registry=r)
        self.rule_mde = Gauge("llmwd_rule_mde", "Minimum detectable FP8-vs-FP16 harm at the route's traffic (80 % "
                              "power; log ratio for latency, points for rates), per window or over the horizon",
                              ["policy", "model", "route", "rule", "over"], registry=r)
        self._judgeability_labels: set[tuple[str, ...]] = set()
        # bounded routes (watchdog/runtime/routes.py)
        self.routes_active = Gauge("llmwd_routes_active", "Routes (model, route) this replica keeps state for",
                                   registry=r)
        self.route_limit_events = Counter(
            "llmwd_route_limit_events_total", "Events of new routes dead-lettered (route_limit) because the "
            "partition's or the replica's route cap was reached, by cap", ["cap"], registry=r)
        for cap in ("partition", "replica"):
            self.route_limit_events.labels(cap)
        # golden signals between replicas (watchdog/runtime/golden.py)
        self.golden_stream = Counter(
            "llmwd_golden_stream_total", "Golden signal stream: replays published (by the lease holder), signals "
            "judged here (routes this replica owns), replay requests forwarded to the holder, Redis errors",
            ["result"], registry=r)
        for result in ("published", "judged", "requested", "error"):
            self.golden_stream.labels(result)
        # resident golden-replay engines (watchdog/sources/engine_cache.py)
        self.golden_engines_resident = Gauge("llmwd_golden_engines_resident",
                                             "Golden-replay engines kept loaded between scheduled replays", registry=r)
        self.golden_engine_bytes = Gauge("llmwd_golden_engine_bytes",
                                         "Memory the resident golden-replay engines report (weights and buffers)",
                                         registry=r)
        self.golden_engine_loads = Counter("llmwd_golden_engine_loads_total",
                                           "Golden-replay engines built (a model load, and its compile on first use)",
                                           registry=r)
        self.golden_engine_hits = Counter("llmwd_golden_engine_hits_total",
                                          "Golden replays that found their engine resident (no load)", registry=r)
        self.golden_engine_releases = Counter(
            "llmwd_golden_engine_releases_total", "Resident golden-replay engines released, by reason: config "
            "(the job's engine config changed), idle, bound (count or memory), stop (replaying stopped here)",
            ["reason"], registry=r)
        for reason in ("config", "idle", "bound", "stop"):
            self.golden_engine_releases.labels(reason)
        # label values known in advance start at 0, so increase() and rate() see their first event
        for result in ("delivered", "failed", "dropped"):
            self.pages.labels(result)
            self.evidence.labels(result if result != "delivered" else "written")
        for result in ("ok", "rejected"):
            self.policy_reloads.labels(result)

    def set_judgeability(self, rows: list[dict[str, Any]], max_rows: int = MAX_JUDGEABILITY_ROWS) -> None:
        """Set ``llmwd_rule_judged`` / ``llmwd_rule_mde`` from ``judgeability_rows(engine.snapshot())``.

        Bounded: at most ``max_rows`` (policy, model, route, rule) series, the rules that are not
        judged first, then the largest MDEs (what on-call needs to see); the series of rows no
        longer exported are removed. /status carries every row."""
        keep = worst_judgeability(rows, max_rows)  # not a sort of every row: 100k+ at 10k routes
        exported: set[tuple[str, ...]] = set()
        for row in keep:
            labels: tuple[str, ...] = (row["policy"], row["model"], row["route"], row["rule"])
            exported.add(labels)
            self.rule_judged.labels(*labels).set(row["judged"])
            for over, key in (("window", "mde"), ("horizon", "horizon_mde")):
                x = row.get(key)
                if x is not None:
                    self.rule_mde.labels(*labels, over).set(x)
                else:
                    self._remove(self.rule_mde, (*labels, over))
        for labels in self._judgeability_labels - exported:
            self._remove(self.rule_judged, labels)
            for over in ("window", "horizon"):
                self._remove(self.rule_mde, (*labels, over))
        self._judgeability_labels = exported

    @staticmethod
    def _remove(gauge: Gauge, labels: tuple[str, ...]) -> None:
        with contextlib.suppress(KeyError):
            gauge.remove(*labels)

    def forget_partition(self, partition: int) -> None:
        """A revoked partition's series go: the replica that owns it now exports them (two replicas
        must not both show one partition's lag and watermark)."""
        for gauge in (self.lag, self.checkpoint_bytes, self.checkpoint_age, self.watermark):
            self._remove(gauge, (str(partition),))

    def count_page(self, result: str, n: int = 1) -> None:
        """The alerter's ``on_page`` hook: ``n`` messages to one channel ``delivered``, ``failed`` or ``dropped``."""
        self.pages.labels(result).inc(n)

    def count_channel_page(self, channel: str, result: str, n: int = 1) -> None:
        """The alerter's ``on_channel_page`` hook: the same per channel (names come from the config), plus
        ``retried`` attempts, so one failing channel is visible before it gives anything up."""
        self.channel_pages.labels(channel, result).inc(n)

    def set_pages_backlog(self, backlog: dict[str, int]) -> None:
        for channel, n in backlog.items():
            self.pages_backlog.labels(channel).set(n)
