"""The parts of the golden drill (``replicas-golden``): a golden set per route, FP8 and FP16
OpenAI-compatible servers (probes/openai_server.py) answering those sets from a table, the policy
whose live rule rolls back only when a golden replay confirms it, and what the drill reads of a
replica from outside (/status, /metrics, the golden reports it wrote).

The daemons build their engines from the config as in production (``kind: openai``): nothing in
them is replaced. The FP8 server answers half of a route's items wrong once the drill ``break``s
that route: each route has its own set, so one replay job per route says which route broke.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
from kafka.partitioner.default import murmur2
from prometheus_client.parser import text_string_to_metric_families

from probes.engines.base import Generation
from probes.openai_server import OpenAIServer
from tests.drills.harness import MODEL
from tests.drills.ledger import Result
from tests.drills.runner import Drill
from tests.helpers import WaitTimeout, wait_until
from watchdog.core.events import partition_key

#: a live rule on shadow agreement that only suspects (``confirm_with: golden``): it asks for a
#: replay of the route's job and rolls back when the golden rule trips; its own timeout (600
#: windows) lies past any drill, so every rollback here is one a replay confirmed
POLICY: dict[str, Any] = {
    "name": "golden-drill",
    "description": "fault drills: live suspicion confirmed by a golden replay",
    "scope": {"models": ["*"], "routes": ["*"]},
    "cooldown": "30s",
    "max_flips_per_day": 4,
    "rules": [
        {"name": "shadow-agreement", "source": "live", "metric": "shadow_rougeL", "fail_if": "candidate < 0.85",
         "min_samples": 5, "for": 2, "severity": "critical", "action": "rollback", "confirm_with": "golden",
         "confirm_timeout": 600},
        {"name": "golden-exact-match", "source": "golden", "metric": "exact_match", "fail_if": "paired_mean < -0.25",
         "min_samples": 5, "severity": "critical", "action": "alert"},
    ],
    "promote": {"mode": "auto", "healthy_windows": 3, "after": "30s"},
}
ITEMS = 6
#: items of a broken route answered wrong: exact_match paired mean -0.5, past the rule's -0.25
BROKEN_ITEMS = 3


def routes_on_partitions(model: str, partitions: int) -> list[str]:
    """One route name per partition, in partition order, where the producers' key puts it."""
    found: dict[int, str] = {}
    i = 0
    while len(found) < partitions:
        name = f"g{i}"
        found.setdefault((murmur2(partition_key(model, name)) & 0x7FFFFFFF) % partitions, name)
        i += 1
    return [found[p] for p in range(partitions)]


class TableModel:
    """What an OpenAI server here answers: each prompt's reference, or for the routes in ``broken``
    (FP8 only) the first ``BROKEN_ITEMS`` items wrong. Tokens are bytes."""

    def __init__(self, table: dict[str, tuple[str, int, str]], broken: set[str] | None = None) -> None:
        #: prompt -> (route, item index, reference)
        self.table = table
        self.broken = broken

    def generate(self, prompts: list[str], max_new_tokens: int) -> list[Generation]:
        out = []
        for p in prompts:
            route, i, ref = self.table[p]
            wrong = self.broken is not None and route in self.broken and i < BROKEN_ITEMS
            out.append(Generation("nonsense" if wrong else ref, None, 1.0))
        return out

    def encode_prompt(self, text: str) -> list[int]:
        return list(text.encode())

    encode_continuation = encode_prompt

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode(errors="replace")


