"""The training forward + backward with the response attention in length buckets against one
padded layout (models/grouped_forward.py, `BUCKET_COST_PAIRS`), side by side in one process;
with `--forward plain`, the model's own forward (the fallback, models/plain_forward.py) on rows
in length buckets (`BUCKET_COST_TOKENS`) against one bucket of every row (with prompts of one
length, as here, that is the padded layout itself).

One step: 2 prompts x 8 samples (a `--prompt`-token prompt each), responses of uneven lengths
(`--lengths`: "uniform" draws each from [max/4, max], the longest exactly max; "full" makes
every row max long, where the buckets must cost nothing), the policy's log-probs and entropies
(`sequence_logprobs`, as the training forward takes them), a policy-gradient-shaped loss, its
backward. The model is SmolLM2-135M's architecture (random init, float32 or `--bf16` autocast,
`--layers` of its 30 decoder layers). The two layouts alternate (A/B, then B/A), `--repeats`
times; the table gives each one's median and the median of the per-repeat ratios.

    python benchmarks/packed_attention.py --max-tokens 128 512 --threads 1 --repeats 3 \
        --out benchmarks/results/packed_attention.json
    python benchmarks/packed_attention.py --forward plain --max-tokens 128 512 --threads 1 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import transformers

from posttrain.models import forward, grouped_forward, plain_forward
from posttrain.models.forward import sequence_logprobs

ONE_BUCKET = 1 << 62  # a cost no split can outweigh


def smollm2_architecture(layers: int) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                      num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=3,
                                      max_position_embeddings=8192, tie_word_embeddings=True,
                                      rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()


def batch(max_tokens: int, prompt: int, lengths: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, 49152, (2, prompt), generator=g).repeat_interleave(8, 0)
    prompt_mask = torch.ones_like(prompt_ids)
    if lengths == "full":
        length = torch.full((16,), max_tokens)
    else:
        length = torch.randint(max_tokens // 4, max_tokens + 1, (16,), generator=g)
        length[0] = max_tokens
    response_mask = (torch.arange(max_tokens)[None] < length[:, None]).float()
    response_ids = torch.randint(3, 49152, (16, max_tokens), generator=g) * response_mask.long()
    return (prompt_ids, prompt_mask, response_ids, response_mask), length


def step_seconds(model, inputs, cost: int, bf16: bool) -> float:
    """One forward + backward, a bucket costing ``cost`` (pairs, or tokens on the plain forward)."""
    grouped_forward.BUCKET_COST_PAIRS = cost
    plain_forward.BUCKET_COST_TOKENS = {"cpu": cost}
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        logp, entropy = sequence_logprobs(model, *inputs, with_entropy=True, entropy_grad=False)
    ((logp * inputs[3]).sum() / inputs[3].sum()).backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[128])
    parser.add_argument("--prompt", type=int, default=100)
    parser.add_argument("--lengths", default="uniform", choices=("uniform", "full"))
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--forward", default="grouped", choices=("grouped", "plain"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = smollm2_architecture(args.layers)
    plain = args.forward == "plain"
    if plain:  # as for an architecture the grouped forward refuses
        forward.grouped_forward_unsupported_reason = lambda model: "benchmarks/packed_attention.py --forward plain"
    default_cost = plain_forward.BUCKET_COST_TOKENS["cpu"] if plain else grouped_forward.BUCKET_COST_PAIRS
    rows = []
    for max_tokens in args.max_tokens:
        inputs, length = batch(max_tokens, args.prompt, args.lengths, seed=max_tokens)
        if plain:  # whole rows, the forward's own plan; what is kept is tokens
            plan = plain_forward.plain_buckets(model, *inputs, None)
            padded = len(length) * int(length.max() + args.prompt)
            bucketed = sum(b.inputs["input_ids"].numel() for b in plan)
        else:
            queries = (length - 1).clamp(min=0).tolist()
            plan = grouped_forward.response_buckets(queries, args.prompt)
            padded = len(queries) * max(queries) * (args.prompt + max(queries))
            bucketed = sum(len(b) * max(queries[r] for r in b) * (args.prompt + max(queries[r] for r in b))
                           for b in plan)
        step_seconds(model, inputs, default_cost, args.bf16)  # warm-up (allocator, kernels)
        times = {"one bucket": [], "buckets": []}
        for repeat in range(args.repeats):
            order = [("one bucket", ONE_BUCKET), ("buckets", default_cost)]
            for name, cost in order if repeat % 2 == 0 else order[::-1]:
                times[name].append(step_seconds(model, inputs, cost, args.bf16))
        ratios = [a / b for a, b in zip(times["one bucket"], times["buckets"])]
        row = {"max_tokens": max_tokens, "mean_length": float(length.float().mean()), "buckets": len(plan),
               "pairs_kept": bucketed / padded, "one_bucket_s": statistics.median(times["one bucket"]),
               "buckets_s": statistics.median(times["buckets"]), "speedup": statistics.median(ratios), "times": times}
        rows.append(row)
        print(f"T={max_tokens:4d} mean length {row['mean_length']:.0f}: {len(plan)} buckets keep "
              f"{100 * row['pairs_kept']:.0f}% of the padded {'tokens' if plain else 'attention pairs'}; one bucket {row['one_bucket_s']:.2f} s, "
              f"buckets {row['buckets_s']:.2f} s, speedup {row['speedup']:.3f}x", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
