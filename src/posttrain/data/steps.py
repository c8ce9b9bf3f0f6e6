"""Reasoning steps: how a response is split into steps, the one rule every process-level
piece shares (the oracle and learned PRMs, PRM training data, step rewards and
`advantage=prm_step`, the PRM early stop, best-of-N by PRM).

The rule is the task's (`data.step_separators`): a step ends at each token whose text holds
a separator, and the response's last token ends the last step. On the embedded task a step
is one written column, ``"7+5=12,"``, then ``"3+1+1=5>"`` (the last column), then the
final answer ``"532"`` with its EOS; on a dataset of written solutions, a line (``"\\n"``).

Working on tokens, not on text, keeps a step's end a token position: where its reward goes
(`Experience.step_mask`) and where a learned PRM reads its score.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from posttrain.errors import ConfigError


@dataclass(frozen=True)
class StepRule:
    separators: tuple[str, ...]

    def __post_init__(self):
        if not self.separators or not all(isinstance(s, str) and s for s in self.separators):
            raise ConfigError(f"data.step_separators={list(self.separators)!r} must be a non-empty list of "
                              f"non-empty strings (a step ends at each token whose text holds one)")

    def step_ends(self, pieces: Sequence[str]) -> list[int]:
        """Indices of the tokens that end a step, given each token's text: every token holding a
        separator, and the last token (which ends the last step even without one)."""
        ends = [i for i, piece in enumerate(pieces) if any(s in piece for s in self.separators)]
        if pieces and (not ends or ends[-1] != len(pieces) - 1):
            ends.append(len(pieces) - 1)
        return ends


def source_step_rule(source) -> StepRule:
    """The task's step rule (`data.step_separators`, set on the source by `build_source`)."""
    rule = getattr(source, "step_rule", None)
    if rule is None:
        raise ConfigError("data.step_separators is not set: process rewards need the task's rule for where a "
                          "reasoning step ends (e.g. [',', '>'] for the embedded task, ['\\n'] for written "
                          "solutions)")
    return rule


def token_pieces(tokenizer, ids: Sequence[int]) -> list[str]:
    """Each token's own text (special tokens, such as EOS, give '')."""
    return tokenizer.batch_decode([[int(t)] for t in ids], skip_special_tokens=True)


@dataclass
class Steps:
    """One response split into steps: each step's text (without special tokens) and the index
    of its last token in the response."""

    texts: list[str]
    ends: list[int]


def split_response(rule: StepRule, tokenizer, ids: Sequence[int]) -> Steps:
    """The steps of one response given as token ids (padding already removed)."""
    ends = rule.step_ends(token_pieces(tokenizer, ids))
    starts = [0] + [end + 1 for end in ends[:-1]]
    texts = tokenizer.batch_decode([list(ids[a:b + 1]) for a, b in zip(starts, ends)], skip_special_tokens=True)
    return Steps(list(texts), ends)


def step_token_row(tokenizer, prompt_ids: list[int], steps: Sequence[str], ended: bool) -> tuple[list[int], list[int]]:
    """How a learned PRM sees a response, in training and in scoring alike: the prompt's ids, then
    each step's text tokenised on its own, then EOS when the response ended. Returns (row, the
    index in the row of each step's last token; the last step's is the EOS when there is one)."""
    row, ends = list(prompt_ids), []
    for text in steps:
        row += tokenizer(text, add_special_tokens=False)["input_ids"]
        ends.append(len(row) - 1)
    if ended:
        row.append(tokenizer.eos_token_id)
        if ends:
            ends[-1] = len(row) - 1
    return row, ends


def split_text(rule: StepRule, text: str) -> list[str]:
    """The steps of a response known only as text (held-out samples): the same cut as
    `split_response` wherever the tokenizer does not merge a separator with the text around it
    (the embedded tokenizer has one character a token)."""
    steps, start = [], 0
    for i, char in enumerate(text):
        if any(text.endswith(s, start, i + 1) for s in rule.separators):
            steps.append(text[start:i + 1])
            start = i + 1
    if start < len(text) or not steps:
        steps.append(text[start:])
    return steps
