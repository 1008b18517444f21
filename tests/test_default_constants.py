"""The default rule's constants: ``scape.rules.CONSTANTS`` names the values the code uses, and
docs/design.md's table lists the same names and values with the docs entry that chose each."""

from __future__ import annotations

import dataclasses
import pathlib
import re

from scape import embeddings, rules, schedules

DESIGN = pathlib.Path(__file__).resolve().parents[1] / "docs" / "design.md"


def _live(name: str) -> object:
    """The value the code uses for the table's name (several names: a tuple)."""
    where = {"NOISE_BETA": rules, "STEADY_BETA": rules, "TRUST": rules,
             "SHORT_FACTOR": embeddings, "LONG_FACTOR": embeddings, "MAX_SHARE": embeddings,
             "RAMP_START": schedules, "RAMP_FACTOR": schedules, "RAMP_BUDGET": schedules,
             "RAMP_REFERENCE": schedules}
    values = []
    for part in (n.strip() for n in name.split(",")):
        if part == "Rule.explore":
            values.append(rules.RULES["agree"].explore)
        else:
            values.append(getattr(where[part], part))
    return values[0] if len(values) == 1 else tuple(values)


def test_the_table_in_code_is_what_the_code_uses():
    assert len(rules.CONSTANTS) >= 5
    for name, value, what, source in rules.CONSTANTS:
        assert _live(name) == value, name
        assert what and source, name
    assert {f.name for f in dataclasses.fields(rules.Rule)} >= {"explore"}


def test_design_lists_the_same_constants():
    text = DESIGN.read_text()
    start = text.index("**The default's constants**")
    table = text[start:].split("\n\n")[1]  # the paragraph after the heading line
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert rows, "the table is missing"
    names = []
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        names.append(", ".join(re.findall(r"`([^`]+)`", cells[0])))
        assert cells[3], row  # the entry that chose it
    assert names == [c[0] for c in rules.CONSTANTS]
