"""Generated Python function tasks with unit tests (`data=code_tasks`): "Write a function
`sum_multiples(xs)` that returns the sum of the numbers in the list `xs` that are divisible by
3", with its reference solution and 4-8 assert statements, all made offline from a seed.

Each task comes from one of the FAMILIES (sum of multiples, counting characters, reversing
words, clamping, fizzbuzz with random divisors and words, running max/min/sum, digit sums in a
base, palindromes, power sums, rotating a list, ...), whose random parameters vary the
function's name, its parameters' names and its constants. A task's tests call the function on
varied inputs (edge cases first) and compare with what the reference solution returns, which is
executed here, in this process, to compute them: it is this module's own code, never a model's.

An `Example` of the source:

    prompt    the request: the signature, what it returns, one of the tests as an example, and
              "answer with the function in a ```python block"
    response  the reference solution in that shape (a ```python block), the SFT target
    answer    the tests: a JSON list of assert statements, each ``assert f(<literals>) ==
              <literal>`` (`tests_of` reads it back)
    messages  the prompt as one user message, with `chat`

Scoring runs model-written code, which only the sandbox may do (envs/sandbox.py, a layer above
this one): envs/code.py extracts the code, runs the tests and replies with the share passed
(`env=code`). This source's `is_correct` therefore delegates to a `verifier` that layer attaches
(`CodeEnvironment.attach(source)`), and refuses with a ConfigError while none is attached.

Splits and determinism, as in data/word_problems.py: a task belongs to exactly one split by a
stable hash of its specification (signature and description, not its test inputs), so the same
function is never asked in two splits; task ``i`` of a split is a pure function of (seed, split,
i, families). The training split is drawn with the run's ``seed``, the held-out splits with
``heldout_seed`` (`data.validation_seed`), the same in every run.
"""

from __future__ import annotations

import ast
import json
import random
import re
from dataclasses import dataclass, field
from typing import Callable

from posttrain.data.arithmetic import SPLITS, split_of
from posttrain.data.examples import Example, PromptLimits
from posttrain.errors import ConfigError, DataError

# Every character a prompt, a solution or a test can hold: the newline and printable ASCII (the
# embedded tiny model's character vocabulary).
ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))
MIN_TESTS, MAX_TESTS = 4, 8   # assert statements per task
EDGE_TESTS = 2                # of which at most this many are the family's edge cases
MAX_TRIES = 10_000            # draws before a split is declared unreachable with these families

LIST_NAMES = ("xs", "nums", "values", "numbers", "items")
TEXT_NAMES = ("s", "text", "line", "phrase")
WORDS = ("apple", "river", "stone", "cloud", "tiger", "lamp", "ocean", "green", "quiet", "sun", "map", "bird",
         "yellow", "paper", "glass", "moon", "tree", "salt", "honey", "road", "iron", "a", "up", "banana",
         "window", "echo", "idea", "under", "orbit", "zebra")


# --- what a family draws ---------------------------------------------------------------------

@dataclass(frozen=True)
class Draft:
    """A family's draw: the function asked for, and the inputs to test it on."""

    names: tuple[str, ...]         # the function's name and its parameters' names
    description: str               # what it returns, after "Write a Python function `f(x)` that"
    body: tuple[str, ...]          # the reference solution's body, one line each, unindented
    edges: list[tuple] = field(default_factory=list)    # argument tuples of edge cases
    inputs: Callable[[], list[tuple]] = list  # draws more argument tuples at random (once a draft is kept)


def _ints(rng: random.Random, low: int, high: int, min_len: int = 0, max_len: int = 8) -> list[int]:
    return [rng.randint(low, high) for _ in range(rng.randint(min_len, max_len))]


def _phrase(rng: random.Random, min_words: int = 0, max_words: int = 6, caps: bool = False) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))]
    if caps:
        words = [w.capitalize() if rng.random() < 0.3 else w.upper() if rng.random() < 0.1 else w for w in words]
    return " ".join(words)


