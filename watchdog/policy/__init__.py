"""YAML policies: safe conditions, validation with file:line:col errors, a pure decision engine
and hot reload. See docs/POLICIES.md."""

from watchdog.policy.conditions import Condition, ConditionError, parse_condition
from watchdog.policy.engine import PolicyEngine
from watchdog.policy.evaluate import Verdict, evaluate_rule
from watchdog.policy.loader import PolicyError, PolicyLoader, PolicySet, load_policy_files, parse_policy_text
from watchdog.policy.schema import LIVE_METRICS, Policy, Rule, parse_duration

__all__ = [
    "LIVE_METRICS",
    "Condition",
    "ConditionError",
    "Policy",
    "PolicyEngine",
    "PolicyError",
    "PolicyLoader",
    "PolicySet",
    "Rule",
    "Verdict",
    "evaluate_rule",
    "load_policy_files",
    "parse_condition",
    "parse_duration",
    "parse_policy_text",
]
