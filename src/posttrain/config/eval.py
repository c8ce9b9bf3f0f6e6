"""What `eval.*` accepts (held-out evaluation, conf/train.yaml), and the rule that the split
it evaluates on has data."""

from __future__ import annotations

from typing import Iterator

from posttrain.config.spec import POSITIVE, SEED, Spec, Values, boolean, choice, integer, list_of, optional, rule, text
from posttrain.data.arithmetic import SPLITS
from posttrain.data.hub import REQUIRED_COLUMNS

SPECS: dict[str, Spec] = {
    "eval.split": choice(*SPLITS),
    "eval.num_prompts": integer(1).about("held-out prompts"),
    "eval.batch_size": integer(1),
    "eval.max_new_tokens": integer(1).about("generation budget in tokens"),
    "eval.at_start": boolean(),
    "eval.log_samples": integer(0).about("prompts in the samples table at each eval; 0: none"),
    "eval.pass_k": optional(list_of(integer(1))).about("each k <= eval.num_samples; null: no pass@k"),
    "eval.num_samples": integer(1).about("sampled responses per prompt for pass@k"),
    "eval.temperature": POSITIVE.about("sampling temperature for pass@k"),
    "eval.panel.size": integer(0).about("prompts of the panel (docs/panel.md); 0: no panel"),
    "eval.panel.seed": SEED.about("which held-out prompts make the panel, the same in every run"),
    "eval.panel.file": optional(text()).about("a JSON-lines file of the panel's examples; null: drawn from eval.split"),
}


@rule
def eval_split_has_data(v: Values):
    if v.get("data.source") in REQUIRED_COLUMNS:
        yield from dataset_split_exists(v, v["eval.split"])
    if v.get("data.source") != "jsonl":
        return
    split = v["eval.split"]
    if v.get(f"data.files.{split}") is None:
        yield (f"eval.split={split} needs data.files.{split} (a JSON-lines file of held-out examples), which is "
               f"null; set it, or evaluate on a split that has a file with eval.split=...")


def dataset_split_exists(v: Values, split: str) -> Iterator[str]:
    if v.get(f"data.splits.{split}") is not None:
        return
    if split != "validation":
        yield (f"eval.split={split} needs data.splits.{split} (the dataset's {split} split), which is null; set "
               f"it, or evaluate on another split with eval.split=...")
    elif v["data.validation_size"] == 0:
        yield ("eval.split=validation needs data.splits.validation (the dataset's validation split) or "
               "data.validation_size > 0 (training examples held out), but they are null and 0")
