"""Which rows of a minibatch each micro-batch (one forward and backward of gradient
accumulation) takes. Plain Python over the rows' lengths: no torch, no config.

  by rows    algorithm.micro_batch_size: runs of that many consecutive rows (the last one shorter)
  by tokens  algorithm.micro_batch_tokens: the rows sorted by length, then packed greedily, each
             micro-batch closed before the next row would take its padded size over the budget
  both       a micro-batch closes at whichever cap the next row would pass first

A micro-batch is trimmed to its own rows (`Experience.without_padding`): its padded size is
rows x (its widest prompt + its widest response). By rows, one long response widens every row
of its micro-batch; by tokens, rows of similar lengths share one, so short rows are not padded
to the longest row of the minibatch and a micro-batch of long rows has fewer of them. A row
over the budget on its own gets a micro-batch of its own (it cannot be split).

How the rows are split changes no gradient: the loss terms divide by counts over the whole
minibatch (learner.accumulate_gradients).
"""

from __future__ import annotations

from collections.abc import Sequence


def plan_micro_batches(prompt_lengths: Sequence[int], response_lengths: Sequence[int], *,
                       max_rows: int | None = None, max_tokens: int | None = None) -> list[list[int]]:
    """The micro-batches of a minibatch as lists of row indices, every row in exactly one, each
    list in batch order (a group's rows stay consecutive: the grouped forward runs their shared
    prompt once). `prompt_lengths` / `response_lengths`: the columns each row needs
    (`Experience.row_widths`). Neither cap set: one micro-batch of every row."""
    num_rows = len(prompt_lengths)
    if max_tokens is None:
        size = max_rows or max(1, num_rows)
        return [list(range(start, min(start + size, num_rows))) for start in range(0, num_rows, size)]
    shortest_first = sorted(range(num_rows), key=lambda row: prompt_lengths[row] + response_lengths[row])
    plan: list[list[int]] = []
    rows: list[int] = []
    widest_prompt = widest_response = 0
    for row in shortest_first:
        prompt, response = max(widest_prompt, prompt_lengths[row]), max(widest_response, response_lengths[row])
        rows_full = max_rows is not None and len(rows) == max_rows
        if rows and (rows_full or (len(rows) + 1) * (prompt + response) > max_tokens):
            plan.append(sorted(rows))  # closed: the next micro-batch starts with this row alone
            rows, prompt, response = [], prompt_lengths[row], response_lengths[row]
        rows.append(row)
        widest_prompt, widest_response = prompt, response
    if rows:
        plan.append(sorted(rows))
    return plan
