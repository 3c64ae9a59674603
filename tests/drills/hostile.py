"""Hostile policy files, as bytes, for the hostile-policies drill (each built on demand)."""

from __future__ import annotations

from collections.abc import Callable

_HEAD = "policies:\n  - name: {name}\n    scope: {{models: ['*'], routes: ['{route}']}}\n"
_RULE = ("    rules:\n      - {{name: r, source: live, metric: error_rate, fail_if: \"{cond}\",\n"
         "         min_samples: 5, for: 2, action: rollback}}\n")


def alias_bomb() -> bytes:
    """Billion laughs: 9 levels of 10 aliases (10^9 strings if expanded)."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, 10):
        refs = ",".join([f"*a{i - 1}"] * 10)
        lines.append(f"a{i}: &a{i} [{refs}]")
    lines.append("policies: *a9")
    return ("\n".join(lines) + "\n").encode()


def deep_nesting() -> bytes:
    """A condition with 150 nested parentheses, 1,000 `not`s, and a 600-deep YAML flow sequence."""
    cond = "(" * 150 + "candidate" + ")" * 150 + " > 0.5 and " + "not " * 1000 + "candidate > 0"
    text = _HEAD.format(name="deep", route="deep-*") + _RULE.format(cond=cond)
    text += "    description: " + "[" * 600 + "]" * 600 + "\n"
    return text.encode()


def huge_file() -> bytes:
    """About 20 MB: one policy whose scope lists 40,000 globs of ~500 characters."""
    globs = ",".join(f"'route-{i}-{'x' * 480}*'" for i in range(40_000))
    return (f"policies:\n  - name: huge\n    scope: {{models: ['*'], routes: [{globs}]}}\n"
            + _RULE.format(cond="candidate > 0.5")).encode()


def nan_values() -> bytes:
    return (_HEAD.format(name="nan", route="nan-*") + "    cooldown: .nan\n    max_flips_per_day: 3\n"
            "    promote: {mode: auto, after: .nan}\n"
            + _RULE.format(cond="candidate > 0 / 0")).encode()


def inf_values() -> bytes:
    return (_HEAD.format(name="inf", route="inf-*")
            + "    rules:\n      - {name: j, source: live, metric: shadow_rougeL, min_samples: 5, action: rollback,\n"
              "         judge: {effect: .inf}}\n").encode()


def python_tag() -> bytes:
    return (_HEAD.format(name="tag", route="tag-*") + "    description: !!python/object/apply:os.system ['true']\n"
            + _RULE.format(cond="candidate > 0.5")).encode()


def confusable_scope() -> bytes:
    """A Cyrillic 'о' (U+043E) in the route glob: looks like r0's family, matches nothing."""
    return (_HEAD.format(name="confusable", route="r\u043e-*") + _RULE.format(cond="candidate > 0.5")).encode()


HOSTILE_FILES: dict[str, Callable[[], bytes]] = {
    "alias-bomb": alias_bomb,
    "deep-nesting": deep_nesting,
    "huge-20mb": huge_file,
    "nan-values": nan_values,
    "inf-values": inf_values,
    "python-tag": python_tag,
    "confusable-scope": confusable_scope,
}
