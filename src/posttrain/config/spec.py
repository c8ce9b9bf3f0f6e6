"""The vocabulary the group files write in: what one key accepts, and how a rule across keys
reads the config.

A `Spec` is one key's type, range or allowed choices, with the words the error message
gives for it (`integer(1)` says "a positive integer"); the shared ones (SEED, POSITIVE, ...)
stand below. A rule is a function over `Values` that yields a sentence per problem it finds;
`@rule` marks it so that config/check.py can run it (and its test can find one it forgot).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

# The vocabulary itself lives with the declarations (core/options.py), where formulas and the
# learner's parts declare their options with it.
from posttrain.core.options import (BELOW_ONE, CLAMP, MAX_SEED, POSITIVE, PROBABILITY, SEED, Option,  # noqa: F401
                                    Spec, anything, boolean, choice, either, integer, is_int, is_number, list_of,
                                    mapping, number, option_specs, optional, pattern, text)


# --- how a rule reads the config ----------------------------------------------------------

MISSING = object()  # a `???` value: the user must supply it


class Unusable(Exception):
    """A rule read a key that is absent, `???` or already reported: the rule does not apply."""


class Values:
    """The config's values by dotted key, as the rules read them. `values`: every key, nodes
    as plain containers, `???` as MISSING; `bad`: the keys whose value a spec refused."""

    def __init__(self, values: dict[str, Any], bad: set[str], choices: dict[str, str]):
        self.values = values
        self.bad = bad
        self.choices = choices

    def __getitem__(self, key: str):
        value = self.values.get(key, MISSING)
        # a node is as unusable as any key under it: a rule would read the refused value inside it
        if value is MISSING or key in self.bad or any(bad.startswith(f"{key}.") for bad in self.bad):
            raise Unusable(key)
        return value

    def get(self, key: str, default=None):
        """The value, or `default` when the key is absent (as the code that reads it does)."""
        if key not in self.values:
            return default
        return self[key]

    def online(self) -> bool:
        return self.get("algorithm.kind") == "online"

    def algorithm(self) -> str:
        """The algorithm as the user chose it (Hydra's choice), for messages."""
        return self.choices.get("algorithm", self.get("algorithm.name"))


Rule = Callable[[Values], Iterator[str]]
DEFINED_RULES: list[Rule] = []  # every @rule of the group files, for the test that RULES runs them all


def rule(fn: Rule) -> Rule:
    DEFINED_RULES.append(fn)
    return fn
