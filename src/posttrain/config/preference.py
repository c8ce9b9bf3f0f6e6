"""What `preference.*` accepts (conf/train.yaml: the preference pairs of `kind: preference`
algorithms, embedded or from a dataset; data/preference.py), and the rules that a dataset
source names its dataset and that embedded pairs can label a reward model's heads."""

from __future__ import annotations

from posttrain.config.spec import POSITIVE, SEED, Spec, Values, boolean, choice, integer, optional, rule, text
from posttrain.data.preference import embedded_heads_problem

SPECS: dict[str, Spec] = {
    "preference.source": choice("embedded", "dataset"),
    "preference.num_train_pairs": integer(1).about("embedded: training prompts, a pair each"),
    "preference.num_validation_pairs": integer(1).about("embedded: held-out prompts, a pair each"),
    "preference.samples_per_prompt": integer(2).about("embedded: a right and a wrong sample need two"),
    "preference.temperature": POSITIVE.about("embedded: sampling temperature"),
    "preference.seed": SEED,
    "preference.cache": boolean(),
    "preference.path": optional(text()).about("dataset: a hub name or a local file or directory"),
    "preference.config": optional(text()),
    "preference.splits.train": text(),
    "preference.splits.validation": optional(text()).about("null: hold out preference.validation_size pairs"),
    "preference.validation_size": integer(0),
    "preference.validation_seed": SEED,
    "preference.columns.prompt": text(),
    "preference.columns.chosen": text(),
    "preference.columns.rejected": text(),
    "preference.columns.head": text().about("optional: the reward-model head each pair trains (algorithm.heads)"),
    "preference.chat": boolean(),
}


@rule
def preference_dataset_is_named(v: Values):
    if v["algorithm.kind"] == "preference" and v["preference.source"] == "dataset" and not v["preference.path"]:
        yield ("preference.source=dataset needs preference.path (a local json/jsonl/parquet file or directory, or "
               "a hub name, with columns prompt/chosen/rejected)")


@rule
def embedded_pairs_label_the_heads(v: Values):
    """A reward model's several heads (algorithm.heads) must be ones the embedded pairs label, before the warm start."""
    embedded = v["algorithm.kind"] == "preference" and v["preference.source"] == "embedded"
    if embedded and (problem := embedded_heads_problem(v.get("algorithm.heads") or [])):
        yield problem
