"""Table tests of the condition language: values, precedence, and rejected (unsafe) input."""

from __future__ import annotations

import pytest

from watchdog.policy.conditions import ConditionError, parse_condition

ENV = {"candidate": 0.08, "baseline": 0.02}


@pytest.mark.parametrize(
    ("text", "env", "expected"),
    [
        ("candidate > 0.05", ENV, True),
        ("candidate > 0.1", ENV, False),
        ("value < 0.9", {"candidate": 0.85}, True),
        ("value < 0.9", {"candidate": 0.95}, False),
        ("candidate - baseline > 0.02", ENV, True),
        ("candidate - baseline > 0.07", ENV, False),
        ("candidate / baseline > 1.5", ENV, True),
        ("candidate / baseline > 4.5", ENV, False),
        ("baseline / candidate < 1.1", {"candidate": 100.0, "baseline": 105.0}, True),
        ("baseline / candidate < 1.1", {"candidate": 60.0, "baseline": 100.0}, False),
        ("candidate > 5%", ENV, True),
        ("candidate > 10%", ENV, False),
        ("candidate > 1e-1", ENV, False),
        ("candidate > 2.5E-2", ENV, True),
        # precedence: * before -, comparison before and/or, and before or
        ("candidate - baseline * 2 > 0.03", ENV, True),
        ("(candidate - baseline) * 2 > 0.13", ENV, False),
        ("candidate > 1 or candidate > 0.05 and baseline < 0.03", ENV, True),
        ("(candidate > 1 or candidate > 0.05) and baseline > 0.03", ENV, False),
        ("not candidate > 0.05", ENV, False),
        ("not not candidate > 0.05", ENV, True),
        ("0.05 < candidate < 0.1", ENV, True),
        ("0.05 < candidate < 0.07", ENV, False),
        ("-candidate < -0.05", ENV, True),
        ("--candidate > 0.05", ENV, True),
        ("abs(baseline - candidate) > 0.05", ENV, True),
        ("min(candidate, baseline) >= 0.02", ENV, True),
        ("max(candidate, baseline, 0.5) == 0.5", ENV, True),
        ("candidate != baseline", ENV, True),
        ("candidate <= 0.08 and candidate >= 0.08", ENV, True),
        # IEEE division: x/0 is inf, 0/0 is NaN and NaN compares false
        ("candidate / baseline > 1.5", {"candidate": 0.1, "baseline": 0.0}, True),
        ("candidate / baseline > 1.5", {"candidate": 0.0, "baseline": 0.0}, False),
        ("candidate / baseline < 1.5", {"candidate": 0.0, "baseline": 0.0}, False),
        ("paired_hi < -0.01", {"paired_hi": -0.02}, True),
        ("paired_mean < 0 and paired_n >= 30", {"paired_mean": -0.1, "paired_n": 10}, False),
    ],
)
def test_condition_values(text: str, env: dict[str, float], expected: bool) -> None:
    assert parse_condition(text).evaluate(env) is expected


def test_names_value_is_candidate() -> None:
    assert parse_condition("value < 0.9").names == {"candidate"}
    assert parse_condition("baseline / candidate < 1.1").names == {"candidate", "baseline"}
    with pytest.raises(ConditionError, match="always true"):
        parse_condition("5 > 3")  # reads no value: a rule with it would always fail


def test_division_by_zero_negative_is_minus_inf() -> None:
    c = parse_condition("candidate / baseline < -1000")
    assert c.evaluate({"candidate": -1.0, "baseline": 0.0})
    assert not c.evaluate({"candidate": 1.0, "baseline": 0.0})


@pytest.mark.parametrize(
    ("text", "offset", "fragment"),
    [
        ("__import__('os')", 0, "unknown function '__import__'"),
        ("candidate > 0 and __import__('os').system('x')", 18, "unknown function '__import__'"),
        ("candidate.__class__ > 1", 9, "attribute access is not allowed"),
        ("().__class__", 1, "expected a number, a name or '('"),
        ("x.__class__", 0, "unknown name 'x'"),
        ("eval('1') > 0", 0, "unknown function 'eval'"),
        ("open('/etc/passwd')", 0, "unknown function 'open'"),
        ("exec > 1", 0, "unknown name 'exec'"),
        ("canidate > 0.05", 0, "did you mean 'candidate'"),
        ("lambda: 1", 0, "unknown name 'lambda'"),
        ("candidate[0] > 1", 9, "unexpected character '['"),
        ("'a' == 'a'", 0, "strings are not allowed"),
        ("candidate = 1", 10, "use == to compare"),
        ("candidate > 1 && baseline > 1", 14, "use and / or"),
        ("candidate > 1 ; 2", 14, "unexpected character ';'"),
        ("candidate ** 2 > 1", 11, "expected a number"),
        ("candidate", 0, "must be true or false"),
        ("candidate + 1", 0, "must be true or false"),
        ("", 0, "empty condition"),
        ("candidate > (1", 14, "expected ')'"),
        ("candidate > 1)", 13, "unexpected ')'"),
        ("abs(candidate, baseline) > 1", 0, "abs() takes 1 argument"),
        ("min(candidate) > 1", 0, "min() takes 2 or more"),
        ("abs > 1", 0, "is a function"),
        ("(candidate > 1) + 1 > 0", 0, "needs numbers"),
        ("candidate and baseline", 0, "needs a comparison"),
        ("not candidate", 4, "needs a comparison"),
        ("candidate baseline > 1", 10, "unexpected 'baseline'"),
        ("1.2.3 > candidate", 0, "bad number"),
        ("2x > candidate", 1, "unexpected 'x'"),
        ("and candidate > 1", 0, "needs something on its left"),
    ],
)
def test_rejected_conditions(text: str, offset: int, fragment: str) -> None:
    with pytest.raises(ConditionError) as info:
        parse_condition(text)
    assert fragment in info.value.message
    assert info.value.offset == offset


def test_non_string_rejected() -> None:
    with pytest.raises(ConditionError):
        parse_condition(0.5)  # type: ignore[arg-type]
