"""Rows sorted by length and cut into buckets, each padded only to its own longest row.

Both training forwards lay rows out in buckets: the grouped forward its response attention
(`grouped_forward.response_buckets`), the model's own forward its whole rows
(`plain_forward`). A bucket is one more call (an attention call per layer, or one more model
forward), so rows are split only where the padding a split removes costs more than the call.
"""

from __future__ import annotations

from typing import Callable


def length_buckets(lengths: list[int], row_cost: Callable[[int], float], bucket_cost: float) -> list[list[int]]:
    """The rows of each bucket, given each row's length: rows sorted by length (longest first)
    and cut where the cut lowers the total cost, each row of a bucket whose longest row is L
    costing ``row_cost(L)`` and each bucket ``bucket_cost`` on top. The cuts are the cheapest
    (a dynamic programme over the distinct lengths). One bucket is ``[list(range(B))]``, the
    rows in their own order; rows of length 0 go in no bucket when there are several."""
    total = len(lengths)
    longest = max(lengths, default=0)
    needed = sum(row_cost(n) for n in lengths)  # no bucketing can go below this
    if total * row_cost(longest) - needed <= bucket_cost:
        return [list(range(total))]
    distinct = sorted({n for n in lengths if n > 0}, reverse=True)
    count = {n: 0 for n in distinct}
    for n in lengths:
        if n > 0:
            count[n] += 1
    rows_up_to = [0]  # rows_up_to[j]: rows of the j longest distinct lengths
    for n in distinct:
        rows_up_to.append(rows_up_to[-1] + count[n])
    best, cut = [0] + [None] * len(distinct), [0] * (len(distinct) + 1)
    for j in range(1, len(distinct) + 1):  # best[j]: the cheapest cover of the j longest lengths
        for i in range(j):  # one bucket holds distinct[i:j]; its longest is distinct[i]
            cost = best[i] + (rows_up_to[j] - rows_up_to[i]) * row_cost(distinct[i]) + bucket_cost
            if best[j] is None or cost < best[j]:
                best[j], cut[j] = cost, i
    bounds, j = [], len(distinct)
    while j > 0:
        bounds.append((distinct[cut[j]], distinct[j - 1]))
        j = cut[j]
    if len(bounds) == 1:  # rows of length 0 are not worth a layout of their own
        return [list(range(total))]
    order = sorted((r for r in range(total) if lengths[r] > 0), key=lambda r: -lengths[r])
    return [[r for r in order if low <= lengths[r] <= high] for high, low in reversed(bounds)]
