"""The `posttrain-sample` entry point: off-policy distillation data by rejection sampling (conf/sample.yaml).

    posttrain-sample teacher=tiny_concise sample.num_prompts=4096 sample.samples_per_prompt=2
    posttrain-sample teacher=outputs/sft/runs/<time> sample.keep_per_prompt=1 sample.output=data/distill
    posttrain algorithm=sft data=jsonl data.files.train=data/distill/train.jsonl \
        data.files.validation=data/distill/validation.jsonl

DeepSeek-R1's distillation into small models, in two commands: a strong model samples responses to
a task's prompts and the task's verifier keeps the right ones (this command); then the student is
trained on them by SFT. The model (`teacher=`) is found as the distillation algorithms find their
teacher (prepare/teachers.py): an HF directory, a run directory (its hf_model/, else its last
checkpoint), a Lightning checkpoint, or an embedded recipe (`tiny_concise`, `tiny_verbose`: trained
on the task once and cached; when the cache has none yet it is trained here by one `posttrain
algorithm=opd teacher=<recipe>` run, the code that trains it for a distillation run).

It samples `sample.samples_per_prompt` responses to each of the first `sample.num_prompts` prompts
of `sample.split` and keeps a response when it ended (EOS within the budget) and the task's
verifier (`source.is_correct`) accepts it; with `sample.dedupe` each distinct text once per prompt,
and at most `sample.keep_per_prompt` per prompt. It writes, atomically, into `sample.output`:

    train.jsonl       the kept responses: {"prompt", "response", "answer"} a line (data=jsonl's format)
    validation.jsonl  the first sample.validation_prompts held-out prompts (eval.split) with their
                      reference responses, so the SFT run evaluates on the task's own held-out set
    summary.json      prompts, samples drawn, verified, kept, acceptance rate, the teacher's tokens

The teacher's cost is counted in tokens it generated (`teacher_generated_tokens`, EOS included),
the unit on-policy distillation's cost is counted in too (the student's tokens the teacher scores).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from posttrain.errors import CheckpointError, ConfigError, DataError
from posttrain.run.boundary import hydra_command, log, silence_expected_warnings
from posttrain.run.cli import override_key

# The keys of this command's own that a `posttrain` run training an embedded teacher must not get.
OWN_KEYS = ("sample", "teacher", "algorithm", "experiment", "task_name", "hydra")


# --- the settings -----------------------------------------------------------------------------

def check_settings(settings: DictConfig, eval_split: str) -> None:
    """ConfigErrors naming the `sample.*` key whose value cannot work."""
    def whole(key: str, low: int, allow_none: bool = False) -> None:
        value = settings.get(key)
        if value is None and allow_none:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            what = f"an integer >= {low}" + (" (or null)" if allow_none else "")
            raise ConfigError(f"sample.{key}={value!r} must be {what}")

    if settings.split not in ("train", "validation", "test"):
        raise ConfigError(f"sample.split={settings.split!r} is not one of train, validation, test")
    whole("num_prompts", 1)
    whole("samples_per_prompt", 1)
    whole("max_new_tokens", 1, allow_none=True)
    whole("keep_per_prompt", 1, allow_none=True)
    whole("validation_prompts", 0)
    whole("prompts_per_call", 1)
    whole("seed", 0)
    temperature = settings.temperature
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ConfigError(f"sample.temperature={temperature!r} must be a number > 0 (rejection sampling draws "
                          f"several different responses per prompt)")
    if not isinstance(settings.dedupe, bool):
        raise ConfigError(f"sample.dedupe={settings.dedupe!r} must be true or false")
    if settings.dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"sample.dtype={settings.dtype!r} is not one of float32, bfloat16, float16")
    if settings.validation_prompts > 0 and settings.split == eval_split:
        raise ConfigError(f"sample.split={settings.split!r} is also eval.split, whose prompts validation.jsonl holds "
                          f"out: sample another split, or set sample.validation_prompts=0")


# --- the model --------------------------------------------------------------------------------

def model_directory(cfg: DictConfig) -> str:
    """The HF directory of `cfg.teacher` (an embedded recipe trained first when not cached)."""
    # start-up: torch and transformers load once the arguments are checked
    from posttrain.prepare.teachers import RECIPES, embedded_teacher, recipe_plan, teacher_directory

    teacher = cfg.get("teacher")
    if teacher is None:
        raise ConfigError(f"teacher= names the model to sample: an HF model directory, a run directory, a Lightning "
                          f"checkpoint, or one of {', '.join(RECIPES)}")
    teacher = str(teacher)
    if teacher not in RECIPES:
        return teacher_directory(cfg, teacher)
    _, target = recipe_plan(cfg, teacher)
    if not (target / "hf_model").is_dir():
        train_embedded_teacher(teacher)

    def not_in_cache(*args, **kwargs):
        raise CheckpointError(f"teacher={teacher}: the posttrain run that trains it finished, but its cache entry "
                              f"is not {target}: the run's settings and these differ in a key of the recipe")

    return embedded_teacher(cfg, teacher, train=not_in_cache)


def command_line_overrides() -> list[str]:
    """This job's command-line overrides, as typed."""
    # start-up: Hydra's internals load only inside a job
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def train_embedded_teacher(recipe: str) -> None:
    """Train the embedded teacher `recipe` into the cache with the code a distillation run trains it
    with: `posttrain algorithm=opd teacher=<recipe>` with this command line's task settings, no
    student warm start and one step (its run directory is a temporary one, removed after)."""
    forwarded = [o for o in command_line_overrides() if override_key(o).split(".")[0].split("/")[0] not in OWN_KEYS]
    with tempfile.TemporaryDirectory(prefix="posttrain-sample-") as scratch:
        command = [sys.executable, "-m", "posttrain.train", *forwarded, "algorithm=opd", f"teacher={recipe}",
                   "algorithm.warm_start.steps=0", "trainer.max_steps=1", "eval.at_start=false", "logger=none",
                   f"hydra.run.dir={scratch}"]
        log.info(f"Teacher {recipe}: not cached yet; training it with: {' '.join(command[1:])}")
        result = subprocess.run(command, check=False)
    if result.returncode != 0:
        raise CheckpointError(f"teacher={recipe}: the run that trains it failed (exit code {result.returncode}): "
                              f"{' '.join(command[1:])}")


