"""A preset command's documented figure is reached with the preset's own budget: the table
"Preset commands as written" of docs/results.md gives, for each command, the optimiser steps its
figure was measured at, and the command as written must run exactly that many."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from conftest import compose_config

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results.md"
SECTION = "## Preset commands as written"


def documented_budgets() -> list[tuple[str, int]]:
    """(command, steps) of each row of the section's table: `| \\`posttrain ...\\` | <steps> | ...`."""
    text = RESULTS.read_text()
    assert SECTION in text, f"{RESULTS.name} has no section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(posttrain[^`]*)` \| (\d+) \|", section, flags=re.M)
    assert rows, f"no `posttrain ...` | <steps> | rows in {SECTION!r}"
    return [(command, int(steps)) for command, steps in rows]


@pytest.mark.parametrize("command, steps", documented_budgets())
def test_a_documented_figure_needs_no_budget_beyond_the_preset(command, steps):
    overrides = shlex.split(command)[1:]
    assert compose_config(overrides).trainer.max_steps == steps, (
        f"`{command}` runs {compose_config(overrides).trainer.max_steps} steps, but its figure in "
        f"{RESULTS.name} was measured at {steps}: set the budget in the preset")