def _lists(rng: random.Random, count: int, low: int = -20, high: int = 30, min_len: int = 1) -> list[tuple]:
    return [(_ints(rng, low, high, min_len),) for _ in range(count)]


def sum_multiples(rng):
    xs, k = rng.choice(LIST_NAMES), rng.randint(2, 6)
    name = rng.choice(("sum_multiples", "total_of_multiples", "multiple_sum", "add_multiples"))
    what = "even numbers" if k == 2 and rng.random() < 0.5 else f"numbers that are divisible by {k}"
    return Draft((name, xs), f"returns the sum of the {what} in the list `{xs}`",
                 (f"return sum(x for x in {xs} if x % {k} == 0)",), [([],), ([k, k + 1],)], lambda: _lists(rng, 12))


def count_chars(rng):
    s = rng.choice(TEXT_NAMES)
    vowels = rng.random() < 0.4
    chars = "aeiou" if vowels else "".join(sorted(rng.sample("bcdfghlmnprst", rng.randint(2, 4))))
    fold = rng.random() < 0.5
    name = rng.choice(("count_vowels", "vowel_count", "num_vowels") if vowels else
                      ("count_letters", "letter_count", "count_chosen", "tally_letters"))
    which = "vowels (a, e, i, o, u)" if vowels else "letters " + ", ".join(chars)
    case = ", upper and lower case alike" if fold else " (lower case only; upper-case letters do not count)"
    text = f"{s}.lower()" if fold else s
    return Draft((name, s), f"returns how many characters of the string `{s}` are {which}{case}",
                 (f"return sum(1 for c in {text} if c in {chars!r})",),
                 [("",), (chars.upper() + chars,)], lambda: [(_phrase(rng, 1, 5, caps=True),) for _ in range(12)])


def reverse_words(rng):
    s, sep = rng.choice(TEXT_NAMES), rng.choice((" ", "-", ", ", "|", "_", " / "))
    name = rng.choice(("reverse_words", "words_backwards", "flip_words", "reversed_words"))
    return Draft((name, s), f"takes a string `{s}` of words separated by single spaces and returns its words in "
                            f"reverse order, joined by {sep!r}",
                 (f"return {sep!r}.join(reversed({s}.split()))",), [("",), ("one",)],
                 lambda: [(_phrase(rng, 2, 6),) for _ in range(12)])


def clamp(rng):
    x = rng.choice(("x", "n", "value", "v"))
    low = rng.randint(-20, 10)
    high = low + rng.randint(1, 30)
    name = rng.choice(("clamp", "limit", "bound", "clip_value"))
    return Draft((name, x), f"returns the integer `{x}` limited to the range [{low}, {high}]: {low} when it is "
                            f"smaller, {high} when it is larger, else `{x}` itself",
                 (f"return max({low}, min({high}, {x}))",), [(low,), (high,)],
                 lambda: [(rng.randint(low - 15, high + 15),) for _ in range(12)])


def fizzbuzz(rng):
    n = rng.choice(("n", "k", "number"))
    a, b = rng.choice([(a, b) for a in range(2, 8) for b in range(2, 8) if a % b and b % a])  # each can divide alone
    one, two = rng.choice((("Fizz", "Buzz"), ("Foo", "Bar"), ("Ping", "Pong"), ("Tick", "Tock"), ("Zip", "Zap")))
    name = rng.choice(("fizz_buzz", "label_number", "word_for", "tag_number"))
    return Draft((name, n), f"returns {one + two!r} when `{n}` is divisible by both {a} and {b}, {one!r} when it "
                            f"is divisible by {a} only, {two!r} when it is divisible by {b} only, and otherwise "
                            f"`{n}` written as a string",
                 (f"if {n} % {a} == 0 and {n} % {b} == 0:", f"    return {one + two!r}",
                  f"if {n} % {a} == 0:", f"    return {one!r}", f"if {n} % {b} == 0:", f"    return {two!r}",
                  f"return str({n})"),
                 [(a * b,), (1,)], lambda: [(rng.randint(1, 100),) for _ in range(12)])