def response_budget(cfg: DictConfig) -> int:
    """New tokens per response: sample.max_new_tokens, else an embedded teacher's longest solution
    of its own style, else data.max_response_tokens."""
    from posttrain.prepare.teachers import RECIPES, longest_response_tokens  # start-up: as model_directory

    if cfg.sample.max_new_tokens is not None:
        return cfg.sample.max_new_tokens
    if cfg.get("teacher") in RECIPES:
        data_cfg = cfg.data.copy()
        with open_dict(data_cfg):
            data_cfg.style = RECIPES[cfg.teacher]
        return longest_response_tokens(data_cfg)
    return cfg.data.max_response_tokens


# --- the selection ----------------------------------------------------------------------------

def select_responses(texts: list[str], ended: list[bool], verdicts: list[bool], keep_per_prompt: int | None,
                     kept_before: set[str] | None) -> tuple[list[int], dict[str, int]]:
    """The samples of one prompt to keep, by position, and why the others were not: a sample is
    kept when it ended (not cut by the budget) and the verifier accepts it, unless its text is in
    `kept_before` (dedupe: the responses already kept for this prompt text, here or at another
    index of the split; the kept texts are added to it; None: no dedupe), or `keep_per_prompt`
    of this prompt's samples are kept already."""
    kept: list[int] = []
    counts = {"verified": 0, "truncated": 0, "duplicates": 0, "over_keep_per_prompt": 0}
    for position, (text, finished, right) in enumerate(zip(texts, ended, verdicts, strict=True)):
        if not finished:
            counts["truncated"] += 1
            continue
        if not right:
            continue
        counts["verified"] += 1
        if kept_before is not None and text in kept_before:
            counts["duplicates"] += 1
        elif keep_per_prompt is not None and len(kept) >= keep_per_prompt:
            counts["over_keep_per_prompt"] += 1
        else:
            kept.append(position)
            if kept_before is not None:
                kept_before.add(text)
    return kept, counts


