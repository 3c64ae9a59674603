"""Resident golden-replay engines: built once, kept loaded and compiled between scheduled replays.

A golden job replays every hour or so; building its engines anew each time pays two model loads,
the FP8 quantisation and the ``torch.compile`` + CUDA-graph warm-up on the GPU it shares with
serving. ``EngineCache`` keeps them instead, keyed by the engine config:

* **key**: the engine options (``probes.engines.get_engine`` keyword arguments) as canonical JSON,
  plus a fingerprint of the files they name (``model_path``, ``calibration``: name, size, mtime of
  the top-level files), so a re-calibrated or replaced model is a new key, not a stale hit;
* **bounded**: at most ``max_engines`` resident and, where engines report ``memory_bytes()``, at
  most ``max_bytes`` together; least recently used first out, never one the running replay holds;
* **released** when a job's config changes (the engines its previous config used and no other job
  uses go at once), when unused for ``idle_s`` (``sweep``, called from the daemon's loop), and all
  of them when the replica stops replaying (``close``: lease lost, shutdown);
* one replay at a time holds the cache (``lease``): the engines share one GPU and an engine is not
  safe to drive from two threads at once.

Metrics (``watchdog.core.metrics.Metrics``): ``llmwd_golden_engines_resident`` (and their bytes),
``llmwd_golden_engine_loads_total``, ``llmwd_golden_engine_hits_total``,
``llmwd_golden_engine_releases_total{reason}``.

Pure bookkeeping over a ``build(options) -> engine`` function: no torch here (the default build
imports ``probes.engines`` lazily), and the clock is ``time.monotonic`` unless a test passes one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from probes.engines.model_path import files_fingerprint
from watchdog.core.metrics import Metrics

log = logging.getLogger(__name__)

#: engine options naming files whose change makes a new engine (checked by size and mtime)
FILE_OPTIONS = ("model_path", "calibration")
#: at most this many files of a directory are fingerprinted (a model directory has a handful)
MAX_FINGERPRINT_FILES = 64

BuildFn = Callable[[dict[str, Any]], Any]


class EngineBuildError(Exception):
    """The engine of ``configs[index]`` of a lease could not be built (``__cause__``: why)."""

    def __init__(self, index: int, options: Mapping[str, Any], cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.index = index
        self.options = dict(options)


def _default_build(options: dict[str, Any]) -> Any:
    from probes.engines import get_engine

    return get_engine(**options)


def fingerprint(options: Mapping[str, Any]) -> list[Any]:
    """(option, file name, size, mtime_ns) of the files the options name; [] when none exist."""
    out: list[Any] = []
    for opt in FILE_OPTIONS:
        value = options.get(opt)
        if not isinstance(value, str | os.PathLike):
            continue
        try:
            out.extend([opt, *entry] for entry in files_fingerprint(value, MAX_FINGERPRINT_FILES))
        except OSError:
            out.append([opt, str(Path(value)), None, None])
    return out


def engine_key(options: Mapping[str, Any]) -> str:
    """The cache key of one engine config: canonical JSON of the options and their files' fingerprint."""
    return json.dumps({"options": dict(options), "files": fingerprint(options)}, sort_keys=True, default=str)


@dataclass
class _Resident:
    key: str
    engine: Any
    bytes: int
    last_used: float
    hits: int = 0
    owners: set[str] = field(default_factory=set)


def _engine_bytes(engine: Any) -> int:
    fn = getattr(engine, "memory_bytes", None)
    try:
        return int(fn()) if callable(fn) else 0
    except Exception:  # noqa: BLE001 - a size we cannot read counts as 0, the engine count still bounds
        return 0


