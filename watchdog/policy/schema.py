"""Typed policy model (pydantic). Structure only; cross-field checks with file positions live in
``loader.py`` so that every message can point at a line and column."""

from __future__ import annotations

import difflib
import fnmatch
import functools
import math
import re
from collections.abc import Callable
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    model_validator,
)

from watchdog.core.durations import MAX_DURATION_S
from watchdog.core.signals import Severity
from watchdog.policy.conditions import Condition, parse_condition
from watchdog.policy.names import clean_glob, clean_name

#: Metric names a live window may carry (see docs/ARCHITECTURE.md).
LIVE_METRICS = (
    "error_rate",
    "timeout_rate",
    "latency_p50_ms",
    "latency_p95_ms",
    "latency_p99_ms",
    "ttft_p99_ms",
    "tokens_per_s",
    "empty_rate",
    "mean_completion_tokens",
    "perplexity",
    "shadow_rougeL",
    "shadow_bleu",
)

#: live metrics a ``rate`` judge can test, and where their counts sit in ``Signal.detail``:
#: metric -> (detail keys summed into the numerator, detail key of the denominator)
RATE_COUNTS: dict[str, tuple[tuple[str, ...], str]] = {
    "error_rate": (("errors", "timeouts"), "events"),
    "timeout_rate": (("timeouts",), "events"),
    "empty_rate": (("empty",), "completions"),
}
#: rate metrics whose failures the windows count per replica (``Rule.replica_failures``): metric -> the
#: positions in a ``replica_fails`` entry ([ok, errors, timeouts]) summed into its numerator
REPLICA_RATES: dict[str, tuple[int, ...]] = {"error_rate": (1, 2), "timeout_rate": (2,)}
#: live metrics a ``mann_whitney`` judge can test (it compares the windows' latency sketches)
LATENCY_METRICS = ("latency_p50_ms", "latency_p95_ms", "latency_p99_ms")
#: default minimum number of items/requests per judge test
JUDGE_MIN_ITEMS = {"paired": 30, "mann_whitney": 50, "rate": 100, "quantile": 200}
#: most live windows a judged rule may pool (the engine keeps this many sketches/counts per rule)
MAX_POOL_WINDOWS = 24
#: most golden replays a paired rule may pool (judge_paired_replays looks at the latest two)
MAX_REPLAYS = 2
#: most healthy windows a live judged rule keeps as its learned null (``judge.learn``)
MAX_LEARN_WINDOWS = 288
#: latency rules with ``settle``: the default ``build_hold`` (windows; 12 hours of 5-minute windows)
#: and its largest value (a week)
DEFAULT_BUILD_HOLD = 144
MAX_BUILD_HOLD = 2016
#: per-metric sample counts in a live window's ``Signal.detail``: what ``min_samples`` counts
#: for that metric (other metrics count ``Signal.samples``, the window's events)
SAMPLE_COUNTS: dict[str, str] = {
    "shadow_rougeL": "shadow_pairs",
    "shadow_bleu": "shadow_pairs",
    "perplexity": "logprob_tokens",
    "empty_rate": "completions",
    "ttft_p99_ms": "ttft_count",
}
#: GPU signal values that, when > 0, explain a candidate's drop better than the precision does
DEFAULT_GPU_CAUSES = ("critical", "xid_critical", "thermal_slowdown", "hw_slowdown", "gpu_lost")

_LOWER_HINTS = ("latency", "ttft", "_rate", "perplexity", "ppl", "_ms", "error", "timeout")


def metric_direction(metric: str) -> Literal["higher_is_better", "lower_is_better"]:
    """Best guess of a metric's direction for cause attribution when a rule does not say."""
    return "lower_is_better" if any(h in metric for h in _LOWER_HINTS) else "higher_is_better"


# Parsing is pure, so one parse per distinct condition text is enough.
_parse_cached = functools.lru_cache(maxsize=4096)(parse_condition)

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")


