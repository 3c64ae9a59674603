"""Imports point one way (tests/import_rules.py says the rules): the tree obeys them, and each rule
fails on a planted violation."""

from __future__ import annotations

import re
import shutil
import textwrap
from pathlib import Path

from tests.import_rules import RANKS, check

ROOT = Path(__file__).resolve().parents[1]


def test_the_tree_obeys_the_import_rules() -> None:
    found = check(ROOT)
    assert not found, "import rules broken (tests/import_rules.py):\n" + "\n".join(map(str, found))


def test_every_room_of_the_tree_has_a_rank() -> None:
    rooms = {p.name for p in (ROOT / "watchdog").iterdir() if (p / "__init__.py").exists()}
    assert rooms <= set(RANKS), f"rooms without a rank: {sorted(rooms - set(RANKS))}"
    assert rooms | {"probes"} == set(RANKS), f"ranks of rooms that are gone: {sorted(set(RANKS) - rooms - {'probes'})}"


# -- planted violations, one per rule ------------------------------------------------------------

def plant(root: Path, files: dict[str, str]) -> Path:
    """A project tree under ``root``: ``files`` maps a path to its source; packages get an __init__."""
    for rel, source in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
        for parent in path.relative_to(root).parents:
            if str(parent) != "." and not (root / parent / "__init__.py").exists():
                (root / parent / "__init__.py").write_text("")
    return root


def rules_hit(found: list) -> set[tuple[str, str, int]]:
    return {(v.rule, v.file, v.line) for v in found}


def test_a_clean_planted_tree_passes(tmp_path: Path) -> None:
    plant(tmp_path, {
        "watchdog/core/events.py": "X = 1\n",
        "watchdog/policy/engine.py": "from watchdog.core.events import X\nfrom watchdog.core import events\n",
        "watchdog/runtime/daemon.py": "import watchdog.policy.engine\nfrom .loop import step\n",
        "watchdog/runtime/loop.py": "def step():\n    pass\n",
        "probes/golden.py": "from watchdog.core.events import X\nfrom probes import gpu\n",
        "probes/gpu.py": "Y = 2\n",
    })
    assert check(tmp_path) == []


def test_rank_a_lower_room_importing_a_higher_one_fails(tmp_path: Path) -> None:
    plant(tmp_path, {
        "watchdog/windows/aggregator.py": """\
            from typing import TYPE_CHECKING

            if TYPE_CHECKING:
                from watchdog.policy.engine import PolicyEngine


            def close():
                import watchdog.runtime.daemon
            """,
        "watchdog/policy/engine.py": "class PolicyEngine: ...\n",
        "watchdog/runtime/daemon.py": "",
    })
    found = check(tmp_path)
    assert rules_hit(found) == {("rank", "watchdog/windows/aggregator.py", 4),
                                ("rank", "watchdog/windows/aggregator.py", 8)}
    assert "windows (rank 3) may not import the higher policy (rank 4)" in str(found[0])
    assert str(found[0]).startswith("watchdog/windows/aggregator.py:4: [rank]")


def test_rank_rooms_of_the_same_rank_may_not_import_each_other(tmp_path: Path) -> None:
    plant(tmp_path, {
        "watchdog/ingest/consumer.py": "from watchdog.alerting import alerter\n",
        "watchdog/alerting/alerter.py": "",
    })
    found = check(tmp_path)
    assert rules_hit(found) == {("rank", "watchdog/ingest/consumer.py", 1)}
    assert "share rank 3" in str(found[0])


def test_rank_a_new_room_needs_a_rank(tmp_path: Path) -> None:
    plant(tmp_path, {"watchdog/utils/misc.py": "", "watchdog/core/x.py": "import watchdog.utils.misc\n"})
    assert rules_hit(check(tmp_path)) == {("rank", "watchdog/core/x.py", 1)}


def test_rank_in_a_copy_of_the_real_tree(tmp_path: Path) -> None:
    """The real package with one planted import: only that one is reported."""
    for pkg in ("watchdog", "probes"):
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    sketch = tmp_path / "watchdog/windows/sketch.py"
    lines = sketch.read_text().splitlines()
    lines.append("from watchdog.state.checkpoint import CheckpointStore  # planted")
    sketch.write_text("\n".join(lines) + "\n")
    found = check(tmp_path)
    assert rules_hit(found) == {("rank", "watchdog/windows/sketch.py", len(lines))}


