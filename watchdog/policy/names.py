"""Names in policy files (policy, rule, precision names; scope globs): NFKC-normalised, and refused
when they hold a letter that only looks like a Latin one (Cyrillic ``а`` in ``chаt`` would make a
scope silently match nothing) or an invisible character."""

from __future__ import annotations

import unicodedata

from watchdog.core.events import name_problem

#: letters from other scripts that render like a Latin letter (the common cases of Unicode's
#: confusables list for Cyrillic and Greek), after NFKC normalisation
CONFUSABLES = {
    # Cyrillic
    "а": "a", "в": "B", "е": "e", "о": "o", "р": "p", "с": "c", "у": "y", "х": "x", "ѕ": "s", "і": "i",
    "ј": "j", "ԁ": "d", "һ": "h", "ԛ": "q", "ԝ": "w", "ӏ": "l", "к": "k", "м": "M", "н": "H", "т": "T",
    "А": "A", "В": "B", "Е": "E", "К": "K", "М": "M", "Н": "H", "О": "O", "Р": "P", "С": "C", "Т": "T",
    "Х": "X", "Ѕ": "S", "І": "I", "Ј": "J", "Ү": "Y", "Ԛ": "Q", "Ԝ": "W", "Ӏ": "I",
    # Greek
    "α": "a", "ο": "o", "ν": "v", "ρ": "p", "ι": "i", "κ": "k", "υ": "u", "Α": "A", "Β": "B", "Ε": "E",
    "Ζ": "Z", "Η": "H", "Ι": "I", "Κ": "K", "Μ": "M", "Ν": "N", "Ο": "O", "Ρ": "P", "Τ": "T", "Υ": "Y",
    "Χ": "X",
    # Latin look-alikes outside ASCII that NFKC keeps
    "ı": "i", "ȷ": "j", "ɑ": "a", "ɡ": "g",
}


def _describe(ch: str) -> str:
    return f"'{ch}' (U+{ord(ch):04X} {unicodedata.name(ch, 'unnamed character')})"


def problems(text: str) -> str | None:
    """Why ``text`` (already NFKC) is unsafe as a name, or None."""
    if text.isascii():
        return None
    for ch in text:
        if ch.isascii():
            continue
        if ch in CONFUSABLES:
            return f"{_describe(ch)} looks like the Latin '{CONFUSABLES[ch]}'"
        if unicodedata.category(ch) in ("Cf", "Cc", "Zs", "Zl", "Zp", "Mn"):
            return f"{_describe(ch)} is invisible or combining"
    return None


def normalise(value: object) -> object:
    """NFKC for strings; anything else unchanged (the model reports the wrong type)."""
    return unicodedata.normalize("NFKC", value) if isinstance(value, str) and not value.isascii() else value


def clean_glob(value: object) -> object:
    """A scope glob: NFKC; confusable or invisible characters refused, other scripts allowed."""
    value = normalise(value)
    if isinstance(value, str):
        why = problems(value)
        if why:
            raise ValueError(f"'{value}': {why}; write the name as the routes/models are really named")
    return value


def clean_name(value: object) -> object:
    """A policy/rule/precision name: NFKC, then ASCII only; a confusable is named."""
    value = normalise(value)
    if isinstance(value, str) and not value.isascii():
        why = problems(value)
        if why is None:
            bad = next(ch for ch in value if not ch.isascii())
            why = f"{_describe(bad)} is not allowed"
        raise ValueError(f"name '{value}': {why}; names use A-Z a-z 0-9 _ . : / -")
    return value


def check_route(value: str, what: str = "route") -> str:
    """``value`` NFKC-normalised if it is a valid route (or model: ``what``) name (the daemon's
    rule, ``watchdog.core.events.name_problem``, and no confusable letter); ValueError otherwise."""
    name = normalise(value)
    assert isinstance(name, str)
    why = name_problem(name) or problems(name)
    if why:
        raise ValueError(f"{what} {name[:80]!r} {why}" if why.startswith(("is ", "holds "))
                         else f"{what} {name[:80]!r}: {why}")
    return name