def parse_duration(value: object) -> float:
    """``"90s"``, ``"5m"``, ``"1h30m"``, ``"2d"`` or a number of seconds -> seconds."""
    total = _parse_duration(value)
    if not 0 <= total <= MAX_DURATION_S:  # also false for NaN
        raise ValueError(f"duration {value!r} is out of range: 0 to {MAX_DURATION_S / 86400:.0f} days")
    return total


def _parse_duration(value: object) -> float:
    if isinstance(value, bool):
        raise ValueError(f"bad duration {value!r}: use e.g. 30s, 5m, 1h, 1d")
    if isinstance(value, int | float):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"a duration must be a finite number, not {value!r}")
        if value < 0:
            raise ValueError("a duration cannot be negative")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"bad duration {value!r}: use e.g. 30s, 5m, 1h, 1d")
    text = value.strip().replace(" ", "")
    if text == "0":
        return 0.0
    pos, total = 0, 0.0
    for m in _DURATION_RE.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if pos != len(text) or not text:
        raise ValueError(f"bad duration '{value}': use e.g. 30s, 5m, 1h30m, 1d")
    return total


Duration = Annotated[float, BeforeValidator(parse_duration)]
#: names are NFKC-normalised and refused with the culprit named when they hold a confusable letter
Name = Annotated[str, BeforeValidator(clean_name),
                 Field(min_length=1, max_length=120, pattern=r"^[A-Za-z0-9_.:/-]+$")]
#: most globs in one scope list: matching compiles them once into one expression
MAX_SCOPE_GLOBS = 10_000
Glob = Annotated[str, BeforeValidator(clean_glob), Field(min_length=1, max_length=512)]
Globs = Annotated[list[Glob], Field(max_length=MAX_SCOPE_GLOBS)]


class _Strict(BaseModel):
    # allow_inf_nan=False: every float field must be finite (.nan/.inf would switch a limit off)
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True, allow_inf_nan=False)


def _compile_globs(globs: list[str]) -> Callable[[str], bool]:
    """One matcher for a list of shell globs, built once: literal names in a set, ``prefix*`` globs
    in one ``str.startswith`` tuple, the rest in one regex (``fnmatch`` caches 32,768 patterns; past
    that every match would recompile them)."""
    def meta(text: str) -> bool:
        return any(c in text for c in "*?[")

    literal = frozenset(g for g in globs if not meta(g))
    prefixes = tuple(sorted({g[:-1] for g in globs if g.endswith("*") and not meta(g[:-1])}))
    wild = [g for g in globs if meta(g) and not (g.endswith("*") and not meta(g[:-1]))]
    if "" in prefixes:  # "*"
        return lambda name: True
    match = re.compile("|".join(fnmatch.translate(g) for g in wild)).match if wild else None

    def covers(name: str) -> bool:
        return (name in literal or (bool(prefixes) and name.startswith(prefixes))
                or (match is not None and match(name) is not None))

    return covers


class Scope(_Strict):
    """Which (model, route) pairs a policy covers; shell-style globs (``*``, ``?``, ``[ab]``)."""

    models: Globs = Field(default_factory=lambda: ["*"])
    routes: Globs = Field(default_factory=lambda: ["*"])
    exclude_models: Globs = Field(default_factory=list)
    exclude_routes: Globs = Field(default_factory=list)
    _match: tuple[Callable[[str], bool], ...] = PrivateAttr(default=())

    def model_post_init(self, _context: object) -> None:
        self._match = tuple(_compile_globs(g) for g in
                            (self.models, self.routes, self.exclude_models, self.exclude_routes))

    def covers(self, model: str, route: str) -> bool:
        models, routes, ex_models, ex_routes = self._match
        return models(model) and routes(route) and not ex_models(model) and not ex_routes(route)


class Broken(_Strict):
    """Concentrated-damage test of a paired rule (watchdog.policy.judge.paired.judge_broken): the share of items
    whose harm exceeds ``drop`` against the baseline's own share in A/A replays plus ``null_share``
    (FP8's tolerated sensitivity); without A/A replays ``null_share`` as if measured on
    ``null_items`` items (docs/JUDGE.md, "Concentrated damage")."""

    drop: Annotated[float, Field(gt=0)] = 0.2
    effect: Annotated[float, Field(ge=0, lt=1)] = 0.02
    null_share: Annotated[float, Field(ge=0, lt=1)] = 0.02
    null_items: Annotated[int, Field(ge=1)] = 500
    #: error rate of this test per evaluation, taken from the judge's alpha (the mean-drift test
    #: gets the rest); default half of it
    alpha: Annotated[float, Field(gt=0, lt=0.5)] | None = None