def prompt_of(example) -> str | list[dict]:
    """An example's prompt as data=jsonl reads it: the text, or the chat messages it came as."""
    return example.messages if example.messages is not None else example.prompt


# --- the command ------------------------------------------------------------------------------

def sample_dataset(cfg: DictConfig) -> dict:
    """Sample, verify, keep and write (see the module); returns summary.json's contents."""
    OmegaConf.resolve(cfg)  # as a run resolves it: an embedded teacher's cache key is made from it
    settings = cfg.sample
    check_settings(settings, cfg.eval.split)

    # start-up: what sampling needs loads once the settings are checked
    import torch

    from posttrain.data.datamodule import collate_prompts, fit_prompts
    from posttrain.data.sources import build_source
    from posttrain.files import write_json_atomic, write_jsonl_atomic
    from posttrain.models.loading import DTYPES, load_pretrained
    from posttrain.prepare.sampling import PolicySampler
    from posttrain.rollout.base import decode_responses

    silence_expected_warnings()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    source = build_source(cfg.data)
    size = source.size(settings.split)
    if size == 0:
        raise DataError(f"sample.split={settings.split!r} of data.source={cfg.data.source} has no prompts")
    count = settings.num_prompts if size is None else min(size, settings.num_prompts)
    directory = model_directory(cfg)
    budget = response_budget(cfg)
    tokenizer, model = load_pretrained(directory, "teacher", DTYPES[settings.dtype])
    device = torch.device("cuda" if cfg.trainer.accelerator != "cpu" and torch.cuda.is_available() else "cpu")
    model.to(device)
    fit_prompts(source, tokenizer, {settings.split: count})  # an over-long prompt: an error naming it (or cut)
    sampler = PolicySampler(cfg.rollout, tokenizer, model)
    generator = torch.Generator(device=device).manual_seed(settings.seed)
    n = settings.samples_per_prompt

    log.info(f"sampling {count} {settings.split} prompts x {n} from {directory} (temperature {settings.temperature:g}, "
             f"up to {budget} new tokens)")
    started = time.perf_counter()
    rows, totals = [], {"verified": 0, "truncated": 0, "duplicates": 0, "over_keep_per_prompt": 0}
    generated_tokens = prompt_tokens = kept_tokens = prompts_with_kept = 0
    kept_texts: dict[str, set[str]] = {}  # prompt -> its kept responses (dedupe), over the whole split
    for start in range(0, count, settings.prompts_per_call):
        examples = [source.example(settings.split, i) for i in range(start, min(count, start + settings.prompts_per_call))]
        batch = collate_prompts(examples, tokenizer)
        rollout = sampler.generate(batch["prompt_ids"].repeat_interleave(n, dim=0).to(device),
                                   batch["prompt_mask"].repeat_interleave(n, dim=0).to(device),
                                   settings.temperature, budget, generator)
        texts = decode_responses(tokenizer, rollout.response_ids, rollout.response_mask)
        lengths = rollout.response_mask.sum(dim=1).tolist()
        ended = (~rollout.truncated).tolist()
        generated_tokens += int(sum(lengths))
        prompt_tokens += int(rollout.prompt_mask.sum())
        for offset, example in enumerate(examples):
            group = slice(offset * n, (offset + 1) * n)
            verdicts = [bool(source.is_correct(example, text)) for text in texts[group]]
            kept_before = kept_texts.setdefault(json.dumps(prompt_of(example)), set()) if settings.dedupe else None
            kept, counts = select_responses(texts[group], ended[group], verdicts, settings.keep_per_prompt,
                                            kept_before)
            for key, value in counts.items():
                totals[key] += value
            prompts_with_kept += bool(kept)
            for position in kept:
                rows.append({"prompt": prompt_of(example), "response": texts[group][position],
                             "answer": example.answer})
                kept_tokens += lengths[offset * n + position]
    seconds = time.perf_counter() - started
    samples = count * n
    if not rows:
        raise DataError(f"none of the {samples} samples of {directory} was kept ({totals['verified']} verified, "
                        f"{totals['truncated']} cut by the budget of {budget} tokens): nothing written. Sample a "
                        f"stronger model, more samples_per_prompt, or a larger sample.max_new_tokens")

    output = Path(settings.output)
    files = {"train": str(output / "train.jsonl")}
    write_jsonl_atomic(output / "train.jsonl", rows)
    validation = validation_rows(source, cfg.eval.split, settings.validation_prompts)
    if validation:
        files["validation"] = str(output / "validation.jsonl")
        write_jsonl_atomic(output / "validation.jsonl", validation)
    summary = {
        "prompts": count, "samples_per_prompt": n, "samples": samples, "verified": totals["verified"],
        "verified_rate": totals["verified"] / samples, "kept": len(rows), "acceptance_rate": len(rows) / samples,
        "truncated": totals["truncated"], "duplicates_dropped": totals["duplicates"],
        "over_keep_per_prompt_dropped": totals["over_keep_per_prompt"], "prompts_with_kept": prompts_with_kept,
        "teacher_generated_tokens": generated_tokens, "teacher_prompt_tokens": prompt_tokens,
        "kept_response_tokens": kept_tokens, "sampling_seconds": round(seconds, 2),
        "teacher": str(cfg.teacher), "teacher_dir": directory, "split": settings.split,
        "temperature": settings.temperature, "max_new_tokens": budget, "keep_per_prompt": settings.keep_per_prompt,
        "dedupe": settings.dedupe, "seed": settings.seed, "validation_rows": len(validation), "files": files,
        "data": OmegaConf.to_container(cfg.data),
    }
    write_json_atomic(output / "summary.json", summary)
    print_summary(summary, output)
    return summary


