"""How often a chat model solves `data=word_problems` before any training: pass@1 per difficulty.

For each difficulty setting, the first `--problems` held-out (test) problems are asked through
the task's own path (data/word_problems.py -> the template -> the model's chat template ->
posttrain's `rollout=fast` sampler), `--samples` answers each at temperature `--temperature`
(no top-k or top-p, as GRPO samples) plus one greedy answer, and each answer is checked by the
task's verifier (math-verify on the last \\boxed{}, else the last number). Reported per setting
and prompt form: pass@1 (mean correctness of the sampled answers), the share of problems with
at least one right sample (what gives GRPO a group with signal), greedy accuracy, and the shares
of sampled answers with a non-empty \\boxed{} (boxed) and with a \\boxed{} or a "#### N" line
(marked: an explicit final answer; the rest are read by their last number).

    python benchmarks/word_problems_pass_rate.py --model /tmp/smollm2_hf
    python benchmarks/word_problems_pass_rate.py --model <dir> --prompts boxed,short --settings 2_steps

--model is a Hugging Face directory of a chat model (SmolLM2-135M-Instruct converted from its
GGUF: see docs/models-and-data.md). Runs on the CPU; 2 torch threads by default.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from posttrain.data.datamodule import collate_prompts
from posttrain.data.templates import TEMPLATES, PromptTemplate, boxed_response
from posttrain.data.answers import after_hash_marker, last_boxed_content
from posttrain.data.word_problems import OPERATIONS, WordProblemSource, WordProblemTask
from posttrain.rollout.base import SamplingParams, decode_responses
from posttrain.rollout.fast import FastSampler

# The difficulty settings measured: data.* knobs of data=word_problems.
SETTINGS = {
    "1_step_small": dict(min_steps=1, max_steps=1, max_number=10, operations=("add", "subtract")),
    "2_steps": dict(min_steps=2, max_steps=2, max_number=10, operations=("add", "subtract")),
    "1_to_2_steps": dict(min_steps=1, max_steps=2, max_number=10, operations=("add", "subtract")),
    "3_steps": dict(min_steps=3, max_steps=3, max_number=10, operations=("add", "subtract")),
    "2_steps_all_ops": dict(min_steps=2, max_steps=2, max_number=10, operations=OPERATIONS),
    "3_steps_all_ops_distractors": dict(min_steps=3, max_steps=3, max_number=20, operations=OPERATIONS,
                                        distractors=0.5),
}

# Prompt forms compared, as (template, worked examples before the question): the task's
# templates, a shorter instruction line, and one worked example (data.shots=1, the default).
SHORT = PromptTemplate("short", user=lambda q: f"{q}\nAnswer with the final number in \\boxed{{}}.",
                       text=lambda q: f"{q}\nAnswer with the final number in \\boxed{{}}.",
                       response=boxed_response, has_style=lambda r: last_boxed_content(r) is not None)
PROMPTS = {"boxed": (TEMPLATES["boxed"], 0), "plain": (TEMPLATES["plain"], 0), "short": (SHORT, 0),
           "plain_1shot": (TEMPLATES["plain"], 1), "plain_2shot": (TEMPLATES["plain"], 2),
           "boxed_1shot": (TEMPLATES["boxed"], 1)}


def measure(model, tokenizer, setting: dict, prompt: tuple[PromptTemplate, int], problems: int, samples: int,
            temperature: float, max_new_tokens: int, batch_prompts: int, seed: int = 0) -> dict:
    template, shots = prompt
    source = WordProblemSource(WordProblemTask(**setting), template, chat=True, shots=shots)
    examples = [source.example("test", i) for i in range(problems)]
    sampler, eos = FastSampler(), model.generation_config.eos_token_id
    generator = torch.Generator().manual_seed(seed)
    sampled, greedy, boxed, marked, lengths, shown = [], [], [], [], [], []
    for start in range(0, problems, batch_prompts):
        chunk = examples[start:start + batch_prompts]
        batch = collate_prompts(chunk, tokenizer)
        rows = batch["prompt_ids"].repeat_interleave(samples, 0), batch["prompt_mask"].repeat_interleave(samples, 0)
        out = sampler.generate(model, *rows, SamplingParams(max_new_tokens, temperature=temperature), eos,
                               tokenizer.pad_token_id, generator)
        texts = decode_responses(tokenizer, out.response_ids, out.response_mask)
        lengths += out.response_mask.sum(1).tolist()
        if start == 0:
            first_samples = texts[:samples]  # the first problem's sampled answers, to read
        for i, text in enumerate(texts):
            example = chunk[i // samples]
            sampled.append(source.is_correct(example, text))
            boxed.append(bool(last_boxed_content(text)))
            marked.append(bool(last_boxed_content(text)) or bool(after_hash_marker(text)))
        out = sampler.generate(model, batch["prompt_ids"], batch["prompt_mask"],
                               SamplingParams(max_new_tokens, greedy=True), eos, tokenizer.pad_token_id)
        for example, text in zip(chunk, decode_responses(tokenizer, out.response_ids, out.response_mask)):
            greedy.append(source.is_correct(example, text))
            shown.append({"prompt": example.prompt, "answer": example.answer, "greedy": text, "correct": greedy[-1]})
    source.checker.close()
    per_problem = [sum(sampled[i * samples:(i + 1) * samples]) for i in range(problems)]
    return {"pass@1": sum(sampled) / len(sampled),
            "some_right": sum(n > 0 for n in per_problem) / problems,
            "all_right": sum(n == samples for n in per_problem) / problems,
            "greedy": sum(greedy) / len(greedy),
            "boxed": sum(boxed) / len(boxed),
            "marked": sum(marked) / len(marked),
            "mean_tokens": sum(lengths) / len(lengths),
            "greedy_answers": shown[:4], "first_problem_samples": first_samples}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a Hugging Face directory of a chat model")
    parser.add_argument("--settings", default="1_step_small,2_steps,3_steps", help=f"of {list(SETTINGS)}")
    parser.add_argument("--prompts", default="plain_1shot", help=f"prompt forms, of {list(PROMPTS)}")
    parser.add_argument("--problems", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--batch-prompts", type=int, default=8, help="prompts per generate call")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    # start-up: transformers loads only when the script runs
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    results = []
    print(f"{'setting':30} {'prompt':11} {'pass@1':>7} {'>=1 right':>9} {'all right':>9} {'greedy':>7} "
          f"{'boxed':>6} {'marked':>6} {'tokens':>6} {'s':>5}")
    for setting in args.settings.split(","):
        for prompt in args.prompts.split(","):
            began = time.perf_counter()
            row = measure(model, tokenizer, SETTINGS[setting], PROMPTS[prompt], args.problems, args.samples,
                          args.temperature, args.max_new_tokens, args.batch_prompts)
            row.update(setting=setting, prompt=prompt, seconds=time.perf_counter() - began)
            results.append(row)
            print(f"{setting:30} {prompt:11} {row['pass@1']:7.3f} {row['some_right']:9.3f} {row['all_right']:9.3f} "
                  f"{row['greedy']:7.3f} {row['boxed']:6.2f} {row['marked']:6.2f} {row['mean_tokens']:6.1f} "
                  f"{row['seconds']:5.0f}",
                  flush=True)
            if args.out:  # after each row: a long run that is stopped keeps what it measured
                with open(args.out, "w") as handle:
                    json.dump({"args": vars(args), "results": results}, handle, indent=2)


if __name__ == "__main__":
    main()
