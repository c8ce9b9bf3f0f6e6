"""The vocabulary the group files write in: what one key accepts, and how a rule across keys
reads the config.

A `Spec` is one key's type, range or allowed choices, with the words the error message
gives for it (`integer(1)` says "a positive integer"); the shared ones (SEED, POSITIVE, ...)
stand below. A rule is a function over `Values` that yields a sentence per problem it finds;
`@rule` marks it so that config/check.py can run it (and its test can find one it forgot).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

# Numbers the checks and Lightning's `seed_everything` accept as a seed (numpy's uint32).
MAX_SEED = 2**32 - 1


# --- what one key accepts -----------------------------------------------------------------

@dataclass(frozen=True)
class Spec:
    """What one config key accepts: `accepts(value)` decides, `expected` says it in words
    for the error message. `descend`: a mapping value is a node whose own keys have specs
    (checked one by one) rather than one value."""

    accepts: Callable[[Any], bool]
    expected: str
    descend: bool = False

    def about(self, meaning: str) -> Spec:
        """The same spec, its description followed by what the key means."""
        return replace(self, expected=f"{self.expected} ({meaning})")


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # YAML's true is not 1


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def integer(low: int | None = None, high: int | None = None) -> Spec:
    if low is not None and high is not None:
        expected = f"an integer in [{low}, {high}]"
    elif low == 1:
        expected = "a positive integer"
    elif low is not None:
        expected = f"an integer >= {low}"
    else:
        expected = "an integer"
    return Spec(lambda v: is_int(v) and (low is None or v >= low) and (high is None or v <= high), expected)


def number(low: float | None = None, high: float | None = None, *, low_open: bool = False) -> Spec:
    """A finite number (an integer is one too) in [low, high], or (low, high] with `low_open`."""

    def accepts(value) -> bool:
        if not is_number(value):
            return False
        above = low is None or (value > low if low_open else value >= low)
        return above and (high is None or value <= high)

    if low is not None and high is not None:
        expected = f"a number in {'(' if low_open else '['}{low}, {high}]"
    elif low is not None:
        expected = f"a number {'>' if low_open else '>='} {low}"
    else:
        expected = "a finite number"
    return Spec(accepts, expected)


def boolean() -> Spec:
    return Spec(lambda v: isinstance(v, bool), "true or false")


def text() -> Spec:
    return Spec(lambda v: isinstance(v, str) and v.strip() != "", "a non-empty string")


def choice(*options) -> Spec:
    # compared by type too: Hydra reads `1` as an int, and `true` as a bool equal to 1
    def accepts(value) -> bool:
        return any(type(value) is type(option) and value == option for option in options)

    return Spec(accepts, f"one of {', '.join(repr(o) for o in options)}")


def pattern(regex: str, expected: str) -> Spec:
    return Spec(lambda v: isinstance(v, str) and re.fullmatch(regex, v) is not None, expected)


def list_of(item: Spec, length: int | None = None) -> Spec:
    def accepts(value) -> bool:
        return isinstance(value, list) and (length is None or len(value) == length) and all(map(item.accepts, value))

    count = "a list" if length is None else f"a list of {length} values"
    return Spec(accepts, f"{count}, each {item.expected}")


def mapping(example: str, non_empty: bool = False) -> Spec:
    def accepts(value) -> bool:
        return isinstance(value, dict) and (bool(value) or not non_empty)

    return Spec(accepts, f"a {'non-empty ' if non_empty else ''}mapping, e.g. {example}", descend=True)


def anything() -> Spec:
    return Spec(lambda v: True, "any value")


def optional(spec: Spec) -> Spec:
    return Spec(lambda v: v is None or spec.accepts(v), f"null or {spec.expected}", spec.descend)


def either(*specs: Spec, expected: str) -> Spec:
    return Spec(lambda v: any(s.accepts(v) for s in specs), expected, any(s.descend for s in specs))


SEED = integer(0, MAX_SEED)
POSITIVE = number(0, low_open=True)
BELOW_ONE = Spec(lambda v: is_number(v) and 0 <= v < 1, "a number in [0, 1)")
CLAMP = optional(POSITIVE).about("null: no clamp")
PROBABILITY = number(0, 1)


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
