"""What the data keys accept, by concept: data.* (the task source, its difficulty, templates and
a dataset's columns), data_curriculum.* (which prompts a rollout batch draws) and preference.*
(the preference pairs of kind: preference algorithms, embedded or from a dataset); and the
rules that each source has what it reads."""

from __future__ import annotations

import re

from omegaconf import OmegaConf

from posttrain.config.spec import (MISSING, POSITIVE, PROBABILITY, SEED, Spec, Unusable, Values, boolean, choice,
                                   integer, list_of, number, optional, pattern, rule, text)
from posttrain.data.arithmetic import STYLES
from posttrain.data.code_tasks import FAMILIES
from posttrain.data.curriculum import CURRICULA
from posttrain.data.hub import REQUIRED_COLUMNS
from posttrain.data.mixture import mixture_weights, source_data_config, source_key
from posttrain.data.preference import embedded_heads_problem
from posttrain.data.reasoning_gym import ANSWER_FORMATS, TASK_KEYS, task_problems
from posttrain.data.sources import SOURCES, TRUNCATE_OPTIONS
from posttrain.data.templates import TEMPLATES
from posttrain.data.word_problems import OPERATIONS
from posttrain.errors import ConfigError
from posttrain.rewards import build_reward
from posttrain.rewards.mixture import source_reward_config


# --- data -------------------------------------------------------------------------------

DATA_SPECS: dict[str, Spec] = {
    "data.source": choice(*SOURCES),
    "data.min_digits": integer(1),
    "data.max_digits": integer(1),
    "data.num_operands": integer(2),
    "data.style": choice(*STYLES),
    "data.verbose_share": number(0, 1).about("style=mixed: share of problems with a verbose reference solution"),
    "data.seed": SEED,
    "data.min_steps": integer(1).about("word problems: fewest steps per story"),
    "data.max_steps": integer(1).about("word problems: most steps per story"),
    "data.max_number": integer(2).about("word problems: the largest number written in a story; guess_number: "
                                        "the largest secret"),
    "data.max_turns": integer(1).about("guess_number: the episode's turns (env.max_turns reads it)"),
    "data.operations": list_of(choice(*OPERATIONS)).about("word problems: the operations a step may use"),
    "data.distractors": number(0, 1).about("word problems: share of stories with an irrelevant sentence"),
    "data.shots": integer(0).about("word problems, reasoning-gym: worked examples before the question"),
    "data.families": optional(list_of(choice(*FAMILIES))).about("code tasks: the task families drawn; null: all"),
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
    "data.tasks": Spec(lambda v: isinstance(v, list) and len(v) > 0, "a non-empty list of reasoning-gym task names "
                       f"or mappings with keys {list(TASK_KEYS)}"),
    "data.size": integer(1).about("reasoning-gym: training examples per task"),
    "data.heldout_size": integer(0).about("reasoning-gym: examples per task in each held-out split"),
    "data.answer_format": choice(*ANSWER_FORMATS).about("reasoning-gym: tags: <answer>...</answer>; hash: #### ..."),
    "data.correct_threshold": number(0, 1, low_open=True).about("reasoning-gym: the least score_answer that is correct"),
    # one value: its sources' keys are checked by mixture_sources_are_valid, each as data.<key> alone
    "data.mixture": Spec(lambda v: isinstance(v, dict) and len(v) > 0,
                         "a non-empty mapping of source names to {weight, data, reward}").about(
        "data=mixture: the sources, e.g. {sums: {weight: 1, data: {source: arithmetic}}}"),
}


@rule
def reasoning_gym_tasks_are_known(v: Values):
    """Each entry of data.tasks names a reasoning-gym task, with known keys and config fields its config accepts."""
    if v.get("data.source") == "reasoning_gym":
        problems, _ = task_problems(v["data.tasks"], v["data.size"], v["data.heldout_size"], v["data.seed"])
        yield from problems


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


# The data rules that read one source's keys, run on each source of a mixture.
SOURCE_RULES = (reasoning_gym_tasks_are_known, digit_range_is_ordered, dataset_columns_are_named)


@rule
def mixture_sources_are_valid(v: Values):
    """data=mixture: each source's keys, weight, data node (its kind's keys and values, and the
    data rules, as that source alone would have them) and reward override."""
    if v.get("data.source") != "mixture":
        return
    mixture = v["data.mixture"]
    try:
        mixture_weights(mixture)
    except ConfigError as err:
        yield str(err)
        return
    for name, entry in mixture.items():
        try:
            node = source_data_config(name, entry.get("data"), v["data.seed"])
        except ConfigError as err:
            yield str(err)
            continue
        yield from source_data_problems(name, OmegaConf.to_container(node, resolve=True), v.choices)
        if entry.get("reward") is not None and v.get("reward") is not None:
            try:
                reward = source_reward_config(v["reward"], entry["reward"], name)
            except ConfigError as err:  # names the key itself
                yield str(err)
                continue
            try:
                build_reward(reward, None, v["rollout.max_new_tokens"])
            except ConfigError as err:
                yield f"{source_key(name, 'reward')}: {err}"