class Horizon(_Strict):
    """Judge a live rule over a longer horizon as well: an always-valid sequential test (mixture
    SPRT, watchdog/policy/judge/sequential.py) of "FP8 - FP16 > tolerance" that accumulates every
    window's difference, whatever its traffic (no ``min_samples``), so a low-traffic or lopsided
    route is judged over hours instead of never, and a route that starts (or restarts without
    state) with FP8 already beyond the tolerance is caught without a warm-up."""

    #: false-alarm probability of one sequential test over its whole life (any number of looks);
    #: a test starts every ``restart`` windows, so false alarms stay below alpha / restart per window
    alpha: Annotated[float, Field(gt=0, lt=0.5)] = 0.001
    #: absolute tolerance (harm units: log ratio for latency, rate points for rates): FP8 worse
    #: than FP16 by more than this is a regression while the route has no learned level (a new
    #: route, a restart without state, a route too thin for its per-window judge). Default: ``effect``
    tolerance: Annotated[float, Field(ge=0)] | None = None
    #: the tolerance once the rule's learned null holds ``learn_min`` healthy windows (default: the
    #: judge's ``level_cap``, else ``tolerance``): replica offsets up to the learned level's cap are
    #: normal on a route whose healthy level is known, FP8 worse than this never is
    learned_tolerance: Annotated[float, Field(ge=0)] | None = None
    #: prior sd of the window-to-window variation added to each window's sampling variance
    #: (default: the judge's ``between_sd``)
    between_sd: Annotated[float, Field(ge=0)] | None = None
    #: scale of the half-normal mixture over the excess (default: the tolerance, at least between_sd)
    mixture_sd: Annotated[float, Field(gt=0)] | None = None
    #: a new test starts every this many windows
    restart: Annotated[int, Field(ge=1, le=288)] = 12
    #: a test is dropped after this many windows (its horizon)
    windows: Annotated[int, Field(ge=2, le=2016)] = 288
    #: one window counts at most this many sd beyond the tolerance (bounded influence: a
    #: one-window burst that ``for`` dismisses cannot roll back through the horizon); 0: no bound
    max_step_sd: Annotated[float, Field(ge=0)] = 3.0


class Anchor(_Strict):
    """A long-term anchor of a learned null (watchdog/policy/judge/anchor.py): a slowly updated,
    persisted reference of the healthy level; the level the null credits never exceeds
    ``anchor + tolerance``, so a slow creep cannot become the route's level."""

    #: how far above the anchor the learned level may sit (harm units)
    tolerance: Annotated[float, Field(ge=0)]
    #: half-life of the anchor's exponential average, in passing windows (2016 = a week of 5 min);
    #: it never moves more than ``tolerance`` per half-life
    halflife: Annotated[int, Field(ge=24, le=100_000)] = 2016