def validation_rows(source, split: str, count: int) -> list[dict]:
    """The first `count` prompts of the held-out `split` with their reference responses (none when
    the task has no such split)."""
    if count == 0:
        return []
    try:
        size = source.size(split)
    except ConfigError:  # a jsonl task without that file
        log.warning(f"the task has no {split} split: no validation.jsonl written")
        return []
    count = count if size is None else min(size, count)
    examples = [source.example(split, i) for i in range(count)]
    return [{"prompt": prompt_of(e), "response": e.response, "answer": e.answer} for e in examples]


def print_summary(summary: dict, output: Path) -> None:
    log.info(f"drew {summary['samples']} samples ({summary['prompts']} prompts x {summary['samples_per_prompt']}) in "
             f"{summary['sampling_seconds']:.1f} s: {summary['verified']} verified ({summary['verified_rate']:.1%}), "
             f"kept {summary['kept']} (acceptance {summary['acceptance_rate']:.1%}; "
             f"{summary['prompts_with_kept']} prompts with one or more)")
    log.info(f"dropped: {summary['truncated']} cut by the budget, {summary['duplicates_dropped']} duplicates, "
             f"{summary['over_keep_per_prompt_dropped']} over keep_per_prompt")
    log.info(f"teacher tokens: {summary['teacher_generated_tokens']} generated, {summary['teacher_prompt_tokens']} "
             f"prompt tokens read; kept responses hold {summary['kept_response_tokens']}")
    files = summary["files"]
    log.info(f"wrote {', '.join(files.values())} and {output / 'summary.json'}")
    validation = f" data.files.validation={files['validation']}" if "validation" in files else ""
    log.info(f"train on it: posttrain algorithm=sft data=jsonl data.files.train={files['train']}{validation}")


main = hydra_command("posttrain-sample", "sample", sample_dataset, log_name="sample.log")

if __name__ == "__main__":
    main()