def running(rng):
    xs = rng.choice(LIST_NAMES)
    kind = rng.choice(("max", "min", "sum"))
    name = rng.choice((f"running_{kind}", f"prefix_{kind}", f"cumulative_{kind}"))
    what = {"max": "the largest", "min": "the smallest", "sum": "the sum"}[kind]
    step = f"{kind}(out[-1], x)" if kind != "sum" else "out[-1] + x"
    return Draft((name, xs), f"returns a list whose i-th element is {what} of the first i + 1 elements of the "
                             f"list `{xs}` (an empty list for an empty `{xs}`)",
                 ("out = []", f"for x in {xs}:", f"    out.append(x if not out else {step})", "return out"),
                 [([],), ([5],)], lambda: _lists(rng, 12))


def digit_sum(rng):
    n, base = rng.choice(("n", "number", "k")), rng.choice((2, 3, 5, 7, 8, 10, 10, 10))
    name = rng.choice(("digit_sum", "sum_of_digits", "digits_total"))
    where = f"the decimal digits of `{n}`" if base == 10 else f"the digits of `{n}` written in base {base}"
    return Draft((name, n), f"returns the sum of {where}, for a non-negative integer `{n}`",
                 ("total = 0", f"while {n} > 0:", f"    total += {n} % {base}", f"    {n} //= {base}",
                  "return total"),
                 [(0,), (base,)], lambda: [(rng.randint(1, 10 ** rng.randint(1, 7)),) for _ in range(12)])


def is_palindrome(rng):
    s = rng.choice(TEXT_NAMES)
    kind = rng.choice(("exact", "case", "alnum"))
    name = rng.choice(("is_palindrome", "reads_same_backwards", "palindromic", "check_palindrome"))
    rule = {"exact": "", "case": ", ignoring upper and lower case",
            "alnum": ", ignoring case and every character that is not a letter or a digit"}[kind]
    body = {"exact": (f"return {s} == {s}[::-1]",),
            "case": (f"t = {s}.lower()", "return t == t[::-1]"),
            "alnum": (f"t = [c.lower() for c in {s} if c.isalnum()]", "return t == t[::-1]")}[kind]

    def text():
        half = "".join(rng.choice("abcdexyz") for _ in range(rng.randint(1, 4)))
        word = half + rng.choice(("", "m", "q")) + half[::-1]
        if rng.random() < 0.5:
            word = word[:-1] + rng.choice("fgh")  # almost one
        if kind != "exact":
            word = "".join(c.upper() if rng.random() < 0.3 else c for c in word)
        if kind == "alnum" and len(word) > 2:
            cut = rng.randint(1, len(word) - 1)
            word = word[:cut] + rng.choice((" ", ", ", "!", " - ")) + word[cut:]
        return word

    return Draft((name, s), f"returns True when the string `{s}` reads the same forwards and backwards{rule}, and "
                            f"False otherwise",
                 body, [("",), ("Ab, ba" if kind == "alnum" else "Abba" if kind == "case" else "abca",)],
                 lambda: [(text(),) for _ in range(12)])


def power_sum(rng):
    n, p = rng.choice(("n", "k", "count")), rng.choice((1, 1, 2, 3))
    if p == 1:
        name = rng.choice(("triangular", "triangle_number", "sum_up_to", "nth_triangular"))
        what = f"the `{n}`-th triangular number 1 + 2 + ... + `{n}`"
    else:
        name = rng.choice(("power_sum", "sum_of_powers", "sum_powers"))
        what = f"1**{p} + 2**{p} + ... + `{n}`**{p}"
    return Draft((name, n), f"returns {what} (0 when `{n}` is 0), for a non-negative integer `{n}`",
                 (f"return sum(i ** {p} for i in range(1, {n} + 1))",), [(0,), (1,)],
                 lambda: [(rng.randint(2, 60),) for _ in range(12)])


