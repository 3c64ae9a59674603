"""Text tokenisation shared by the live shadow scorer (windows) and the golden scorers (probes).

ROUGE uses ``CjkTokenizer`` when either side of a pair contains CJK characters: each CJK character
is its own token, otherwise tokens are exactly rouge-score's default ``[a-z0-9]+`` runs.
"""

from __future__ import annotations

import re

# CJK ideographs (basic, ext. A, compatibility), kana and Hangul syllables.
_CJK_CLASS = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uac00-\ud7af"
_CJK_RE = re.compile(f"[{_CJK_CLASS}]")
_CJK_TOKEN_RE = re.compile(f"[a-z0-9]+|[{_CJK_CLASS}]")


def has_cjk(text: str) -> bool:
    return _CJK_RE.search(text) is not None


class CjkTokenizer:
    """rouge-score tokenizer: lower-cases, keeps ``[a-z0-9]+`` runs (exactly like the default
    tokenizer without stemming) and makes every CJK character its own token."""

    def tokenize(self, text: str) -> list[str]:
        return _CJK_TOKEN_RE.findall(text.lower())


def shorten(text: str, width: int) -> str:
    """``text`` cut to at most ``width`` characters at a word boundary, ending in "…" when cut;
    a number or name is never split (for one-line displays such as the demo's flag table)."""
    text = " ".join(text.split())
    if len(text) <= width:
        return text
    cut = text[: max(width - 1, 1)]
    if text[len(cut)] != " " and " " in cut:
        cut = cut[: cut.rindex(" ")]
    return cut.rstrip(" ,;:(") + "…"