class EngineCache:
    def __init__(self, build: BuildFn = _default_build, *, max_engines: int = 4, max_bytes: int | None = None,
                 idle_s: float | None = 5400.0, metrics: Metrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_engines < 1:
            raise ValueError("max_engines must be at least 1")
        self.build = build
        self.max_engines = max_engines
        self.max_bytes = max_bytes
        self.idle_s = idle_s
        self.metrics = metrics
        self.clock = clock
        self._engines: OrderedDict[str, _Resident] = OrderedDict()  # least recently used first
        #: owner (job name) -> the keys its last replay used
        self._owned: dict[str, set[str]] = {}
        self._lock = threading.Lock()
        #: close() came while a replay held the cache: release everything when it ends
        self._close_pending: str | None = None
        self.loads = 0
        self.hits = 0
        self.releases: dict[str, int] = {}

    # -- the replay's view ------------------------------------------------------------------------
    @contextlib.contextmanager
    def lease(self, owner: str, configs: Sequence[Mapping[str, Any]]) -> Iterator[list[Any]]:
        """The engines of ``configs`` (built or resident), held for one replay by ``owner``.

        Engines ``owner`` used last time under another config and that no other owner uses are
        released first (a config change frees its GPU memory before the new engines load). An
        engine that fails to build raises ``EngineBuildError`` naming its config here; engines built
        before it stay resident."""
        with self._lock:
            keys = [engine_key(c) for c in configs]
            stale = self._owned.get(owner, set()) - set(keys)
            self._owned[owner] = set(keys)
            for key in stale:
                if not any(key in ks for o, ks in self._owned.items() if o != owner):
                    self._release(key, "config")
                elif key in self._engines:
                    self._engines[key].owners.discard(owner)
            # FP8 engines built last: one over the model files an unquantised engine just loaded quantises
            # that engine's weights instead of reading them again (probes.engines.torch_engine.load_model)
            order = sorted(range(len(keys)), key=lambda i: configs[i].get("precision") == "fp8")
            built = {i: self._build(i, keys[i], configs[i], owner) for i in order}
            engines = [built[i] for i in range(len(keys))]
            self._bound(keep=set(keys))
            try:
                yield engines
            finally:
                now = self.clock()
                for key in keys:
                    r = self._engines.get(key)
                    if r is not None:
                        r.last_used = now
                if self._close_pending is not None:
                    self._release_all(self._close_pending)
                self._publish()

    def _build(self, index: int, key: str, options: Mapping[str, Any], owner: str) -> Any:
        try:
            return self._get(key, dict(options), owner)
        except Exception as exc:  # noqa: BLE001 - any build failure (bad path, OOM, refused) names its engine
            raise EngineBuildError(index, options, exc) from exc

    def _get(self, key: str, options: dict[str, Any], owner: str) -> Any:
        r = self._engines.get(key)
        if r is not None:
            self._engines.move_to_end(key)
            r.hits += 1
            r.owners.add(owner)
            self.hits += 1
            if self.metrics is not None:
                self.metrics.golden_engine_hits.inc()
            return r.engine
        started = time.perf_counter()
        engine = self.build(options)
        self.loads += 1
        if self.metrics is not None:
            self.metrics.golden_engine_loads.inc()
        size = _engine_bytes(engine)
        self._engines[key] = _Resident(key, engine, size, self.clock(), owners={owner})
        log.info("golden engine %s loaded in %.1f s (%.2f GB resident)", getattr(engine, "name", "?"),
                 time.perf_counter() - started, size / 1e9)
        self._publish()
        return engine

    # -- bounds -----------------------------------------------------------------------------------
    def _bound(self, keep: set[str]) -> None:
        """Evict least recently used engines (never those in ``keep``) past the count or byte bound."""
        def over() -> bool:
            total = sum(r.bytes for r in self._engines.values())
            return len(self._engines) > self.max_engines or (self.max_bytes is not None and total > self.max_bytes)

        for key in list(self._engines):
            if not over():
                break
            if key not in keep:
                self._release(key, "bound")

    def sweep(self, now: float | None = None) -> int:
        """Release engines unused for ``idle_s``; skipped (0) while a replay holds the cache."""
        if self.idle_s is None or not self._lock.acquire(blocking=False):
            return 0
        try:
            now = self.clock() if now is None else now
            idle = [k for k, r in self._engines.items() if now - r.last_used >= self.idle_s]
            for key in idle:
                self._release(key, "idle")
            return len(idle)
        finally:
            self._lock.release()

    def close(self, reason: str = "stop") -> None:
        """Release every engine (the replica stops replaying). Never blocks: while a replay holds
        the cache, its engines are released when it ends."""
        if not self._lock.acquire(blocking=False):
            self._close_pending = reason
            return
        try:
            self._release_all(reason)
        finally:
            self._lock.release()

    def _release_all(self, reason: str) -> None:
        self._close_pending = None
        for key in list(self._engines):
            self._release(key, reason)
        self._owned.clear()

    def _release(self, key: str, reason: str) -> None:
        r = self._engines.pop(key, None)
        if r is None:
            return
        self.releases[reason] = self.releases.get(reason, 0) + 1
        if self.metrics is not None:
            self.metrics.golden_engine_releases.labels(reason).inc()
        try:
            r.engine.close()
        except Exception:  # noqa: BLE001 - a failing close must not keep the entry, nor stop the others
            log.exception("golden engine %s: close failed", getattr(r.engine, "name", "?"))
        log.info("golden engine %s released (%s)", getattr(r.engine, "name", "?"), reason)
        self._publish()

    def _publish(self) -> None:
        if self.metrics is not None:
            self.metrics.golden_engines_resident.set(len(self._engines))
            self.metrics.golden_engine_bytes.set(sum(r.bytes for r in self._engines.values()))

    # -- introspection ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._engines)

    def status(self) -> dict[str, Any]:
        """For /status (read from the HTTP thread: a snapshot, no lock; a replay may be loading)."""
        now = self.clock()
        resident = list(self._engines.values())  # one C-level copy: safe against a concurrent change
        return {"resident": [{"engine": getattr(r.engine, "name", "?"), "bytes": r.bytes, "hits": r.hits,
                              "idle_s": round(now - r.last_used, 1), "jobs": sorted(r.owners)}
                             for r in resident],
                "loads": self.loads, "hits": self.hits, "releases": dict(self.releases)}