class Judge(_Strict):
    """A statistical test of candidate vs baseline (watchdog/policy/judge/paired.py) in place of, or on top of,
    a plain ``fail_if`` threshold."""

    test: Literal["paired", "mann_whitney", "rate", "quantile"]
    #: default: higher_is_better for paired, lower_is_better for mann_whitney and rate
    direction: Literal["higher_is_better", "lower_is_better"] | None = None
    #: largest harmful drift tolerated: metric units (paired), relative (mann_whitney: 0.10 = 10 %
    #: slower), absolute rate points (rate: 0.01 = 1 point)
    effect: Annotated[float, Field(ge=0)]
    #: drift above which a significant harm within ``effect`` is marginal (default 0)
    marginal: Annotated[float, Field(ge=0)] | None = None
    alpha: Annotated[float, Field(gt=0, lt=0.5)] = 0.01
    #: fewer items (paired) / requests per precision (mann_whitney, rate) -> inconclusive
    min_items: Annotated[int, Field(ge=1)] | None = None
    method: Literal["t", "bootstrap", "signed_rank"] = "t"
    #: paired ``t``: two pseudo-items at +/- this (metric units) as a prior on the spread
    prior_jump: Annotated[float, Field(ge=0)] = 0.5
    #: paired: also judge how many items broke (concentrated damage)
    broken: Broken | None = None
    #: paired: the mean test's alpha when the replay's A/A pass shows the baseline's answers moving
    #: by themselves (sampled serving: every replay is a fresh draw, so a rule checked every replay
    #: false-alarms at its nominal rate; 0.0002 keeps the harmful tail at 1e-4 per replay)
    sampled_alpha: Annotated[float, Field(gt=0, lt=0.5)] = 0.0002
    #: what an interval that straddles ``effect`` is: ``marginal`` (default: not shown to be
    #: within it - breaks the healthy count) or ``pass`` (a rollback guard at a small alpha:
    #: not shown to be beyond it is healthy)
    straddle: Literal["marginal", "pass"] = "marginal"
    #: quantile test: which quantile of the latency sketches (0.99 = p99)
    q: Annotated[float, Field(gt=0, lt=1)] = 0.99
    #: quantile test: compare the mean log latency above this quantile instead of the ``q`` point
    #: (the upper-tail mean: p99-aware with several times less noise; e.g. 0.9)
    tail: Annotated[float, Field(ge=0, lt=1)] | None = None
    #: quantile test with ``tail``: judge the tail mean minus the mean log latency of the same
    #: precision (the distribution's shape: replica, load and speed-up effects that scale every
    #: request cancel), FP8 minus FP16
    relative_to: Literal["mean"] | None = None
    #: learned null: ``residual`` (the history's residual variance, t on its degrees of freedom)
    #: or ``sampling`` (the windows' stated sampling variance plus the learned excess over it)
    null_model: Literal["residual", "sampling"] = "residual"
    #: live: judge against a null learned from the last ``learn`` healthy windows of the rule
    #: (watchdog/policy/judge/live.py); null = an absolute comparison with ``between_sd`` added
    learn: Annotated[int, Field(ge=8, le=MAX_LEARN_WINDOWS)] | None = None
    #: learned level credited at most this far on the harmful side (harm units; default: effect):
    #: a golden set's healthy FP8 may sit a little below FP16 on a route, a regression may not
    level_cap: Annotated[float, Field(ge=0)] | None = None
    #: learned null: this many healthy windows before it is used (before: absolute comparison)
    learn_min: Annotated[int, Field(ge=4)] = 24
    #: learned null: the level is the mean of the last ``recent`` healthy windows
    recent: Annotated[int, Field(ge=1, le=48)] = 6
    #: prior sd of the between-window variation of the difference (harm units: log ratio for
    #: latency, rate points for rates); default 0.03 for latency tests, 0.002 for rates
    between_sd: Annotated[float, Field(ge=0)] | None = None
    #: prior sd of the FP8 - FP16 level while the null warms up (before ``learn_min`` windows;
    #: harm units; default: ``between_sd``): a replica offset spreads the level more than it
    #: moves one window from the next
    level_sd: Annotated[float, Field(ge=0)] | None = None
    #: interval wider than this -> inconclusive (thin evidence)
    max_ci_width: Annotated[float, Field(gt=0)] | None = None
    #: live rules (mann_whitney, rate): judge the sum of the last ``pool`` windows' latency sketches
    #: or counts (judge_unpaired_pooled / judge_rate_pooled); a fresh pool starts after every flip
    pool: Annotated[int, Field(ge=1, le=MAX_POOL_WINDOWS)] | None = None
    #: golden rules (paired): judge the latest ``replays`` replays of the same items with two looks
    #: (judge_paired_replays: the latest alone, then the per-item mean of the latest two)
    replays: Annotated[int, Field(ge=1, le=MAX_REPLAYS)] | None = None
    #: live latency (``test: quantile``, ``tail: 0.0``): compare FP8 with FP16 within request-mix
    #: cells (octaves of prompt and completion tokens), so a router that sends one precision more
    #: long prompts is not a regression (watchdog/policy/judge/fleet.py); windows without the
    #: ``latency_mix`` detail are judged unadjusted. With ``tail: p, relative_to: mean``: the tail
    #: contrast of each precision's latency standardised to common cell weights (``mix_tail_contrast``);
    #: windows without per-cell tails, or with a replica left out, are judged on the plain contrast
    adjust: Literal["mix"] | None = None
    #: live latency: leave a precision's upward-outlier replica (a stall) out of the window before
    #: judging (needs the windows' ``replicas`` detail; without it the window is judged whole)
    replicas: Literal["robust"] | None = None
    #: live latency (``test: quantile``): judge a window only when the two precisions saw comparable
    #: request mixes - the mix moves the FP8 - FP16 mean log latency (unadjusted minus within-cell)
    #: by at most this much (log units); else the window is inconclusive (a shape statistic such as
    #: the tail contrast cannot be compared like with like across different mixes)
    max_mix_shift: Annotated[float, Field(gt=0)] | None = None
    #: live judged rules: after a build change on either precision or an operator maintenance
    #: annotation, judge nothing (and learn nothing) until this many windows passed without a further
    #: change; then judge against the level learned before it (watchdog/policy/changes.py)
    settle: Annotated[int, Field(ge=1, le=MAX_POOL_WINDOWS)] | None = None
    #: latency rules with ``settle``: while FP8 and FP16 run different named builds (one each), judge
    #: nothing for at most this many windows (default ``DEFAULT_BUILD_HOLD``; 0: never hold), then
    #: judge anyway - an FP8-only build is judged that late (watchdog/policy/changes.py)
    build_hold: Annotated[int, Field(ge=0, le=MAX_BUILD_HOLD)] | None = None

    @model_validator(mode="after")
    def _fleet_options(self) -> Judge:
        if self.adjust is not None and not (self.test == "quantile" and (
                (self.tail == 0.0 and self.relative_to is None) or (self.tail and self.relative_to == "mean"))):
            raise ValueError("adjust: mix needs test: quantile with tail: 0.0 (the mean log latency) or with "
                             "tail: p and relative_to: mean (the tail contrast)")
        if (self.replicas is not None or self.max_mix_shift is not None) and self.test != "quantile":
            raise ValueError("replicas and max_mix_shift need test: quantile")
        if self.settle is not None and not (self.test == "quantile" or (self.test != "paired" and self.learn)):
            raise ValueError("settle is for learned live rules (test: quantile, or a live test with learn)")
        if self.build_hold is not None and not self._settled_latency:
            raise ValueError("build_hold is for latency rules with settle (test: quantile or mann_whitney)")
        return self
    #: live: also judge over a longer horizon (always-valid sequential test against a tolerance)
    horizon: Horizon | None = None
    #: live, learned null: cap the learned level at a long-term anchor + tolerance
    anchor: Anchor | None = None

    @property
    def horizon_tolerance(self) -> float:
        """The horizon test's absolute tolerance (``horizon.tolerance``, else ``effect``)."""
        assert self.horizon is not None
        return self.horizon.tolerance if self.horizon.tolerance is not None else self.effect

    def horizon_tolerance_at(self, learned: bool) -> float:
        """The horizon test's tolerance before (``learned`` False) or after the null is learned."""
        assert self.horizon is not None
        if not learned:
            return self.horizon_tolerance
        if self.horizon.learned_tolerance is not None:
            return self.horizon.learned_tolerance
        return max(self.horizon_tolerance, self.level_cap if self.level_cap is not None else 0.0)

    @property
    def horizon_between_sd(self) -> float:
        assert self.horizon is not None
        return self.horizon.between_sd if self.horizon.between_sd is not None else self.prior_sd

    @property
    def horizon_mixture_sd(self) -> float:
        assert self.horizon is not None
        if self.horizon.mixture_sd is not None:
            return self.horizon.mixture_sd
        return max(self.horizon_tolerance, self.horizon_between_sd, 1e-3)

    @property
    def _settled_latency(self) -> bool:
        """A latency rule with ``settle``: the only kind ``build_hold`` applies to."""
        return self.settle is not None and self.test in ("quantile", "mann_whitney")

    @property
    def hold(self) -> int:
        """Windows a latency rule with ``settle`` holds while the precisions run different builds
        (``build_hold``, else ``DEFAULT_BUILD_HOLD``); 0 for every other rule (rates are not confounded
        by a build's speed)."""
        if not self._settled_latency:
            return 0
        return DEFAULT_BUILD_HOLD if self.build_hold is None else self.build_hold

    @property
    def harm_direction(self) -> Literal["higher_is_better", "lower_is_better"]:
        if self.direction is not None:
            return self.direction
        return "higher_is_better" if self.test == "paired" else "lower_is_better"

    @property
    def min_n(self) -> int:
        return self.min_items if self.min_items is not None else JUDGE_MIN_ITEMS[self.test]

    @property
    def prior_sd(self) -> float:
        if self.between_sd is not None:
            return self.between_sd
        return 0.002 if self.test == "rate" else 0.03

    @property
    def broken_alpha(self) -> float:
        """The broken-items test's share of ``alpha`` (``broken.alpha``, else half)."""
        assert self.broken is not None
        return self.broken.alpha if self.broken.alpha is not None else self.alpha / 2

    @property
    def mean_alpha(self) -> float:
        """The mean-drift test's share of ``alpha``: what the broken-items test leaves."""
        return self.alpha - self.broken_alpha if self.broken is not None else self.alpha

    @property
    def history(self) -> int:
        """How many windows (live) or replays (golden) the rule judges together; 1 = this one alone."""
        return (self.replays if self.test == "paired" else self.pool) or 1


