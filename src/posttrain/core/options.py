"""Declared options: what one setting accepts (`Spec`: type, range or choices, with the words an
error message gives for it) and an `Option` (name, default, spec, one line of doc). A formula,
a part of the online learner or a user's component declares its options once, as a tuple of
`Option`; the start-up check (config/), the constructor (`resolve_options`), `--help` and the
error messages all read that declaration. Plain Python: no torch, no config library.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Callable

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


# --- declared options ---------------------------------------------------------------------

@dataclass(frozen=True)
class Option:
    """One setting as its owner declares it: `name`, `default`, what it accepts (`spec`) and
    one line saying what it means (`doc`)."""

    name: str
    default: Any
    spec: Spec
    doc: str = ""

    @property
    def expected(self) -> str:
        """What the key accepts, followed by what it means (an error message's words)."""
        return f"{self.spec.expected} ({self.doc})" if self.doc else self.spec.expected

    def full_spec(self) -> Spec:
        """The spec with its meaning, as config/ checks the key."""
        return replace(self.spec, expected=self.expected)


def declared(options: Iterable[Option]) -> dict[str, Option]:
    """{name: option}, refusing a name declared twice."""
    table: dict[str, Option] = {}
    for option in options:
        if option.name in table:
            raise ValueError(f"option {option.name!r} is declared twice")
        table[option.name] = option
    return table


def option_specs(prefix: str, options: Iterable[Option]) -> dict[str, Spec]:
    """{"<prefix>.<name>": spec}: the declarations as config/ keys."""
    return {f"{prefix}.{option.name}": option.full_spec() for option in options}


def option_problems(owner: str, options: Iterable[Option], given: Mapping[str, Any]) -> list[str]:
    """A sentence per key of `given` that no option declares, and per value its option refuses;
    keys are named `<owner>.<key>`."""
    table = {option.name: option for option in options}
    problems = []
    unknown = sorted(set(given) - set(table))
    if unknown:
        problems.append(f"{owner}: unknown key(s) {unknown}; valid keys: {', '.join(table)}")
    for name, value in given.items():
        if name in table and not table[name].spec.accepts(value):
            problems.append(f"{owner}.{name}={value!r} is not valid: expected {table[name].expected}")
    return problems


def resolve_options(owner: str, options: Iterable[Option], given: Mapping[str, Any]) -> dict[str, Any]:
    """The declared options' values: `given`'s where set, else the defaults. A ValueError
    naming the key for an unknown key or a value its declaration refuses (core raises no
    user-facing error class: the caller turns it into a ConfigError)."""
    options = tuple(options)
    problems = option_problems(owner, options, given)
    if problems:
        raise ValueError("; ".join(problems))
    return {option.name: given.get(option.name, option.default) for option in options}


def merged(owners: Iterable[Iterable[Option]]) -> dict[str, Option]:
    """{name: option} over several owners' declarations (the estimators of one config group,
    which share a key such as `eps`): a name declared by several owners must mean the same
    there (the same words; a default may differ)."""
    table: dict[str, Option] = {}
    for options in owners:
        for option in options:
            seen = table.setdefault(option.name, option)
            if seen.expected != option.expected:
                raise ValueError(f"option {option.name!r} is declared twice with different meanings: "
                                 f"{seen.expected!r} and {option.expected!r}")
    return table


def register(registry: dict[str, Callable], family: str, name: str, fn: Callable) -> None:
    """`registry[name] = fn`, refusing a name another function already holds (a re-import of
    the same function replaces it)."""
    held = registry.get(name)
    where = lambda f: f"{f.__module__}.{f.__qualname__}"  # noqa: E731
    if held is not None and where(held) != where(fn):
        raise ValueError(f"{family} {name!r} is already registered by {where(held)}; give {where(fn)} another name")
    registry[name] = fn


def check_defaults(fn: Callable, options: Iterable[Option]) -> None:
    """Refuse a declaration whose default is not the function's own default for that keyword
    (they would disagree on what an unset key means)."""
    params = inspect.signature(fn).parameters
    for option in options:
        param = params.get(option.name)
        if param is None or param.default is param.empty or param.default != option.default:
            raise ValueError(f"{fn.__qualname__}: option {option.name!r} is declared with default "
                             f"{option.default!r}, but the function's keyword "
                             f"{'is missing' if param is None else f'defaults to {param.default!r}'}")


def declaring(registry: dict[str, Callable], family: str, name: str, options: Iterable[Option]):
    """The decorator of an estimator family: it declares the function's keyword `options` (each
    default the function's own), sets `fn.estimator_name` and `fn.options`, and registers it."""
    table = declared(options)

    def wrap(fn):
        check_defaults(fn, table.values())
        fn.estimator_name, fn.options = name, tuple(table.values())
        register(registry, family, name, fn)
        return fn

    return wrap