def rotate(rng):
    xs, k, left = rng.choice(LIST_NAMES), rng.randint(1, 4), rng.random() < 0.5
    name = rng.choice(("rotate", "rotate_list", "shift_list", "cycle"))
    how = (f"to the left by {k} positions (the first element moves to the end, {k} times)" if left else
           f"to the right by {k} positions (the last element moves to the front, {k} times)")
    cut = f"{k} % len({xs})" if left else f"len({xs}) - {k} % len({xs})"
    return Draft((name, xs), f"returns a new list: the list `{xs}` rotated {how}; an empty list stays empty",
                 (f"if not {xs}:", "    return []", f"k = {cut}", f"return {xs}[k:] + {xs}[:k]"),
                 [([],), ([7],)], lambda: _lists(rng, 12, 0, 9))


def count_long_words(rng):
    s, k, strict = rng.choice(TEXT_NAMES), rng.randint(2, 5), rng.random() < 0.5
    name = rng.choice(("count_long_words", "long_word_count", "num_long_words"))
    what = f"more than {k}" if strict else f"at least {k}"
    op = ">" if strict else ">="
    return Draft((name, s), f"returns how many words of the string `{s}` (words are separated by whitespace) "
                            f"have {what} characters",
                 (f"return sum(1 for w in {s}.split() if len(w) {op} {k})",), [("",), ("ab " * k,)],
                 lambda: [(_phrase(rng, 1, 7),) for _ in range(12)])


def caesar(rng):
    s, k = rng.choice(TEXT_NAMES), rng.randint(1, 25)
    name = rng.choice(("caesar", "shift_letters", "rotate_letters", "encode"))
    return Draft((name, s), f"returns the string `{s}` with every lower-case letter a-z moved {k} places forward "
                            f"in the alphabet, wrapping around from z to a; every other character stays as it is",
                 ("out = []", f"for c in {s}:", "    if 'a' <= c <= 'z':",
                  f"        out.append(chr((ord(c) - ord('a') + {k}) % 26 + ord('a')))", "    else:",
                  "        out.append(c)", "return ''.join(out)"),
                 [("",), ("xyz",)],
                 lambda: [(_phrase(rng, 1, 4, caps=True) + rng.choice(("", "!", "?", " 42")),) for _ in range(12)])


def dedupe(rng):
    xs, repeated = rng.choice(LIST_NAMES), rng.random() < 0.4
    if repeated:
        name = rng.choice(("duplicates", "repeated_values", "find_repeats"))
        what = (f"the values that occur more than once in the list `{xs}`, each once, in the order of their "
                f"first occurrence")
        body = ("out = []", f"for x in {xs}:", f"    if {xs}.count(x) > 1 and x not in out:", "        out.append(x)",
                "return out")
    else:
        name = rng.choice(("dedupe", "unique", "remove_duplicates", "distinct"))
        what = f"the list `{xs}` without repeats: each value once, at its first occurrence, in the original order"
        body = ("out = []", f"for x in {xs}:", "    if x not in out:", "        out.append(x)", "return out")
    return Draft((name, xs), f"returns {what}", body, [([],), ([3, 3, 3],)], lambda: _lists(rng, 12, 0, 6))


def second_largest(rng):
    xs, largest = rng.choice(LIST_NAMES), rng.random() < 0.5
    word = "largest" if largest else "smallest"
    name = rng.choice((f"second_{word}", f"runner_up_{'max' if largest else 'min'}", f"next_to_{word}"))
    pick = "-2" if largest else "1"
    return Draft((name, xs), f"returns the second-{word} distinct value in the list `{xs}`, or None when `{xs}` has "
                             f"fewer than two distinct values",
                 (f"values = sorted(set({xs}))", f"return values[{pick}] if len(values) >= 2 else None"),
                 [([],), ([4, 4],)], lambda: _lists(rng, 12, -9, 9))


