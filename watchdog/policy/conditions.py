"""Rule conditions: a tiny, safe expression language parsed by hand (no ``eval``, no ``ast``).

Grammar (lowest to highest precedence)::

    condition  := or_expr                      (must be true/false, e.g. a comparison)
    or_expr    := and_expr ("or" and_expr)*
    and_expr   := not_expr ("and" not_expr)*
    not_expr   := "not" not_expr | comparison
    comparison := sum (("<" | "<=" | ">" | ">=" | "==" | "!=") sum)*    (chains like 0 < x < 1)
    sum        := product (("+" | "-") product)*
    product    := unary (("*" | "/") unary)*
    unary      := "-" unary | "+" unary | atom
    atom       := NUMBER ["%"] | NAME | FUNC "(" sum ("," sum)* ")" | "(" or_expr ")"

Names are ``candidate``, ``baseline``, ``value`` (= candidate) and the paired statistics
``paired_mean``, ``paired_lo``, ``paired_hi``, ``paired_n``; functions are ``abs``, ``min``,
``max``. ``5%`` is ``0.05``. Division follows IEEE rules: ``x / 0`` is ``inf`` (or ``-inf``),
``0 / 0`` is NaN and every comparison with NaN is false. Anything else (attribute access,
strings, indexing, other names or calls) is rejected at load time with the column of the problem.

Refused at load time as well, since such a rule could never fire (or always would): a number that
is not finite (``1e999``), a division by a constant zero, a constant part that overflows or is
NaN (``0 / 0``, ``1e308 * 10``), and a condition that reads no name (``1 > 2``). Size is bounded:
at most ``MAX_LENGTH`` characters, ``MAX_TOKENS`` tokens and ``MAX_DEPTH`` nested parentheses,
``not``s, signs and calls, so neither parsing nor evaluation can recurse deeply.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

NAMES = ("candidate", "baseline", "value", "paired_mean", "paired_lo", "paired_hi", "paired_n")
FUNCS: dict[str, tuple[Callable[..., float], int, int]] = {
    # name: (function, min args, max args)
    "abs": (abs, 1, 1),
    "min": (min, 2, 16),
    "max": (max, 2, 16),
}
KEYWORDS = ("and", "or", "not")
MAX_LENGTH = 2_000
MAX_TOKENS = 256
MAX_DEPTH = 32
_CMP = ("<=", ">=", "==", "!=", "<", ">")


class ConditionError(ValueError):
    """A condition that cannot be parsed; ``offset`` is the 0-based column inside the string."""

    def __init__(self, message: str, offset: int) -> None:
        super().__init__(message)
        self.message = message
        self.offset = offset


@dataclass(frozen=True, slots=True)
class _Tok:
    kind: str  # num, name, op, end
    text: str
    offset: int
    number: float = 0.0


def _tokenize(text: str) -> list[_Tok]:
    toks: list[_Tok] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
            continue
        if c.isdigit() or (c == "." and i + 1 < n and text[i + 1].isdigit()):
            j = i
            while j < n and (text[j].isdigit() or text[j] == "."):
                j += 1
            if j < n and text[j] in "eE":
                k = j + 1
                if k < n and text[k] in "+-":
                    k += 1
                if k < n and text[k].isdigit():
                    j = k
                    while j < n and text[j].isdigit():
                        j += 1
            raw = text[i:j]
            try:
                num = float(raw)
            except ValueError:
                raise ConditionError(f"bad number '{raw}'", i) from None
            if not math.isfinite(num):
                raise ConditionError(f"number '{raw}' is out of range (not finite)", i)
            if j < n and text[j] == "%":
                num /= 100.0
                j += 1
            if j < n and (text[j].isalpha() or text[j] == "_"):
                raise ConditionError(f"unexpected '{text[j]}' after number '{raw}'", j)
            toks.append(_Tok("num", text[i:j], i, num))
            i = j
            if len(toks) > MAX_TOKENS:
                raise ConditionError(f"condition is too long (more than {MAX_TOKENS} tokens)", i)
            continue
        if c.isalpha() or c == "_":
            j = i
            while j < n and (text[j].isalnum() or text[j] == "_"):
                j += 1
            toks.append(_Tok("name", text[i:j], i))
            i = j
            if len(toks) > MAX_TOKENS:
                raise ConditionError(f"condition is too long (more than {MAX_TOKENS} tokens)", i)
            continue
        two = text[i : i + 2]
        if two in _CMP:
            toks.append(_Tok("op", two, i))
            i += 2
            continue
        if c in "<>+-*/(),":
            toks.append(_Tok("op", c, i))
            i += 1
            if len(toks) > MAX_TOKENS:
                raise ConditionError(f"condition is too long (more than {MAX_TOKENS} tokens)", i)
            continue
        hint = ""
        if c == "=":
            hint = " (use == to compare)"
        elif c == ".":
            hint = " (attribute access is not allowed)"
        elif c in "'\"":
            hint = " (strings are not allowed)"
        elif c == "&" or c == "|":
            hint = " (use and / or)"
        elif c == "!":
            hint = " (use not, or != to compare)"
        # Stop here; the parser reports this only if the text before it parses, so that
        # "__import__('os')" reports the unknown function rather than the quote.
        toks.append(_Tok("bad", f"unexpected character '{c}'{hint}", i))
        return toks
    toks.append(_Tok("end", "", n))
    return toks


# A parsed node is a tuple: ("num", x) | ("name", n) | ("neg", a) | ("bin", op, a, b)
# | ("call", f, [args]) | ("cmp", [ops], [operands]) | ("and", a, b) | ("or", a, b) | ("not", a)
Node = tuple


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.toks = _tokenize(text)
        self.i = 0
        self.depth = 0
        self.names: set[str] = set()

    def enter(self, offset: int) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise ConditionError(f"condition is nested too deeply (more than {MAX_DEPTH} levels of "
                                 "parentheses, not, signs or calls)", offset)

    @property
    def tok(self) -> _Tok:
        return self.toks[self.i]

    def take(self) -> _Tok:
        t = self.toks[self.i]
        self.i += 1
        return t

    def at(self, text: str) -> bool:
        t = self.tok
        return (t.kind == "op" or t.kind == "name") and t.text == text

    def expect(self, text: str) -> None:
        if not self.at(text):
            raise ConditionError(f"expected '{text}' but found {self._describe(self.tok)}", self.tok.offset)
        self.take()

    @staticmethod
    def _describe(t: _Tok) -> str:
        return "end of condition" if t.kind == "end" else f"'{t.text}'"

    def parse(self) -> Node:
        try:
            return self._parse()
        except ConditionError as exc:
            bad = self.toks[-1]
            if bad.kind == "bad" and exc.offset >= bad.offset:
                raise ConditionError(bad.text, bad.offset) from None
            raise

    def _parse(self) -> Node:
        if self.tok.kind == "end":
            raise ConditionError("empty condition", 0)
        start = self.tok.offset
        node, kind = self.or_expr()
        if self.tok.kind != "end":
            raise ConditionError(f"unexpected {self._describe(self.tok)}", self.tok.offset)
        if kind != "bool":
            raise ConditionError(
                "a condition must be true or false: compare something, e.g. 'candidate > 0.05'", start
            )
        return node

    def _need(self, kind: str, want: str, offset: int, what: str) -> None:
        if kind != want:
            if want == "bool":
                raise ConditionError(f"'{what}' needs a comparison on each side, not a number", offset)
            raise ConditionError(f"'{what}' needs numbers, not a comparison", offset)

    def or_expr(self) -> tuple[Node, str]:
        start = self.tok.offset
        left, lk = self.and_expr()
        while self.at("or"):
            op = self.take()
            self._need(lk, "bool", start, op.text)
            right_at = self.tok.offset
            right, rk = self.and_expr()
            self._need(rk, "bool", right_at, op.text)
            left, lk = ("or", left, right), "bool"
        return left, lk

    def and_expr(self) -> tuple[Node, str]:
        start = self.tok.offset
        left, lk = self.not_expr()
        while self.at("and"):
            op = self.take()
            self._need(lk, "bool", start, op.text)
            right_at = self.tok.offset
            right, rk = self.not_expr()
            self._need(rk, "bool", right_at, op.text)
            left, lk = ("and", left, right), "bool"
        return left, lk

    def not_expr(self) -> tuple[Node, str]:
        if self.at("not"):
            self.enter(self.take().offset)
            at = self.tok.offset
            inner, kind = self.not_expr()
            self._need(kind, "bool", at, "not")
            self.depth -= 1
            return ("not", inner), "bool"
        return self.comparison()

    def comparison(self) -> tuple[Node, str]:
        start = self.tok.offset
        first, kind = self.sum()
        if not (self.tok.kind == "op" and self.tok.text in _CMP):
            return first, kind
        ops: list[str] = []
        operands = [first]
        self._need(kind, "num", start, self.tok.text)
        while self.tok.kind == "op" and self.tok.text in _CMP:
            ops.append(self.take().text)
            at = self.tok.offset
            node, k = self.sum()
            self._need(k, "num", at, ops[-1])
            operands.append(node)
        cmp = ("cmp", ops, operands)
        if all(_is_constant(x) for x in operands):
            always = bool(_eval(cmp, {}))
            raise ConditionError(f"this comparison reads no value: it is always {'true' if always else 'false'}",
                                 start)
        return cmp, "bool"

    def sum(self) -> tuple[Node, str]:
        start = self.tok.offset
        left, lk = self.product()
        while self.tok.kind == "op" and self.tok.text in "+-":
            op = self.take().text
            self._need(lk, "num", start, op)
            at = self.tok.offset
            right, rk = self.product()
            self._need(rk, "num", at, op)
            left, lk = ("bin", op, left, right), "num"
            _check_constant(left, start)
        return left, lk

    def product(self) -> tuple[Node, str]:
        start = self.tok.offset
        left, lk = self.unary()
        while self.tok.kind == "op" and self.tok.text in "*/":
            op = self.take().text
            self._need(lk, "num", start, op)
            at = self.tok.offset
            right, rk = self.unary()
            self._need(rk, "num", at, op)
            if op == "/" and _constant(right) == 0.0:
                raise ConditionError("division by zero: this part is never a finite number", at)
            left, lk = ("bin", op, left, right), "num"
            _check_constant(left, start)
        return left, lk

    def unary(self) -> tuple[Node, str]:
        if self.tok.kind == "op" and self.tok.text in "+-":
            tok = self.take()
            op = tok.text
            self.enter(tok.offset)
            at = self.tok.offset
            inner, kind = self.unary()
            self._need(kind, "num", at, op)
            self.depth -= 1
            return (("neg", inner) if op == "-" else inner), "num"
        return self.atom()

    def atom(self) -> tuple[Node, str]:
        t = self.tok
        if t.kind == "num":
            self.take()
            return ("num", t.number), "num"
        if t.kind == "op" and t.text == "(":
            self.take()
            self.enter(t.offset)
            node, kind = self.or_expr()
            self.expect(")")
            self.depth -= 1
            return node, kind
        if t.kind == "name":
            self.take()
            if t.text in KEYWORDS:
                raise ConditionError(f"'{t.text}' needs something on its left", t.offset)
            if self.at("("):
                return self.call(t)
            if t.text in FUNCS:
                raise ConditionError(f"'{t.text}' is a function: write {t.text}(...)", t.offset)
            if t.text not in NAMES:
                raise ConditionError(f"unknown name '{t.text}'{_did_you_mean(t.text, NAMES)}", t.offset)
            if self.tok.kind == "name" and self.tok.text not in KEYWORDS:
                raise ConditionError(f"unexpected '{self.tok.text}' after '{t.text}'", self.tok.offset)
            self.names.add(t.text)
            return ("name", t.text), "num"
        raise ConditionError(f"expected a number, a name or '(' but found {self._describe(t)}", t.offset)

    def call(self, fname: _Tok) -> tuple[Node, str]:
        if fname.text not in FUNCS:
            raise ConditionError(
                f"unknown function '{fname.text}' (allowed: {', '.join(FUNCS)})"
                f"{_did_you_mean(fname.text, tuple(FUNCS))}",
                fname.offset,
            )
        _, lo, hi = FUNCS[fname.text]
        self.enter(fname.offset)
        self.expect("(")
        args: list[Node] = []
        if not self.at(")"):
            while True:
                at = self.tok.offset
                node, kind = self.sum()
                self._need(kind, "num", at, fname.text)
                args.append(node)
                if not self.at(","):
                    break
                self.take()
        self.expect(")")
        if not lo <= len(args) <= hi:
            want = str(lo) if lo == hi else f"{lo} or more"
            raise ConditionError(f"{fname.text}() takes {want} argument(s), got {len(args)}", fname.offset)
        self.depth -= 1
        return ("call", fname.text, args), "num"


def _constant(node: Node) -> float | None:
    """The value of a part that reads no name (None if it reads one)."""
    if not _is_constant(node):
        return None
    return float(_eval(node, {}))


def _is_constant(node: Node) -> bool:
    kind = node[0]
    if kind == "num":
        return True
    if kind == "name":
        return False
    if kind == "neg":
        return _is_constant(node[1])
    if kind == "bin":
        return _is_constant(node[2]) and _is_constant(node[3])
    if kind == "call":
        return all(_is_constant(a) for a in node[2])
    return False


def _check_constant(node: Node, offset: int) -> None:
    value = _constant(node)
    if value is not None and not math.isfinite(value):
        what = "is NaN (0 / 0)" if math.isnan(value) else "overflows to infinity"
        raise ConditionError(f"this constant part {what}: the rule could never compare it", offset)


def _did_you_mean(word: str, options: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(word, options, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


@dataclass(frozen=True, slots=True)
class Condition:
    """A parsed condition. ``names`` are the variables it reads."""

    text: str
    tree: Node
    names: frozenset[str]

    def evaluate(self, env: Mapping[str, float]) -> bool:
        """True when the condition holds (the rule fails). ``env`` must hold every name used."""
        return bool(_eval(self.tree, env))


def parse_condition(text: str) -> Condition:
    """Parse ``text``; raises ``ConditionError`` with the offending column."""
    if not isinstance(text, str):
        raise ConditionError("a condition must be a string such as 'candidate > 0.05'", 0)
    if len(text) > MAX_LENGTH:
        raise ConditionError(f"condition is too long ({len(text):,} characters; the limit is {MAX_LENGTH:,})",
                             MAX_LENGTH)
    p = _Parser(text)
    tree = p.parse()
    names = set(p.names)
    if not names:
        always = bool(_eval(tree, {}))
        raise ConditionError(f"the condition reads no value (candidate, baseline, ...): it is always "
                             f"{'true' if always else 'false'}", 0)
    if "value" in names:
        names.discard("value")
        names.add("candidate")
    return Condition(text, tree, frozenset(names))


def _div(a: float, b: float) -> float:
    if b != 0:
        return a / b
    if a == 0 or math.isnan(a):
        return math.nan
    return math.copysign(math.inf, a) * (math.copysign(1.0, b))


def _eval(node: Node, env: Mapping[str, float]) -> float | bool:
    kind = node[0]
    if kind == "num":
        return float(node[1])
    if kind == "name":
        name = "candidate" if node[1] == "value" else node[1]
        return float(env[name])
    if kind == "neg":
        return -_eval(node[1], env)
    if kind == "bin":
        a, b = float(_eval(node[2], env)), float(_eval(node[3], env))
        op = node[1]
        if op == "+":
            return a + b
        if op == "-":
            return a - b
        if op == "*":
            return a * b
        return _div(a, b)
    if kind == "call":
        fn = FUNCS[node[1]][0]
        return float(fn(*(float(_eval(a, env)) for a in node[2])))
    if kind == "cmp":
        values = [float(_eval(x, env)) for x in node[2]]
        return all(_compare(op, a, b) for op, a, b in zip(node[1], values, values[1:], strict=False))
    if kind == "and":
        return bool(_eval(node[1], env)) and bool(_eval(node[2], env))
    if kind == "or":
        return bool(_eval(node[1], env)) or bool(_eval(node[2], env))
    if kind == "not":
        return not bool(_eval(node[1], env))
    raise ValueError(f"unknown node {kind!r}")


def _compare(op: str, a: float, b: float) -> bool:
    if op == "<":
        return a < b
    if op == "<=":
        return a <= b
    if op == ">":
        return a > b
    if op == ">=":
        return a >= b
    if op == "==":
        return a == b
    return a != b
