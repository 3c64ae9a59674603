"""Per-partition checkpoints in Redis: claim a partition (fencing token), restore, save atomically.

A partition's checkpoint holds everything needed to resume it exactly: the next offset to read, its
watermark, the "windows closed up to" mark, its open windows (sketches and counters), and the routes
it carries. A save writes, in one Lua script (``checkpoint.lua``): the checkpoint, the records of the
windows that closed since the last save, the pages those windows caused (outbox), and the policy-engine
state of the partition's routes. The script refuses a writer whose ownership token is not the current
one (a zombie after a rebalance) and a sequence number that is not newer than the stored one, so a save
retried after a timeout never records a window twice. See docs/OPERATIONS.md, "State and checkpoints".
"""

from __future__ import annotations

import base64
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from watchdog.core.keys import Keys, text

log = logging.getLogger(__name__)

#: 2: open windows with packed sketches and mix cells (``QuantileSketch.pack``, ``pack_cells``). A
#: replica of an older release ignores a schema-2 checkpoint with one warning and starts the
#: partition from Kafka's committed offset (the mirror) instead of failing on the packed form
SCHEMA = 2
#: checkpoint schemas this release restores (1: windows in the JSON-list form, still read)
READABLE_SCHEMAS = (1, 2)
SAVED, DUPLICATE, FENCED, RESYNC = "saved", "duplicate", "fenced", "resync"
#: the start of a packed engine-state value: zstd-compressed JSON, then base64 (the daemon's Redis client
#: decodes every reply as UTF-8). A value that does not start with it is the JSON itself
PACKED = "z1:"
_zstd = threading.local()


def pack_engine(doc: str) -> str:
    """A route's engine-state JSON as its packed value (``redis.pack_engine_state``): ~3x smaller here,
    in Redis and on the wire; zstd level 1 costs about a quarter of encoding the JSON."""
    import zstandard

    comp = getattr(_zstd, "comp", None)
    if comp is None:
        comp = _zstd.comp = zstandard.ZstdCompressor(level=1)
    return PACKED + base64.b64encode(comp.compress(doc.encode())).decode("ascii")


def engine_text(raw: str | bytes) -> str:
    """The JSON of an engine-state value, packed or not (every release since packing was added reads both)."""
    value = text(raw)
    if not value.startswith(PACKED):
        return value
    import zstandard

    dec = getattr(_zstd, "dec", None)
    if dec is None:
        dec = _zstd.dec = zstandard.ZstdDecompressor()
    return dec.decompress(base64.b64decode(value[len(PACKED):])).decode()


def _script(name: str) -> str:
    return resources.files("watchdog.state").joinpath(name).read_text(encoding="utf-8")


@dataclass
class Claim:
    token: str
    seq: int
    data: dict[str, Any] | None


@dataclass
class PendingSave:
    """One save, kept byte for byte until Redis answered: a retry sends exactly the same thing."""

    seq: int
    blob: str
    windows: list[str] = field(default_factory=list)
    outbox: list[str] = field(default_factory=list)
    engines: dict[str, str] = field(default_factory=dict)
    #: open windows changed since the last save (hash field -> JSON), and fields of windows closed since
    changed: dict[str, str] = field(default_factory=dict)
    closed: list[str] = field(default_factory=list)
    #: False only for a full snapshot (every open window is in ``changed``)
    incremental: bool = True
    #: changed open windows as snapshots not encoded yet (``encode`` turns them into ``changed``): built
    #: on the loop thread, consistent with the save's offset; encoded where the write runs
    snapshots: list[tuple[Any, Any]] = field(default_factory=list)
    #: turns ``snapshots`` into hash fields (``windows.aggregator.encode_snapshots``, passed in by the
    #: runtime: this layer does not import the windows)
    encoder: Callable[[list[tuple[Any, Any]]], dict[str, str]] | None = None

    def encode(self) -> None:
        """Encode the window snapshots into ``changed`` (once: a retry sends the same bytes)."""
        if self.snapshots:
            assert self.encoder is not None, "window snapshots without an encoder"
            self.changed.update(self.encoder(self.snapshots))
            self.snapshots = []

    @property
    def size(self) -> int:
        return (len(self.blob) + sum(map(len, self.windows)) + sum(map(len, self.outbox))
                + sum(map(len, self.engines.values())) + sum(map(len, self.changed.values())))


class CheckpointStore:
    def __init__(self, client: Any, keys: Keys, group: str, topic: str, instance: str,
                 windows_maxlen: int = 100_000) -> None:
        self.client = client
        self.keys = keys
        self.group = group
        self.topic = topic
        self.instance = instance
        self.windows_maxlen = windows_maxlen
        self._save = client.register_script(_script("checkpoint.lua"))
        self._claim = client.register_script(_script("claim.lua"))

    def owner_key(self, partition: int) -> str:
        return self.keys.owner(self.group, self.topic, partition)

    def claim(self, partition: int) -> Claim:
        """Become the owner of ``partition`` (older tokens are fenced from now on) and read its checkpoint."""
        reply = [text(v) for v in self._claim(
            keys=[self.owner_key(partition), self.keys.checkpoint(self.group, self.topic, partition),
                  self.owner_key(partition) + ":gen"],
            args=[self.instance], client=self.client)]
        token, fields = reply[0], dict(zip(reply[1::2], reply[2::2], strict=True))
        raw = fields.get("json")
        data = json.loads(raw) if raw else None
        if data is not None and data.get("schema") not in READABLE_SCHEMAS:
            log.warning("partition %s: ignoring checkpoint of schema %r (this release reads %s); starting it "
                        "from the committed offset", partition, data.get("schema"), READABLE_SCHEMAS)
            data = None
        if data is not None:
            data["windows"] = [json.loads(v) for k, v in fields.items() if k.startswith("w")]
        return Claim(token, int(fields.get("seq") or 0), data)

    def save(self, partition: int, token: str, save: PendingSave) -> str:
        """Run one save; returns SAVED, DUPLICATE, FENCED or RESYNC. Redis errors propagate."""
        save.encode()
        engine_keys = list(save.engines)
        keys = [self.owner_key(partition), self.keys.checkpoint(self.group, self.topic, partition),
                self.keys.windows, self.keys.outbox, *engine_keys]
        pairs = [x for kv in save.changed.items() for x in kv]
        args: list[Any] = [token, save.seq, save.blob, self.windows_maxlen, len(save.windows), len(save.outbox),
                           len(save.changed), len(save.closed), "1" if save.incremental else "0",
                           *save.windows, *save.outbox, *pairs, *save.closed,
                           *(save.engines[k] for k in engine_keys)]
        status, _detail = (text(v) for v in self._save(keys=keys, args=args, client=self.client))
        return status

    def load_engines(self, routes: list[tuple[str, str]]) -> dict[tuple[str, str], dict[str, Any]]:
        """The saved policy-engine state of each (model, route) that has one."""
        if not routes:
            return {}
        raws = self.client.mget([self.keys.engine(self.group, m, r) for m, r in routes])
        out = {}
        for pair, raw in zip(routes, raws, strict=True):
            if raw:
                out[pair] = json.loads(engine_text(raw))
        return out