def chunk(rng):
    xs, k = rng.choice(LIST_NAMES), rng.randint(2, 4)
    name = rng.choice(("chunk", "chunks", "split_into_groups", "batch"))
    return Draft((name, xs), f"splits the list `{xs}` into consecutive pieces of {k} elements (the last piece may "
                             f"be shorter) and returns the list of pieces, each a list",
                 (f"return [{xs}[i:i + {k}] for i in range(0, len({xs}), {k})]",), [([],), (list(range(k)),)],
                 lambda: _lists(rng, 12, 0, 9))


def count_in_range(rng):
    xs = rng.choice(LIST_NAMES)
    low = rng.randint(-10, 10)
    high = low + rng.randint(0, 15)
    name = rng.choice(("count_in_range", "count_between", "in_range_count", "how_many_between"))
    return Draft((name, xs), f"returns how many numbers in the list `{xs}` are between {low} and {high}, both "
                             f"included",
                 (f"return sum(1 for x in {xs} if {low} <= x <= {high})",), [([],), ([low, high, high + 1],)],
                 lambda: _lists(rng, 12, low - 10, high + 10))


def count_substring(rng):
    s = rng.choice(TEXT_NAMES)
    t = "".join(rng.choice("ab") for _ in range(rng.randint(1, 3)))
    name = rng.choice(("count_occurrences", "count_pattern", "occurrences", "substring_count"))
    return Draft((name, s), f"returns how many times {t!r} occurs in the string `{s}`, counting occurrences that "
                            f"do not overlap, from left to right",
                 (f"return {s}.count({t!r})",), [("",), (t * 3,)],
                 lambda: [("".join(rng.choice("abc") for _ in range(rng.randint(1, 14))),) for _ in range(12)])


def differences(rng):
    xs, absolute = rng.choice(LIST_NAMES), rng.random() < 0.4
    name = rng.choice(("differences", "deltas", "steps_between", "pairwise_diff"))
    what, of = ("absolute differences", "the absolute value of ") if absolute else ("differences", "")
    diff = "abs(b - a)" if absolute else "b - a"
    return Draft((name, xs), f"returns the list of the {what} between consecutive elements of the list `{xs}`: for "
                             f"each element after the first, {of}it minus the element before it (an empty list when "
                             f"`{xs}` has fewer than two elements)",
                 (f"return [{diff} for a, b in zip({xs}, {xs}[1:])]",), [([],), ([5],)],
                 lambda: _lists(rng, 12, min_len=2))


def first_index(rng):
    xs, t = rng.choice(LIST_NAMES), rng.randint(-5, 20)
    op, words = rng.choice(((">", "greater than"), (">=", "at least"), ("<", "smaller than")))
    name = rng.choice(("first_index", "find_first", "index_of_first", "locate"))
    return Draft((name, xs), f"returns the index of the first element of the list `{xs}` that is {words} {t}, or "
                             f"-1 when there is none",
                 (f"for i, x in enumerate({xs}):", f"    if x {op} {t}:", "        return i", "return -1"),
                 [([],), ([t],)], lambda: _lists(rng, 12, t - 12, t + 12))


def transform_words(rng):
    s, kind = rng.choice(TEXT_NAMES), rng.choice(("title", "reverse", "upper_first_last"))
    name = rng.choice({"title": ("title_case", "capitalize_words", "cap_words"),
                       "reverse": ("reverse_each_word", "mirror_words", "flip_each_word"),
                       "upper_first_last": ("shout_ends", "upper_ends", "mark_ends")}[kind])
    what, word = {
        "title": ("its first letter in upper case and the rest in lower case", "w[:1].upper() + w[1:].lower()"),
        "reverse": ("its characters in reverse order", "w[::-1]"),
        "upper_first_last": ("its first and last characters in upper case and the rest as they are",
                             "w[:1].upper() + w[1:-1] + w[-1:].upper() if len(w) > 1 else w.upper()"),
    }[kind]
    return Draft((name, s), f"takes a string `{s}` of words separated by single spaces and returns it with every "
                            f"word changed to {what}, keeping the words' order and the single spaces",
                 (f"return ' '.join({word} for w in {s}.split(' '))",), [("",), ("a",)],
                 lambda: [(_phrase(rng, 1, 5, caps=True),) for _ in range(12)])