class Rule(_Strict):
    name: Name
    description: str = ""
    source: Literal["live", "golden", "gpu"] = "live"
    metric: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z_][A-Za-z0-9_.:-]*$")]
    #: the rule FAILS when this condition is true (with ``judge``: a fail also needs it true)
    fail_if: str | None = None
    judge: Judge | None = None
    #: a failing critical judged rule is not Holm-adjusted with the others: it fails alone
    critical: bool = False
    #: while rolled back, a window counts toward the restore only when this is true as well
    restore_if: str | None = None
    #: suspicion -> confirm: a trip asks for a golden replay and rolls back only when a golden
    #: rule then trips, or when this rule keeps failing ``confirm_timeout`` more windows
    confirm_with: Literal["golden"] | None = None
    confirm_timeout: Annotated[int, Field(ge=1)] = 6
    min_samples: Annotated[int, Field(ge=0)] = 1
    #: live error and timeout rates (``fail_if`` and ``judge: {test: rate}``): ``leave_out`` counts a
    #: precision's rate without a replica that failed on its own - a crash or an out-of-memory restart,
    #: its failure share far beyond the rest of its precision's (watchdog/policy/pooling.py
    #: ``failing_replicas``); needs 3 or more replicas on that precision and the windows' ``replica_fails``
    replica_failures: Literal["count", "leave_out"] = "count"
    for_: Annotated[int, Field(alias="for", ge=1)] = 1
    #: consecutive error verdicts (the source failed) that count as a trip; null = errors never trip
    errors_trip_after: Annotated[int, Field(ge=1)] | None = 3
    severity: Severity = "warning"
    action: Literal["rollback", "alert"] = "alert"

    @property
    def condition(self) -> Condition | None:
        return None if self.fail_if is None else _parse_cached(self.fail_if)

    @property
    def restore_condition(self) -> Condition | None:
        return None if self.restore_if is None else _parse_cached(self.restore_if)

    @property
    def direction(self) -> Literal["higher_is_better", "lower_is_better"]:
        return self.judge.harm_direction if self.judge is not None else metric_direction(self.metric)