class GoldenStandIns:
    """A golden set per route under ``workdir`` and the FP8 / FP16 servers; ``close()`` stops them."""

    def __init__(self, workdir: Path, model: str, routes: list[str]) -> None:
        self.model = model
        self.routes = routes
        self.broken: set[str] = set()
        self.sets: dict[str, Path] = {}
        table: dict[str, tuple[str, int, str]] = {}
        for r in routes:
            path = workdir / f"drill-{r}"  # a set's directory is named as its manifest
            path.mkdir(parents=True, exist_ok=True)
            (path / "manifest.yaml").write_text(
                f"schema: 1\nname: drill-{r}\ndomain: qa\ndescription: route {r}'s golden set\nlanguages: [en]\n"
                "routes: ['*']\ntemplate: '{prompt}'\ngeneration: {max_new_tokens: 8, stop: ['\\n']}\n"
                "metrics: [exact_match, rougeL]\n")
            items = [{"id": f"{r}-{i}", "prompt": f"{r}: what is {i}?", "reference": f"answer {i}"} for i in range(ITEMS)]
            (path / "items.jsonl").write_text("".join(json.dumps(it) + "\n" for it in items))
            table.update({it["prompt"]: (r, i, it["reference"]) for i, it in enumerate(items)})
            self.sets[r] = path
        self.fp8 = OpenAIServer(TableModel(table, self.broken), model_name="drill-fp8", prompt_logprobs=False).start()
        self.fp16 = OpenAIServer(TableModel(table), model_name="drill-fp16", prompt_logprobs=False).start()

    def break_route(self, route: str) -> None:
        self.broken.add(route)

    def job_name(self, route: str) -> str:
        return f"guard-{route}"

    def config(self) -> dict[str, Any]:
        """The daemons' ``golden`` section: one on-suspicion job per route, never scheduled."""
        def engine(server: OpenAIServer, precision: str) -> dict[str, Any]:
            return {"kind": "openai", "base_url": server.base_url, "model": f"drill-{precision}",
                    "precision": precision, "logprobs": False, "timeout_s": 10.0}

        jobs = [{"name": self.job_name(r), "set": str(self.sets[r]), "model": self.model, "routes": [r],
                 "every_s": None, "jitter_s": 0.0, "repeat_baseline": False,
                 "candidate": engine(self.fp8, "fp8"), "baseline": engine(self.fp16, "fp16")} for r in self.routes]
        return {"jobs": jobs, "debounce_s": 60.0}

    def close(self) -> None:
        for srv in (self.fp8, self.fp16):
            srv.stop()


# -- reading a replica from outside ---------------------------------------------------------------
def status(port: int, **query: str) -> dict[str, Any]:
    return dict(httpx.get(f"http://127.0.0.1:{port}/status", params=query, timeout=5.0).json())