def to_base(rng):
    n, width, base = rng.choice(("n", "number", "value")), rng.randint(3, 10), rng.choice(("b", "b", "o"))
    what = "binary (base 2)" if base == "b" else "octal (base 8)"
    name = rng.choice((("to_binary", "binary_string", "as_binary") if base == "b" else
                       ("to_octal", "octal_string", "as_octal")))
    return Draft((name, n), f"returns the non-negative integer `{n}` written in {what} as a string of digits with "
                            f"no prefix, padded with leading zeros to at least {width} digits",
                 (f"return format({n}, '0{width}{base}')",), [(0,), (2 ** 20 + 3,)],
                 lambda: [(rng.randint(1, 10 ** rng.randint(1, 5)),) for _ in range(12)])


def interleave(rng):
    a, b = rng.choice((("xs", "ys"), ("first", "second"), ("left", "right"), ("a", "b")))
    name = rng.choice(("interleave", "alternate", "zip_merge", "weave"))
    return Draft((name, a, b), f"returns a list of the elements of the lists `{a}` and `{b}` taken in turns: `{a}[0]`, "
                               f"`{b}[0]`, `{a}[1]`, `{b}[1]`, ...; when one list runs out, the rest of the other "
                               f"follows in order",
                 ("out = []", f"for i in range(max(len({a}), len({b}))):", f"    if i < len({a}):",
                  f"        out.append({a}[i])", f"    if i < len({b}):", f"        out.append({b}[i])", "return out"),
                 [([], []), ([1, 2, 3], [])],
                 lambda: [(_ints(rng, 0, 9, 0, 5), _ints(rng, 10, 30, 0, 5)) for _ in range(12)])


def floor_mean(rng):
    xs, empty = rng.choice(LIST_NAMES), rng.choice((0, -1, None))
    name = rng.choice(("floor_mean", "mean_down", "average_floor", "int_mean"))
    return Draft((name, xs), f"returns the mean of the integers in the list `{xs}` rounded down to an integer (the "
                             f"sum floor-divided by the count), or {empty!r} when `{xs}` is empty",
                 (f"return sum({xs}) // len({xs}) if {xs} else {empty!r}",), [([],), ([-3, 0],)],
                 lambda: _lists(rng, 12))


def count_rises(rng):
    xs, rise = rng.choice(LIST_NAMES), rng.random() < 0.6
    name = rng.choice(("count_rises", "count_increases", "ups") if rise else ("count_drops", "count_falls", "downs"))
    what, op = ("larger", ">") if rise else ("smaller", "<")
    return Draft((name, xs), f"returns how many elements of the list `{xs}` are strictly {what} than the element "
                             f"just before them",
                 (f"return sum(1 for a, b in zip({xs}, {xs}[1:]) if b {op} a)",), [([],), ([2, 2, 2],)],
                 lambda: _lists(rng, 12, 0, 9))


FAMILIES: dict[str, Callable[[random.Random], Draft]] = {fn.__name__: fn for fn in (
    sum_multiples, count_chars, reverse_words, clamp, fizzbuzz, running, digit_sum, is_palindrome, power_sum,
    rotate, count_long_words, caesar, dedupe, second_largest, chunk, count_in_range, count_substring,
    differences, first_index, transform_words, to_base, interleave, floor_mean, count_rises)}


