"""What `data.*` accepts (conf/data/: the task source, its difficulty, templates and the
columns of a dataset), and the rules that a source has what it reads."""

from __future__ import annotations

from posttrain.config.spec import (POSITIVE, SEED, Spec, Values, boolean, choice, integer, list_of, number, optional,
                                   pattern, rule, text)
from posttrain.data.arithmetic import STYLES
from posttrain.data.hub import REQUIRED_COLUMNS
from posttrain.data.sources import SOURCES, TRUNCATE_OPTIONS
from posttrain.data.templates import TEMPLATES
from posttrain.data.word_problems import OPERATIONS

SPECS: dict[str, Spec] = {
    "data.source": choice(*SOURCES),
    "data.min_digits": integer(1),
    "data.max_digits": integer(1),
    "data.num_operands": integer(2),
    "data.style": choice(*STYLES),
    "data.verbose_share": number(0, 1).about("style=mixed: share of problems with a verbose reference solution"),
    "data.seed": SEED,
    "data.min_steps": integer(1).about("word problems: fewest steps per story"),
    "data.max_steps": integer(1).about("word problems: most steps per story"),
    "data.max_number": integer(2).about("word problems: the largest number written in a story"),
    "data.operations": list_of(choice(*OPERATIONS)).about("word problems: the operations a step may use"),
    "data.distractors": number(0, 1).about("word problems: share of stories with an irrelevant sentence"),
    "data.shots": integer(0).about("word problems: worked examples before the question"),
    "data.step_separators": optional(list_of(pattern(r"(?s).+", "a non-empty string"))).about("process rewards: a step ends at each token holding one"),
    "data.max_response_tokens": integer(1).about("generation budget in tokens"),
    "data.max_prompt_tokens": optional(integer(1)).about("null: the model's context decides"),
    "data.truncate_prompts": optional(choice(*TRUNCATE_OPTIONS)).about("null: an over-long prompt is an error"),
    "data.files.train": text().about("a JSON-lines file"),
    "data.files.validation": optional(text()).about("a JSON-lines file"),
    "data.files.test": optional(text()).about("a JSON-lines file"),
    "data.path": text().about("a hub dataset name, or a local directory or json/jsonl/parquet file"),
    "data.config": optional(text()).about("the hub config, e.g. main"),
    "data.splits.train": text().about("the dataset's split to train on"),
    "data.splits.validation": optional(text()).about("null: hold out data.validation_size training examples"),
    "data.splits.test": optional(text()).about("null: none"),
    "data.validation_size": integer(0).about("training examples held out when there is no validation split"),
    "data.validation_seed": SEED.about("which training examples are held out"),
    "data.columns.prompt": text().about("the column holding the question"),
    "data.columns.answer": optional(text()).about("the column holding the final answer"),
    "data.columns.solution": optional(text()).about("the column holding the reference solution"),
    "data.template": choice(*TEMPLATES).about("how a question is asked"),
    "data.chat": boolean().about("true: prompts as chat messages, rendered with the model's chat template"),
    "data.verify_timeout_s": POSITIVE.about("seconds per answer check; longer counts as wrong"),
}


@rule
def digit_range_is_ordered(v: Values):
    """The difficulty ranges of the generated tasks: arithmetic's digits, word problems' steps."""
    if v.get("data.source") == "arithmetic" and v["data.min_digits"] > v["data.max_digits"]:
        yield (f"data.min_digits={v['data.min_digits']} is larger than data.max_digits={v['data.max_digits']}; "
               f"expected min_digits <= max_digits (the operands' digit range)")
    if v.get("data.source") == "word_problems":
        if v["data.min_steps"] > v["data.max_steps"]:
            yield (f"data.min_steps={v['data.min_steps']} is larger than data.max_steps={v['data.max_steps']}; "
                   f"expected min_steps <= max_steps (the steps per story)")
        if not v["data.operations"]:
            yield f"data.operations is empty; name at least one of {list(OPERATIONS)}"


@rule
def dataset_columns_are_named(v: Values):
    source = v.get("data.source")
    for key in REQUIRED_COLUMNS.get(source, ()):
        if v.get(f"data.columns.{key}") is None:
            yield f"data.source={source} reads data.columns.{key}, which is null; name the column that holds it"