class Promote(_Strict):
    mode: Literal["manual", "auto"] = "manual"
    healthy_windows: Annotated[int, Field(ge=1)] = 10
    #: time since the rollback before an automatic promote may happen
    after: Duration = 1800.0
    #: only windows of these sources count as healthy (e.g. [golden]: N passing replays); a
    #: failing window of any source still resets the count. Default: every source
    healthy_sources: list[Literal["live", "golden", "gpu"]] | None = None


def _per_state(value: object) -> object:
    if isinstance(value, dict):
        return value
    return {"candidate": value, "baseline": value}


class MinTime(_Strict):
    """Least time a route stays at a precision before the engine flips it again."""

    candidate: Duration = 0.0
    baseline: Duration = 0.0

    def of(self, serving: str | None, policy_candidate: str) -> float:
        return self.candidate if serving == policy_candidate else self.baseline


class Combine(_Strict):
    """How the non-critical judged rules of one window are combined (watchdog.policy.judge.paired.combine)."""

    method: Literal["holm", "none"] = "holm"
    alpha: Annotated[float, Field(gt=0, lt=0.5)] = 0.01
    #: this many non-critical judged rules must fail together for any of them to fail
    k: Annotated[int, Field(ge=1)] = 1


def _gpu_metric(name: str) -> str:
    """A GPU signal value's name (``probes.gpu.SIGNAL_REDUCE``): an unknown or confusable name
    would silently match nothing."""
    from probes.gpu import SIGNAL_REDUCE

    if name not in SIGNAL_REDUCE:
        close = difflib.get_close_matches(name, list(SIGNAL_REDUCE), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown GPU metric {name!r}{hint}; known: {', '.join(sorted(SIGNAL_REDUCE))}")
    return name


class Inhibit(_Strict):
    """Cause-aware inhibition: alert with the cause instead of rolling back."""

    #: the baseline degraded too in the same window (vs the last passing window): input shift
    input_shift: bool = True
    #: the baseline's degradation must be at least this fraction of the candidate's
    shared_fraction: Annotated[float, Field(gt=0)] = 0.5
    #: a GPU signal of the route shows a problem: gpu_health
    gpu: bool = True
    gpu_metrics: list[Annotated[str, AfterValidator(_gpu_metric)]] = Field(
        default_factory=lambda: list(DEFAULT_GPU_CAUSES))
    #: a GPU reading older than this no longer explains anything
    gpu_max_age: Duration = 600.0


class Actions(_Strict):
    """Alert routing: the names of the daemon's alert channels (``alerts: channels:``) that get this
    policy's messages, passed to the alerter in ``Action.detail['routing']``. Both empty: every
    channel. A name no channel has is rejected when the daemon loads the policy."""

    #: channels for every message of the policy's incidents
    notify: list[str] = Field(default_factory=list)
    #: extra channels for its critical messages (every real rollback, critical alerts, and the
    #: resolve of an incident that was critical)
    page: list[str] = Field(default_factory=list)

    @property
    def routed(self) -> bool:
        """The policy names channels (else its messages go to every channel)."""
        return bool(self.notify or self.page)

    def channels(self, severity: str) -> list[str]:
        out = list(self.notify)
        if severity == "critical":
            out += [c for c in self.page if c not in out]
        return out


class Policy(_Strict):
    name: Name
    description: str = ""
    scope: Scope = Field(default_factory=Scope)
    candidate: Name = "fp8"
    baseline: Name = "fp16"
    rules: Annotated[list[Rule], Field(min_length=1)]
    actions: Actions = Field(default_factory=Actions)
    dry_run: bool = False
    cooldown: Duration = 300.0
    #: a duration for both states, or {candidate: 5m, baseline: 30m}
    min_time_in_state: Annotated[MinTime, BeforeValidator(_per_state)] = Field(default_factory=MinTime)
    max_flips_per_day: Annotated[int, Field(ge=0)] = 6
    promote: Promote = Field(default_factory=Promote)
    combine: Combine = Field(default_factory=Combine)
    inhibit: Inhibit = Field(default_factory=Inhibit)

    def rule(self, name: str) -> Rule | None:
        return next((r for r in self.rules if r.name == name), None)


class PolicyFile(_Strict):
    policies: Annotated[list[Policy], Field(min_length=1)]