def source_data_problems(name: str, data: dict, choices: dict) -> list[str]:
    """The problems of source `name`'s data node, named data.mixture.<name>.data.<key>."""
    values = {f"data.{key}": value for key, value in flattened(data).items()}
    problems, bad = [], set()
    for key, value in values.items():
        spec = DATA_SPECS.get(key)
        if spec is None:
            problems.append(f"{key}: unknown key")
            bad.add(key)
        elif value is not MISSING and not spec.accepts(value):
            problems.append(f"{key}={value!r} is not valid: expected {spec.expected}")
            bad.add(key)
        elif value is MISSING:
            problems.append(f"{key} has no value (???): expected {spec.expected}")
            bad.add(key)
    source_values = Values({"data": data, **values}, bad, choices)
    for check in SOURCE_RULES:
        try:
            problems.extend(check(source_values))
        except Unusable:
            continue
    # each message names the key of the mixture's node, not the data node the source would have alone
    return [re.sub(r"\bdata\.(?!mixture\.)", f"{source_key(name, 'data')}.", problem) for problem in problems]


def flattened(node: dict, prefix: str = "") -> dict:
    """A data node's keys, dotted (data.files.train), down to the keys with a spec of their own."""
    flat = {}
    for key, value in node.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and f"data.{path}" not in DATA_SPECS:
            flat.update(flattened(value, f"{path}."))
        else:
            flat[path] = MISSING if value == "???" else value
    return flat


# --- data_curriculum --------------------------------------------------------------------

DATA_CURRICULUM_SPECS: dict[str, Spec] = {
    "data_curriculum.name": choice(*CURRICULA),
    "data_curriculum.max_extra_rounds": integer(0).about("extra generation rounds per step"),
    "data_curriculum.filter_on": choice("reward", "accuracy"),
    "data_curriculum.low": PROBABILITY.about("lowest pass rate kept"),
    "data_curriculum.high": PROBABILITY.about("highest pass rate kept"),
    "data_curriculum.pool_size": integer(1).about("prompts scored for their pass rate"),
    "data_curriculum.milestones": list_of(integer(1)).about("rollout batches at which the difficulty rises"),
    "data_curriculum.accuracy_threshold": optional(PROBABILITY),
    "data_curriculum.max_level": integer(0),
}


@rule
def curriculum_has_what_it_reads(v: Values):
    if not v.online():
        return
    name = v.get("data_curriculum.name", "none")
    if name == "pass_rate_filter" and v["data_curriculum.low"] > v["data_curriculum.high"]:
        yield (f"data_curriculum.low={v['data_curriculum.low']} is larger than "
               f"data_curriculum.high={v['data_curriculum.high']}; expected low <= high (the band of pass rates kept)")
    if name == "difficulty_schedule":
        if v.get("data.source") not in ("arithmetic", "word_problems", "reasoning_gym"):
            yield ("data_curriculum=difficulty_schedule raises the task's difficulty, which only data=arithmetic, "
                   f"data=word_problems and data=reasoning_gym have (data.source={v.get('data.source')!r})")
        tasks = v.get("data.tasks") if v.get("data.source") == "reasoning_gym" else None
        if isinstance(tasks, list) and not any(isinstance(t, dict) and t.get("level") is not None for t in tasks):
            yield ("data_curriculum=difficulty_schedule raises the level of the reasoning-gym tasks that set one, and "
                   "no entry of data.tasks does: give a task a starting level, e.g. {name: chain_sum, level: 0}")
        if not v.get("data_curriculum.milestones") and v.get("data_curriculum.accuracy_threshold") is None:
            yield ("data_curriculum=difficulty_schedule needs data_curriculum.milestones or "
                   "data_curriculum.accuracy_threshold, or it never changes anything")
    # correctness comes from the reward component named accuracy (rewards/composite.py)
    needs_accuracy = {
        "pass_rate_filter": "estimates pass rates",
        "dynamic_sampling": "filter_on=accuracy filters" if v.get("data_curriculum.filter_on") == "accuracy" else None,
        "difficulty_schedule": ("accuracy_threshold reads the training accuracy"
                                if v.get("data_curriculum.accuracy_threshold") is not None else None),
    }.get(name)
    components = v.get("reward.components")
    if needs_accuracy and isinstance(components, dict) and "accuracy" not in components:
        yield (f"data_curriculum={name} {needs_accuracy} from the reward's accuracy component, but "
               f"reward.components has none ({sorted(components)}); add reward.components.accuracy")


# --- preference -------------------------------------------------------------------------

PREFERENCE_SPECS: dict[str, Spec] = {
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


SPECS: dict[str, Spec] = {**DATA_SPECS, **DATA_CURRICULUM_SPECS, **PREFERENCE_SPECS}
