"""The built-in reward components declare their options once (`options`, core.options.Option):
config/ reads the declaration for its start-up check, and the constructor takes exactly those
options with the declared defaults."""

from __future__ import annotations

import inspect

import pytest

from posttrain.config.check import SPECS
from posttrain.rewards.build import BUDGET_PARAM, RUN_PARAMS
from posttrain.rewards.components import REWARD_FUNCTIONS

DECLARED = {name: fn for name, fn in REWARD_FUNCTIONS.items() if getattr(fn, "options", ())}


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_a_components_declaration_is_its_constructors_options(name):
    parameters = inspect.signature(DECLARED[name]).parameters
    taken = {key: p.default for key, p in parameters.items() if key not in (BUDGET_PARAM, *RUN_PARAMS)}
    declared = {option.name: option.default for option in DECLARED[name].options}
    assert set(declared) == set(taken)
    for key, default in taken.items():
        if default is not inspect.Parameter.empty:  # a required option's default is the preset's to set
            assert declared[key] == default, key


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_config_checks_each_declared_option_with_its_declaration(name):
    for option in DECLARED[name].options:
        spec = SPECS[f"reward.components.{name}.{option.name}"]
        assert spec.expected == option.expected and option.doc in spec.expected
        if option.default is not None:
            assert spec.accepts(option.default)