def counters(port: int, name: str) -> dict[str, float]:
    """``name``'s samples on the replica's /metrics, by their ``result`` label."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5.0).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                out[s.labels.get("result", "")] = s.value
    return out


def owned_partitions(port: int) -> set[int]:
    return {int(p) for p in status(port).get("partitions", {})}


def reports(reports_dir: Path) -> list[str]:
    """The jobs whose replay report this replica wrote."""
    return sorted(p.parent.name for p in reports_dir.glob("*/latest.json"))


# -- the drill's own counts -----------------------------------------------------------------------
def roles(d: Drill, routes: list[str]) -> dict[str, Any]:
    """Who owns which route (``routes[p]`` lies on partition p), the partitions' owner tokens and who
    holds the golden lease, as the replicas' /status say; waits (up to 60 s) for the partitions to
    be split two and two and one lease holder."""
    found: dict[str, Any] = {}

    def split() -> bool:
        docs = {rep.name: status(rep.port) for rep in d.stack.daemons}
        owner = {int(p): name for name, doc in docs.items() for p in doc.get("partitions", {})}
        holders = sorted(name for name, doc in docs.items() if doc.get("golden_lease"))
        found.update(owner={r: owner.get(p) for p, r in enumerate(routes)}, holders=holders,
                     tokens={int(p): v["token"] for doc in docs.values() for p, v in doc.get("partitions", {}).items()})
        counts = sorted(list(owner.values()).count(rep.name) for rep in d.stack.daemons)
        return counts == [2, 2] and len(owner) == len(routes) and len(holders) == 1

    def answered() -> bool:
        try:
            return split()
        except (httpx.HTTPError, ValueError):  # a replica not answering yet
            return False

    try:
        wait_until(answered, 60, 0.5)
    except WaitTimeout:
        d.note(f"partitions not split two and two with one lease holder within 60 s: {found}")
    return found


def judge(d: Drill, res: Result, golden: GoldenStandIns, seen: dict[str, Any], end: dict[str, Any]) -> None:
    """The drill's own counts, each a guard violation when wrong: who flipped, who replayed, who
    asked, who judged, and what the owners' engine states say."""
    bad = res.guard_violations
    owner: dict[str, str | None] = seen.get("owner", {})
    holder = (seen.get("holders") or [None])[0]
    if end.get("owner") != owner or end.get("holders") != seen.get("holders"):
        bad.append(f"ownership or lease moved during the drill: {seen} -> {end}")
    ports = {rep.name: rep.port for rep in d.stack.daemons}
    away = sorted(r for r, o in owner.items() if o != holder)
    res.notes.append(f"lease holder {holder}; owners {owner}; routes the holder does not own: {away}")
    if not away:
        bad.append("the lease holder owned every route: the other replica asked for nothing")
    # each flip by the owner of the route's partition, confirmed by the golden rule
    for _id, f in d.stack.stream("audit"):
        if f.get("op") != "set" or f.get("model") != MODEL:
            continue
        route, by = f.get("route", ""), f.get("changed_by", "")
        if by != f"watchdog@{owner.get(route)}":
            bad.append(f"{route} flipped by {by}, its partition's owner is {owner.get(route)}")
        if "confirmed by golden" not in f.get("reason", ""):
            bad.append(f"{route} flipped without a golden confirmation: {f.get('reason', '')[:120]}")
    for p, token in sorted(end.get("tokens", {}).items()):
        if not str(token).endswith(f":{owner.get(golden.routes[p])}"):
            bad.append(f"partition {p}: owner token {token}, /status owner {owner.get(golden.routes[p])}")
    # the owner's engine state holds its own single flip and no change by anyone else (a flip it did
    # not write would show as serving_since after last_flip); no other replica holds state of the route
    for route, name in owner.items():
        if name is None:
            continue
        scopes = [s for s in status(ports[name], route=route)["verdicts"]["scopes"] if s["policy"] == POLICY["name"]]
        st = scopes[0] if scopes else {}
        if not (st.get("serving") == "fp16" and st.get("flips_today") == 1 and st.get("last_flip") is not None
                and st.get("serving_since") == st.get("last_flip") and st.get("pending") is None):
            keys = ("serving", "flips_today", "last_flip", "serving_since", "pending")
            bad.append(f"{route}: owner {name}'s engine state is not its own single flip: "
                       + json.dumps({k: st.get(k) for k in keys}))
        for other, port in ports.items():
            if other != name and status(port, route=route)["verdicts"]["scopes"]:
                bad.append(f"{route}: {other}, not its owner, holds engine state of it")
    # every replay on the holder, each job once; replay requests forwarded by the other replica only
    for name, port in ports.items():
        flips = counters(port, "llmwd_flips_total")
        stream = counters(port, "llmwd_golden_stream_total")
        runs = {j["job"]: j["runs"] for j in status(port)["golden"]}
        wrote = reports(d.stack.workdir / f"reports-{name}")
        mine = sorted(r for r, o in owner.items() if o == name)
        res.notes.append(f"{name}: owns {mine}, replays {runs}, reports {wrote}, flips {flips}, golden stream {stream}")
        want_runs = {golden.job_name(r): (1 if name == holder else 0) for r in golden.routes}
        if runs != want_runs:
            bad.append(f"{name} ran replays {runs}, expected {want_runs}")
        if wrote != (sorted(want_runs) if name == holder else []):
            bad.append(f"{name} wrote the reports of {wrote}")
        refused = {k: v for k, v in flips.items() if k not in ("applied", "unchanged") and v}
        if flips.get("applied", 0) != len(mine) or refused:
            bad.append(f"{name} flips {flips}, expected {len(mine)} applied and none refused")
        if stream.get("requested", 0) != (0 if name == holder else len(mine)):
            bad.append(f"{name} forwarded {stream.get('requested', 0):.0f} replay requests, owns {len(mine)} routes")
        if stream.get("judged", 0) != 2 * len(mine):
            bad.append(f"{name} judged {stream.get('judged', 0):.0f} golden signals, expected {2 * len(mine)}")
        if stream.get("published", 0) != (len(golden.routes) if name == holder else 0) or stream.get("error", 0):
            bad.append(f"{name} published {stream.get('published', 0):.0f} replays, "
                       f"{stream.get('error', 0):.0f} stream errors")
