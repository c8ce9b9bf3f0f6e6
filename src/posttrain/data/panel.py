"""The prompt panel: a fixed handful of held-out prompts that every run answers at every
held-out evaluation, so that runs can be read side by side (docs/panel.md).

The panel depends on the data config and the panel's own seed (or file) only: never on the
run's seed, its rank count or `eval.num_prompts`. From a file (`eval.panel.file`) it is the
file's examples in order; otherwise `size` examples of the eval split drawn with `seed`.
"""

from __future__ import annotations

import copy
import dataclasses
import random
from pathlib import Path

from posttrain.data.examples import Example
from posttrain.data.sources import read_jsonl_examples

# An endless (generated) split is drawn from its first this many indices: wide enough that
# two panel seeds share almost no prompt.
ENDLESS_POOL = 1_000_000


def panel_examples(source, split: str, size: int, seed: int, file: str | None = None) -> list[Example]:
    """The panel: the examples of `file` (JSON lines in the task's example form: `prompt`,
    `response` (the reference), optional `answer`; a bad line is a DataError naming file:line),
    else `size` examples of `split` of `source` drawn with `seed` (fewer when the split is
    smaller). `size` 0 without a file: no panel."""
    if file is not None:
        return read_jsonl_examples(Path(file), "eval.panel.file")
    if size == 0:
        return []
    prompts = fixed_seed_source(task_source(source), seed)
    available = prompts.size(split)
    pool = ENDLESS_POOL if available is None else available
    indices = random.Random(f"panel/{seed}").sample(range(pool), min(size, pool))
    return [prompts.example(split, index) for index in indices]


def task_source(source):
    """Where held-out prompts come from: a preference source's task, else the source itself."""
    return source.task if hasattr(source, "pairs") else source


def fixed_seed_source(source, seed: int):
    """`source`, but a generated task that draws its problems with the run's seed (arithmetic's
    `data.seed: ${seed}`) draws them with `seed` instead: a shallow copy, the run's source is
    left as it is. Sources without such a task are returned unchanged."""
    task = getattr(source, "task", None)
    if not dataclasses.is_dataclass(task) or "seed" not in {f.name for f in dataclasses.fields(task)}:
        return source
    panel_source = copy.copy(source)
    panel_source.task = dataclasses.replace(task, seed=seed)
    return panel_source
