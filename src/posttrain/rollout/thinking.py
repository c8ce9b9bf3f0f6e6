"""A thinking budget (Qwen3): a cap on the reasoning tokens of a response, after which the end
of the reasoning is forced and the model answers with what is left of the generation budget.

    1. generate at most `budget` tokens
    2. a row that ended there (EOS, or stopped as looping) is done; a row that wrote the
       end-of-thinking marker itself goes on as it is; any other row gets the marker appended
       (`forced`; only its missing tokens when the budget cut a marker of several tokens)
    3. the rows that go on are generated further from prompt + their tokens, each up to the
       rest of `params.max_new_tokens` (the marker's tokens count against it)

The marker is a token sequence: one token for Qwen3's "</think>" and for the embedded r1
template's tags, ">" after the column steps of the embedded verbose task. Any engine works:
`generate(prompt_ids, prompt_mask, params, generator=None) -> RolloutBatch`, as
`PosttrainModule.generate`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from .base import RolloutBatch, SamplingParams

Generate = Callable[..., RolloutBatch]


@dataclass
class BudgetedRollout:
    batch: RolloutBatch   # the whole responses: reasoning, the marker when forced, the answer
    forced: torch.Tensor  # [B] bool: the budget ran out before the reasoning ended, the marker was appended


def holds(tokens: list[int], marker: list[int]) -> bool:
    """Whether `marker` occurs in `tokens` as a run of consecutive tokens."""
    width = len(marker)
    return any(tokens[k:k + width] == marker for k in range(len(tokens) - width + 1))


def rest_of_marker(tokens: list[int], marker: list[int]) -> list[int]:
    """What to append to end the reasoning: the marker, less the part of it `tokens` already end
    with (a marker of several tokens cut by the budget)."""
    for written in range(min(len(marker) - 1, len(tokens)), 0, -1):
        if tokens[-written:] == marker[:written]:
            return marker[written:]
    return marker


def rows_of(batch: RolloutBatch) -> list[list[int]]:
    """The generated tokens of each row, without padding."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(batch.response_ids, batch.response_mask)]


def generate_with_thinking_budget(generate: Generate, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                                  params: SamplingParams, budget: int, end_of_thinking: Sequence[int], pad_id: int,
                                  generator: torch.Generator | None = None) -> BudgetedRollout:
    """Responses to left-padded prompts with at most `budget` reasoning tokens (module doc).
    With `budget` >= params.max_new_tokens this is one plain `generate` call."""
    marker = list(end_of_thinking)
    if not marker:
        raise ValueError("the end-of-thinking marker has no tokens")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(f"the thinking budget must be an integer >= 0 (tokens), got {budget!r}")
    rows = len(prompt_ids)
    if budget >= params.max_new_tokens:
        return BudgetedRollout(generate(prompt_ids, prompt_mask, params, generator=generator),
                               torch.zeros(rows, dtype=torch.bool))

    # 1. the reasoning, up to the budget
    tokens: list[list[int]] = [[] for _ in range(rows)]
    logprobs: list[list[float]] = [[] for _ in range(rows)]
    ended = [False] * rows
    repeated = [False] * rows
    if budget > 0:
        first = generate(prompt_ids, prompt_mask, replace(params, max_new_tokens=budget), generator=generator)
        tokens = rows_of(first)
        logprobs = [lp[mask.bool()].tolist() for lp, mask in zip(first.logprobs, first.response_mask)]
        ended = (~first.truncated.bool()).tolist()  # an EOS, or stopped as looping
        repeated = first.repeated.tolist() if first.repeated is not None else repeated

    # 2. the end of the reasoning: the model's own, or forced
    forced = [False] * rows
    for i in range(rows):
        if not ended[i] and not holds(tokens[i], marker):
            appended = rest_of_marker(tokens[i], marker)
            tokens[i] = tokens[i] + appended
            logprobs[i] = logprobs[i] + [0.0] * len(appended)  # appended, not sampled
            forced[i] = True
    truncated = [False] * rows
    remaining = [params.max_new_tokens - len(row) for row in tokens]
    going_on = [i for i in range(rows) if not ended[i] and remaining[i] > 0]
    for i in range(rows):
        if not ended[i] and remaining[i] <= 0:  # the marker filled the budget: no room for an answer
            tokens[i], logprobs[i] = tokens[i][:params.max_new_tokens], logprobs[i][:params.max_new_tokens]
            truncated[i] = True

    # 3. the answer, from prompt + reasoning, with the rest of the budget
    if going_on:
        prompts = [prompt_ids[i][prompt_mask[i].bool()].tolist() + tokens[i] for i in going_on]
        ids, mask = left_padded(prompts, pad_id, prompt_ids.device)
        longest = max(remaining[i] for i in going_on)
        second = generate(ids, mask, replace(params, max_new_tokens=longest), generator=generator)
        more_logprobs = [lp[m.bool()].tolist() for lp, m in zip(second.logprobs, second.response_mask)]
        for row, (i, more) in enumerate(zip(going_on, rows_of(second))):
            cut = len(more) > remaining[i]  # sampled past this row's own budget
            tokens[i] = tokens[i] + more[:remaining[i]]
            logprobs[i] = logprobs[i] + more_logprobs[row][:remaining[i]]
            truncated[i] = cut or bool(second.truncated[row])
            repeated[i] = not cut and second.repeated is not None and bool(second.repeated[row])
    batch = right_padded_batch(prompt_ids, prompt_mask, tokens, logprobs, truncated, repeated, pad_id)
    return BudgetedRollout(batch, torch.tensor(forced, dtype=torch.bool))


def left_padded(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row):] = 1
    return ids, mask


def right_padded_batch(prompt_ids, prompt_mask, tokens, logprobs, truncated, repeated, pad_id) -> RolloutBatch:
    width = max(1, max(len(row) for row in tokens))
    device = prompt_ids.device
    ids = torch.full((len(tokens), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(tokens), width), dtype=torch.long, device=device)
    lps = torch.zeros((len(tokens), width), device=device)
    for i, (row, lp) in enumerate(zip(tokens, logprobs)):
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, :len(row)] = 1
        lps[i, :len(lp)] = torch.tensor(lp)
    return RolloutBatch(prompt_ids, prompt_mask, ids, mask, lps, torch.tensor(truncated, device=device),
                        repeated=torch.tensor(repeated, device=device))