# --- tasks ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CodeTask:
    family: str
    name: str                # the function's name
    params: tuple[str, ...]  # its parameters' names
    description: str
    solution: str            # the reference function's source
    tests: tuple[str, ...]   # assert statements, each ``assert name(<literals>) == <literal>``

    @property
    def signature(self) -> str:
        return f"{self.name}({', '.join(self.params)})"

    @property
    def request(self) -> str:
        """What is asked, without the example: a split is drawn by its hash."""
        return f"Write a Python function `{self.signature}` that {self.description}."

    @property
    def prompt(self) -> str:
        shown = self.tests[-1].removeprefix("assert ")  # a drawn input, not an edge case
        return (f"{self.request}\n\nFor example, `{shown}`.\n\n"
                f"Answer with the complete function in a ```python code block.")

    @property
    def response(self) -> str:
        return f"```python\n{self.solution}\n```"


def reference_function(draft: Draft) -> str:
    name, *params = draft.names
    return "\n".join([f"def {name}({', '.join(params)}):", *(f"    {line}" for line in draft.body)])


def literal(value) -> str:
    """``repr(value)``, checked to read back as the same value (the tests are literals)."""
    text = repr(value)
    if ast.literal_eval(text) != value:
        raise ValueError(f"{text} does not read back as a literal")
    return text


def make_tests(draft: Draft, solution: str, count: int, rng: random.Random) -> tuple[str, ...]:
    """``count`` asserts on distinct inputs, at most EDGE_TESTS edge cases first, each expected
    value computed by running the reference `solution` (this module's own code)."""
    namespace: dict = {}
    exec(compile(solution, f"<reference {draft.names[0]}>", "exec"), namespace)  # our own generated code
    function = namespace[draft.names[0]]
    pool, seen = [], set()
    randoms = draft.inputs()
    rng.shuffle(randoms)
    for args in [*draft.edges[:EDGE_TESTS], *randoms]:
        call = f"{draft.names[0]}({', '.join(literal(a) for a in args)})"
        if call not in seen:
            seen.add(call)
            pool.append((call, args))
    tests = []
    for call, args in pool[:count]:
        expected = function(*json.loads(json.dumps(args)))  # a copy: the reference never sees the test's own lists
        tests.append(f"assert {call} == {literal(expected)}")
    return tuple(tests)


@dataclass(frozen=True)
class CodeTaskGenerator:
    """Tasks of ``families`` (all of FAMILIES by default), each with min_tests..max_tests tests."""

    families: tuple[str, ...] = tuple(FAMILIES)
    seed: int = 0           # draws the training split
    heldout_seed: int = 0   # draws validation and test: the same in every run
    min_tests: int = MIN_TESTS
    max_tests: int = MAX_TESTS
    split_fractions: tuple[float, float, float] = (0.9, 0.05, 0.05)

    def __post_init__(self):
        object.__setattr__(self, "families", tuple(self.families))
        unknown = [f for f in self.families if f not in FAMILIES]
        if not self.families or unknown:
            raise ValueError(f"families={list(self.families)} must be a non-empty list of {list(FAMILIES)}")
        if not 1 <= self.min_tests <= self.max_tests:
            raise ValueError(f"need 1 <= min_tests <= max_tests, got {self.min_tests}, {self.max_tests}")

    def task(self, split: str, index: int) -> CodeTask:
        """Task ``index`` of ``split``: drawn by rejection from a (seed, split, index, families)
        RNG until its request hashes into ``split``."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; choose one of {SPLITS}")
        seed = self.seed if split == "train" else self.heldout_seed
        rng = random.Random(f"code_tasks/{seed}/{split}/{index}/{','.join(self.families)}/"
                            f"{self.min_tests}-{self.max_tests}")
        for _ in range(MAX_TRIES):
            family = rng.choice(self.families)
            draft = FAMILIES[family](rng)
            name, *params = draft.names
            task = CodeTask(family, name, tuple(params), draft.description, "", ())
            if split_of(task.request, self.split_fractions) != split:
                continue
            solution = reference_function(draft)
            tests = make_tests(draft, solution, rng.randint(self.min_tests, self.max_tests), rng)
            return CodeTask(family, name, tuple(params), draft.description, solution, tests)
        raise ValueError(f"could not draw a {split} code task from families {list(self.families)} in {MAX_TRIES} "
                         f"tries: they have too few distinct tasks for this split; allow more families")

    def tasks(self, split: str, count: int, start: int = 0) -> list[CodeTask]:
        return [self.task(split, i) for i in range(start, start + count)]


# --- reading answers ---------------------------------------------------------------------------

FENCE = re.compile(r"```[ \t]*([^\n`]*)\n(.*?)```", re.DOTALL)
PYTHON_TAGS = ("python", "python3", "py")


def extract_code(response: str) -> str | None:
    """The code of a response: its last ```python (or ```py, ```python3) fenced block, else its
    last bare ``` block (no language named), else None. A block left open (a response cut at
    its budget) or empty does not count."""
    python, bare = None, None
    for match in FENCE.finditer(response):
        tag, body = match.group(1).strip().lower(), match.group(2)
        if not body.strip():
            continue
        if tag in PYTHON_TAGS:
            python = body
        elif not tag:
            bare = body
    code = python if python is not None else bare
    return None if code is None else code.rstrip() + "\n"


def tests_of(example: Example) -> list[str]:
    """An example's tests: its `answer`, a JSON list of assert statements."""
    try:
        tests = json.loads(example.answer) if example.answer is not None else None
    except json.JSONDecodeError as err:
        tests = err
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
        raise DataError(f"the code task with prompt {example.prompt[:60]!r} has no tests: its answer must be a JSON "
                        f"list of assert statements, got {str(example.answer)[:80]!r}")
    return tests


