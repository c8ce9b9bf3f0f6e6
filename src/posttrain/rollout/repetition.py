"""Repetition detection: stop a response that has started to loop.

A response is *looping* once its last ``window`` tokens are one block of p <= ``ngram``
tokens repeated (y_s = y_{s-p} for each of the last window - p positions), so the block
occurs at least window / ngram times in a row. Such a row gets no more tokens: it ends where
the loop is detected, without an EOS, and is flagged ``RolloutBatch.repeated`` (and not
``truncated``, even when the loop is found at the budget's last token).

The check is incremental: per row and per period p it keeps the number of consecutive latest
tokens equal to the token p before them, a few [B, ngram] operations per decoding step. The
``fast`` engine runs it while sampling (a looping row is done, like an EOS row); ``hf`` and
``vllm`` replay the same check over the finished tokens (``first_repetition``), so every engine
cuts and flags the same rows at the same token.

The defaults (conf/rollout: ngram 16, window 64) cannot fire before 64 tokens, so never on the
embedded task at its budgets (a verbose solution would need more than ten identical columns),
and need four or more back-to-back copies of a block of at most 16 tokens, which natural text
does not have (tests/rollout/test_repetition.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.errors import ConfigError


@dataclass(frozen=True)
class RepetitionRule:
    """``ngram``: the longest repeated block looked for, in tokens; ``window``: how many of the
    latest tokens the repeats must fill (>= 2 ngram, so every block occurs at least twice)."""

    ngram: int
    window: int

    def validate(self) -> None:
        for key in ("ngram", "window"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"rollout.repetition.{key} must be a positive integer, got {value!r}")
        if self.window < 2 * self.ngram:
            raise ValueError(f"rollout.repetition.window={self.window} must be at least 2 x rollout.repetition.ngram "
                             f"= {2 * self.ngram}, so that a block is repeated at least twice")


def repetition_rule(cfg) -> RepetitionRule | None:
    """The rule of a ``rollout.repetition`` config node ({ngram, window}); None (off) when the
    node is absent or its ngram is null."""
    if cfg is None or cfg.get("ngram") is None:
        return None
    rule = RepetitionRule(ngram=cfg.get("ngram"), window=cfg.get("window"))
    try:
        rule.validate()
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return rule


class RepetitionDetector:
    """The incremental check for one batch of B rows. Call ``update`` once per decoding step
    with that step's tokens; ``repeated_at`` [B] is the step at which each row's loop was
    detected (-1: none)."""

    def __init__(self, rule: RepetitionRule, batch: int, device):
        self.periods = torch.arange(1, rule.ngram + 1, device=device)  # p = 1..ngram
        self.needed = rule.window - self.periods  # a loop of period p: run_p >= window - p
        # recent[:, p - 1] = the token p steps back (-1 before the start: equal to no token id)
        self.recent = torch.full((batch, rule.ngram), -1, dtype=torch.long, device=device)
        # run[:, p - 1] = how many latest tokens in a row equal the token p before them
        self.run = torch.zeros((batch, rule.ngram), dtype=torch.long, device=device)
        self.repeated_at = torch.full((batch,), -1, dtype=torch.long, device=device)

    def update(self, step: int, token: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        """Feed step ``step``'s tokens [B]; returns [B] bool, the rows not yet ``done`` (by EOS) whose
        loop is first detected at this token (recorded in ``repeated_at``)."""
        same = self.recent == token[:, None]
        self.run = (self.run + 1) * same
        self.recent = torch.cat([token[:, None], self.recent[:, :-1]], dim=1)
        looped = (self.run >= self.needed).any(dim=1) & ~done & (self.repeated_at < 0)
        self.repeated_at = torch.where(looped, step, self.repeated_at)
        return looped


def first_repetition(tokens: torch.Tensor, eos: torch.Tensor, rule: RepetitionRule) -> torch.Tensor:
    """The ``RepetitionDetector`` replayed over finished tokens [B, T] (anything after a row's
    first EOS ignored, as when sampling): [B] the step at which each row's loop is detected, -1
    for none. What ``fast`` computes while sampling, for the engines that cannot stop a row."""
    batch, steps = tokens.shape
    if steps < rule.window:  # too short to hold a loop
        return torch.full((batch,), -1, dtype=torch.long, device=tokens.device)
    detector = RepetitionDetector(rule, batch, tokens.device)
    done = torch.zeros(batch, dtype=torch.bool, device=tokens.device)
    for step in range(steps):
        token = tokens[:, step]
        done |= detector.update(step, token, done) | torch.isin(token, eos)
    return detector.repeated_at
