"""The rules ``update=`` accepts by name: :data:`RULES`, which starts with the built-in ones
(:data:`BUILTIN`), and :func:`register` and :func:`get`."""

from __future__ import annotations

from typing import Any

from scape.rules.builtin import BUILTIN_RULES
from scape.rules.rule import Rule

RULES: dict[str, Rule] = dict(BUILTIN_RULES)
"""The rules ``update=`` accepts by name: the three built in (:mod:`scape.rules`), and more by
:func:`register`."""

BUILTIN = tuple(RULES)
"""The names of the built-in rules (they cannot be replaced)."""


def register(name: str, rule: Rule, *, replace: bool = False) -> None:
    """Make ``rule`` available as ``scape.SCAPE(..., update=name)``.

    Register the same rule on every rank before building the optimizer (the optimizer checks
    that every rank uses the same name). A name already registered raises unless ``replace``;
    the built-in names (:data:`BUILTIN`) cannot be replaced.
    """
    if not isinstance(name, str) or not name or any(c.isspace() for c in name):
        raise ValueError(f"register: name must be a non-empty string without spaces, got "
                         f"{name!r}")
    if not isinstance(rule, Rule):
        raise TypeError(f"register: rule must be a scape.rules.Rule, got "
                        f"{type(rule).__name__}")
    if name in BUILTIN:
        raise ValueError(f"register: {name!r} is a built-in rule and cannot be replaced")
    if name in RULES and not replace and RULES[name] is not rule:
        raise ValueError(f"register: a rule named {name!r} is already registered (pass "
                         "replace=True to replace it)")
    RULES[name] = rule


def get(name: Any) -> Rule:
    """The rule registered as ``name``; ``ValueError`` naming the known ones otherwise."""
    if not isinstance(name, str) or name not in RULES:
        raise ValueError(f"Invalid update rule: {name!r} (expected one of {sorted(RULES)}, "
                         "or a name added with scape.rules.register)")
    return RULES[name]