def test_probes_import_watchdog_core_only(tmp_path: Path) -> None:
    plant(tmp_path, {
        "probes/golden_replay.py": """\
            from watchdog.core.text import tokens


            def replay():
                from watchdog.config.settings import Config
                import watchdog
            """,
        "watchdog/core/text.py": "def tokens(): ...\n",
        "watchdog/config/settings.py": "class Config: ...\n",
    })
    found = check(tmp_path)
    assert rules_hit(found) == {("probes", "probes/golden_replay.py", 5), ("probes", "probes/golden_replay.py", 6)}
    assert "probes may import watchdog.core only" in str(found[0])


def test_cycle_through_a_function_local_import(tmp_path: Path) -> None:
    plant(tmp_path, {
        "watchdog/policy/engine.py": "from watchdog.policy.evaluate import evaluate\n",
        "watchdog/policy/evaluate.py": """\
            def evaluate():
                from watchdog.policy import engine
                return engine
            """,
        "watchdog/core/a.py": "import watchdog.core.b\n",
        "watchdog/core/b.py": "from watchdog.core import c\n",
        "watchdog/core/c.py": "from watchdog.core.a import X\n",
    })
    found = check(tmp_path)
    assert rules_hit(found) == {("cycle", "watchdog/core/a.py", 1), ("cycle", "watchdog/policy/engine.py", 1)}
    three = next(v for v in found if v.file == "watchdog/core/a.py")
    assert "watchdog.core.a -> watchdog.core.b -> watchdog.core.c -> watchdog.core.a" in three.message
    assert "watchdog/core/b.py:1" in three.message and "watchdog/core/c.py:1" in three.message
    two = next(v for v in found if v.file == "watchdog/policy/engine.py")
    assert "watchdog/policy/evaluate.py:2" in two.message


def test_cycle_through_a_package_init(tmp_path: Path) -> None:
    plant(tmp_path, {
        "watchdog/policy/__init__.py": "from watchdog.policy.engine import PolicyEngine\n",
        "watchdog/policy/engine.py": "from watchdog.policy import Rule\nclass PolicyEngine: ...\n",
    })
    assert rules_hit(check(tmp_path)) == {("cycle", "watchdog/policy/__init__.py", 1)}


def test_private_names_stay_in_their_module(tmp_path: Path) -> None:
    plant(tmp_path, {
        "watchdog/core/keys.py": "_PREFIX = 'x'\n__all__ = ['_PREFIX']\n",
        "watchdog/state/lease.py": """\
            from watchdog.core.keys import __all__


            def renew():
                from watchdog.core.keys import _PREFIX
            """,
        "watchdog/state/__init__.py": "from ._impl import _helper\n",
        "watchdog/state/_impl.py": "def _helper(): ...\n",
    })
    found = check(tmp_path)
    assert rules_hit(found) == {("private", "watchdog/state/lease.py", 5), ("private", "watchdog/state/__init__.py", 1)}
    assert "imports the private _PREFIX of watchdog.core.keys" in "\n".join(map(str, found))


def test_runtime_never_imports_dev(tmp_path: Path) -> None:
    plant(tmp_path, {
        "watchdog/runtime/daemon.py": "def start():\n    from watchdog.dev.embedded import start_redis\n",
        "watchdog/dev/embedded.py": "def start_redis(): ...\n",
    })
    found = check(tmp_path)
    assert ("runtime-dev", "watchdog/runtime/daemon.py", 2) in rules_hit(found)
    assert ("rank", "watchdog/runtime/daemon.py", 2) in rules_hit(found)  # dev is ranked above runtime too



def test_docs_architecture_shows_the_ranks_this_test_enforces() -> None:
    text = (ROOT / "docs/ARCHITECTURE.md").read_text()
    shown = {room: int(rank) for rank, room in re.findall(r"^\| (\d+) \| `(\w+)` \|", text, re.M)}
    assert shown == RANKS, "docs/ARCHITECTURE.md's rank table differs from tests/import_rules.py's RANKS"