# --- the task source ---------------------------------------------------------------------------

class CodeTaskSource:
    """Endless seeded code tasks, asked as chat messages (`chat`) or plain text. Correctness
    needs the sandbox: `verifier` is attached from envs/code.py (CodeEnvironment.attach)."""

    def __init__(self, generator: CodeTaskGenerator, chat: bool = True):
        if not isinstance(chat, bool):
            raise ConfigError(f"data.chat={chat!r} must be true or false")
        self.generator, self.chat = generator, chat
        self.alphabet = ALPHABET
        self.prompt_limits = PromptLimits()
        self.step_rule = None  # build_source sets data.step_separators' rule, if any
        self.verifier: Callable[[Example, str], bool] | None = None

    def size(self, split: str) -> int | None:
        return None

    def origin(self, split: str, index: int) -> str | None:
        return None  # generated: no file to point at

    def example(self, split: str, index: int) -> Example:
        task = self.generator.task(split, index)
        messages = [{"role": "user", "content": task.prompt}] if self.chat else None
        return Example(task.prompt, task.response, json.dumps(list(task.tests)), messages=messages)

    def is_correct(self, example: Example, response: str) -> bool:
        """All the example's tests pass, run in the sandbox by the attached verifier."""
        if self.verifier is None:
            raise ConfigError("data=code_tasks is scored by running its tests in the sandbox (envs/code.py), which "
                              "the task source cannot do itself: train with env=code (its reward is the share of "
                              "tests passed, its verdict the accuracy), or attach the environment's verifier with "
                              "CodeEnvironment.attach(source)")
        return bool(self.verifier(example, response))

    def final_answer(self, response: str) -> str | None:
        """The response's code (majority voting compares these), None when it has none."""
        return extract_code(response)

    def has_style(self, response: str) -> bool:
        return extract_code(response) is not None


def build_code_task_source(data_cfg) -> CodeTaskSource:
    """The source of a `data=code_tasks` config node."""
    families = data_cfg.get("families")
    try:
        generator = CodeTaskGenerator(tuple(FAMILIES) if families is None else tuple(families), data_cfg.seed,
                                      data_cfg.validation_seed)
    except ValueError as err:
        raise ConfigError(f"data: {err}") from None
    return CodeTaskSource(generator, data_cfg.chat)
