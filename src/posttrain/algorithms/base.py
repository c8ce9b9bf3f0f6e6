"""What every posttrain LightningModule shares: the policy, the optimiser and schedule,
held-out evaluation by greedy generation, and the resumable count of training batches."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import WandbLogger
from torch.distributed.tensor import DTensor

from posttrain.algorithms.eval_suites import build_suites, suites_metrics, suites_sums
from posttrain.core import calibration_bins, calibration_error, pass_at_k, reliability
from posttrain.data.datamodule import collate_prompts
from posttrain.data.panel import panel_examples
from posttrain.distributed.collectives import all_reduce_sum, any_rank_needs, average_gradients, rank_and_world
from posttrain.distributed.sharding import GatheringEngine, is_sharded, shard_module
from posttrain.envs.episodes import Budget, Episodes, marked_text, outcome
from posttrain.errors import ConfigError
from posttrain.files import write_jsonl_atomic
from posttrain.models.loading import stop_token_ids
from posttrain.rewards.reward_model import learned_scorers
from posttrain.rewards.samples import held_out_samples
from posttrain.rollout import SamplingParams, build_rollout, engine_options
from posttrain.rollout.base import decode_responses


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warm-up to 1, then cosine decay to ``min_lr_ratio`` at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class Scored:
    """Responses to the prompt rows of a batch, judged by the task's verifier."""

    texts: list[str]        # decoded, without padding and special tokens
    correct: list[float]    # 1.0 / 0.0 per row
    lengths: list[float]    # response length in tokens per row
    truncated: list[bool]   # hit the generation budget without EOS
    # the policy's probability of each response: exp of the sum of its tokens' log-probs (EOS
    # included) as the sampler reported them; empty where not measured
    confidence: list[float] = field(default_factory=list)
    # with an environment: each episode's last turn, its rewards summed, its verdict and its
    # transcript ([{"role": "policy" | "env", "text"}]); `texts` then mark the environment's turns
    finals: list[str] = field(default_factory=list)
    env_returns: list[float] = field(default_factory=list)
    env_correct: list = field(default_factory=list)
    transcripts: list[list[dict]] = field(default_factory=list)
    episode_metrics: list[dict] = field(default_factory=list)  # each episode's turns and the replies' counts

    def rows(self, keep: list[int]) -> "Scored":
        """The responses of rows `keep` only."""
        return Scored(*([values[i] for i in keep] for values in (self.texts, self.correct, self.lengths,
                                                                 self.truncated)),
                      **{name: [getattr(self, name)[i] for i in keep] if getattr(self, name) else []
                         for name in ("confidence", "finals", "env_returns", "env_correct", "transcripts",
                                      "episode_metrics")})

    def as_samples(self, examples) -> list:
        """The first len(examples) responses as reward samples (an episode's: its last turn, with
        its rewards, verdict and transcript)."""
        n = len(examples)
        texts = self.finals[:n] if self.finals else self.texts[:n]
        samples = held_out_samples(examples, texts, self.lengths[:n], self.truncated[:n])
        for i, sample in enumerate(samples if self.finals else ()):
            sample.env_return, sample.env_correct = self.env_returns[i], self.env_correct[i]
            sample.transcript = self.transcripts[i]
        return samples


def generate_and_score(module: "PosttrainModule", batch: dict, params: SamplingParams,
                       generator: torch.Generator | None = None, source=None) -> Scored:
    """One response per prompt row of `batch` (from `collate_prompts`), judged by the task's
    verifier (`source`'s: an evaluation suite's; None: the module's). Held-out evaluation, its
    pass@k, the suites and `posttrain-eval` all score through here, so their numbers mean the
    same thing. With an environment each row is an episode (`play_and_score`)."""
    source = module.source if source is None else source
    if getattr(module, "env", None) is not None:
        return play_and_score(module, batch, params, generator, source)
    rollout = module.generate(batch["prompt_ids"], batch["prompt_mask"], params, generator=generator)
    texts = decode_responses(module.tokenizer, rollout.response_ids, rollout.response_mask)
    correct = [float(source.is_correct(e, t)) for e, t in zip(batch["examples"], texts)]
    # the response's probability under the policy (at the sampler's log-prob temperature: 1 for
    # greedy), from the log-probs generation already returns (0 on padding): no extra forward.
    # The clamp only removes float rounding above 1.
    confidence = rollout.logprobs.double().sum(dim=1).exp().clamp(0.0, 1.0).tolist()
    return Scored(texts, correct, rollout.response_lengths().float().tolist(), rollout.truncated.tolist(), confidence)


def play_and_score(module: "PosttrainModule", batch: dict, params: SamplingParams,
                   generator: torch.Generator | None = None, source=None) -> Scored:
    """An episode per example of `batch` with the module's environment, turn after turn, each
    generate call over the episodes under way; judged by the environment's verdict where it gives
    one, else by the task's (`source`'s; None: the module's) verifier on the last turn. The ranks
    make the same number of calls (under FSDP each is a collective): a rank whose episodes have
    ended joins with a stand-in."""
    episodes = Episodes(module.env, module.tokenizer, Budget(params.max_new_tokens, module.turn_tokens,
                                                             module.env.max_turns),
                        stop_token_ids(module.tokenizer, module.policy))
    trajectories = episodes.start_all(batch["examples"], first_group=0, group_size=1, with_support=False)
    while any_rank_needs(sum(not t.ended for t in trajectories)):
        active = [t for t in trajectories if not t.ended]
        rows = active or trajectories[:1]  # a stand-in: generated, never extended
        ids, mask = episodes.inputs(rows, module.tokenizer.pad_token_id)
        call = replace(params, max_new_tokens=episodes.call_budget(rows, None) if active else 1)
        rollout = module.generate(ids.to(module.device), mask.to(module.device), call, generator=generator)
        for i, trajectory in enumerate(active):
            episodes.extend(trajectory, rollout, i, version=0)
    ended = [outcome(t, module.tokenizer) for t in trajectories]
    source = module.source if source is None else source
    correct = [float(o.correct) if o.correct is not None else float(source.is_correct(t.example, o.final))
               for t, o in zip(trajectories, ended)]
    return Scored([marked_text(o.transcript) for o in ended], correct,
                  [float(t.policy_mask().sum()) for t in trajectories], [t.truncated for t in trajectories],
                  confidence=[math.exp(min(0.0, float(t.logprobs.double().sum()))) for t in trajectories],
                  finals=[o.final for o in ended], env_returns=[o.env_return for o in ended],
                  env_correct=[o.correct for o in ended], transcripts=[o.transcript for o in ended],
                  episode_metrics=[{"turns": float(t.turns), **t.metrics} for t in trajectories])


def count_correct_samples(module: "PosttrainModule", batch: dict, params: SamplingParams, num_samples: int,
                          generator: torch.Generator, rows_per_call: int) -> torch.Tensor:
    """`num_samples` sampled responses to each prompt of `batch`: how many of each prompt's are
    correct (the c of pass@k). Whole prompts are generated together, about `rows_per_call`
    rows per call. Held-out eval's pass@k and `posttrain-eval` both count through here."""
    n = num_samples
    prompts_per_call = max(1, rows_per_call // n)
    counts = []
    for start in range(0, len(batch["examples"]), prompts_per_call):
        rows = slice(start, start + prompts_per_call)
        repeated = {"prompt_ids": batch["prompt_ids"][rows].repeat_interleave(n, dim=0),
                    "prompt_mask": batch["prompt_mask"][rows].repeat_interleave(n, dim=0),
                    "examples": [example for example in batch["examples"][rows] for _ in range(n)]}
        scored = generate_and_score(module, repeated, params, generator)
        counts.append(torch.tensor(scored.correct).view(-1, n).sum(dim=1))
    return torch.cat(counts)


class PosttrainModule(L.LightningModule):
    """Base of all algorithms. Subclasses write `training_step` and call `self.evaluate`."""

    env = None          # an environment (envs/): held-out prompts are then episodes (online RL sets it)
    turn_tokens = None  # its policy turns' token budget (None: the rest of the episode's)

    def __init__(self, policy, tokenizer, source, optim, rollout, eval_max_new_tokens: int,
                 max_grad_norm: float | None = 1.0):
        super().__init__()
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm = float("nan")
        self.policy = policy
        self.tokenizer = tokenizer
        self.source = source
        self.optim = optim
        self.rollout_cfg = rollout
        self.engine = build_rollout(rollout.engine, **engine_options(rollout))
        self.eval_max_new_tokens = eval_max_new_tokens
        self.train_batches_seen = 0  # restored on resume: the data stream restarts here
        self.evaluated_at_step = -1  # global step of the last held-out evaluation
        self._eval_correct: list[float] = []
        self._eval_lengths: list[float] = []
        self._eval_confidence: list[float] = []  # the policy's probability of each greedy response

    def configure_model(self) -> None:
        """Where a parallel strategy shards the model: under trainer=fsdp the strategy carries a
        sharding policy (posttrain.distributed.sharding) applied to every role here, and generation then
        gathers the policy's full weights once per call; plain data parallelism needs nothing."""
        shard_module(self)
        if is_sharded(self.policy) and not isinstance(self.engine, GatheringEngine):
            self.engine = GatheringEngine(self.engine)

    # --- optimisation -------------------------------------------------------------------
    def configure_optimizers(self):
        return self.make_optimizer([p for p in self.policy.parameters() if p.requires_grad], self.optim)

    def make_optimizer(self, parameters, optim) -> dict:
        """AdamW with linear warm-up and cosine decay over `trainer.max_steps`, from an `optim`
        node (lr, weight_decay, betas, warmup_steps, min_lr_ratio); one per trainable role."""
        parameters = list(parameters)
        # the fused kernel: AdamW's update in one pass over each tensor instead of ~10 ops
        # (as HF Trainer's default); sharded (DTensor) parameters keep the generic path

        # a 16-mixed loss scaler needs an optimiser that leaves unscaling to it (see
        # OfflineModule.configure_gradient_clipping), so fp16 keeps the generic path too
        fused = all(not isinstance(p, DTensor) and p.device.type in ("cpu", "cuda") for p in parameters) \
            and self.loss_scaler() is None
        optimizer = torch.optim.AdamW(parameters, lr=optim.lr, weight_decay=optim.weight_decay, betas=tuple(optim.betas),
                                      fused=fused or None)
        total = self.trainer.max_steps if self.trainer.max_steps > 0 else 1
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, optim.warmup_steps, total, optim.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    # --- logging -------------------------------------------------------------------------------
    def log_step_metrics(self, metrics: dict[str, float]) -> None:
        """One training batch's metrics, in one call: straight to the loggers (at the step
        Lightning's own logging uses) and into `trainer.callback_metrics`, which the progress
        bar (callbacks.PROGRESS_METRICS) and the run's summary read. Lightning's `self.log`
        re-walks its record of a metric at every call: at ~30 metrics a step that was ~10 ms of
        a 70 ms GRPO step on the tiny model (benchmarks/README.md)."""
        trainer = self.trainer
        trainer.callback_metrics.update({k: torch.tensor(float(v)) for k, v in metrics.items()})
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        for logger in trainer.loggers:
            logger.log_metrics({**metrics, "epoch": trainer.current_epoch}, step=step)
            logger.save()

    # --- resumable data position ------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["train_batches_seen"] = self.train_batches_seen

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.train_batches_seen = checkpoint["train_batches_seen"]
        self.policy_updated()  # the checkpoint's weights replace the policy's

    def optimizer_step(self, *args, **kwargs) -> None:
        # automatic optimisation (SFT) steps the policy here; online RL in its own optimiser_step
        super().optimizer_step(*args, **kwargs)
        self.policy_updated()

    def loss_scaler(self):
        """The precision plugin's gradient scaler (trainer.precision=16-mixed), or None: fp32 and
        bf16-mixed gradients are true gradients when they reach the optimiser."""
        return getattr(self.trainer.precision_plugin, "scaler", None) if self._trainer is not None else None

    def clip_by_norm(self, optimizer, parameters, max_norm: float, norm) -> None:
        """Scale the gradients of `parameters` to a total norm of at most `max_norm`, given
        their total norm `norm`. Under 16-mixed through Lightning, which unscales them first;
        otherwise (fp32, bf16-mixed: true gradients) by the norm already taken. Lightning's own
        clip refuses a fused AdamW under any mixed precision, bf16 included, though only a
        scaler (which bf16 has none of) makes that unsafe."""
        if self.loss_scaler() is not None:
            self.clip_gradients(optimizer, gradient_clip_val=max_norm, gradient_clip_algorithm="norm")
        else:
            torch.nn.utils.clip_grads_with_norm_([p for p in parameters if p.grad is not None], max_norm, norm)

    def training_precision(self):
        """The context of the training forwards (Lightning's precision: bf16 autocast under
        trainer.precision=bf16-mixed), for a forward outside a training step that must match
        them, such as a reference scored once before training; none outside a Trainer."""
        if self._trainer is None:
            return contextlib.nullcontext()
        return self.trainer.precision_plugin.forward_context()

    def policy_updated(self) -> None:
        """The hook after every change of the policy's weights: an engine that holds its own
        copy of them (rollout=vllm) reloads it before its next generation; the engines that
        read the policy directly have nothing to do."""
        notify = getattr(self.engine, "policy_updated", None)
        if notify is not None:
            notify()

    # --- generation and held-out evaluation ---------------------------------------------------
    def generate(self, prompt_ids, prompt_mask, params: SamplingParams, generator=None):
        return self.engine.generate(
            self.policy, prompt_ids, prompt_mask, params,
            # every EOS of the model (chat models have several), not only the tokenizer's
            eos_token_id=stop_token_ids(self.tokenizer, self.policy), pad_token_id=self.tokenizer.pad_token_id,
            generator=generator,
        )

    # Held-out evaluation's extras, off unless `configure_eval` (train.py) turns them on: the
    # samples table and pass@k. Class attributes, so that every module has them set.
    eval_log_samples: int = 0
    eval_samples_dir: Path | None = None
    eval_pass_k: tuple[int, ...] = ()
    eval_num_samples: int = 1
    eval_sampling: SamplingParams | None = None
    eval_seed: int = 0
    eval_calibration_bins: int = 10  # equal-width confidence bins of eval/ece and its reliability diagram
    panel: tuple = ()  # the prompt panel's examples (data/panel.py); empty: no panel
    panel_dir: Path | None = None
    panel_batch_size: int = 256  # panel prompts per generate call
    eval_suites: tuple = ()  # the evaluation suites (eval_suites.py), evaluated after the held-out prompts
    eval_rows_per_call: int = 256  # eval.batch_size: rows per generate call of a suite

    def configure_eval(self, eval_cfg, samples_dir: Path | None = None, seed: int = 0,
                       panel_dir: Path | None = None) -> None:
        """Held-out eval's extras from the `eval` config node: the first `log_samples` prompts'
        greedy responses as the table `eval/samples` (W&B) and as `samples_dir`/step<N>.jsonl;
        `eval/pass@k` for each k of `pass_k` from `num_samples` responses per prompt sampled at
        `temperature` (rollout top_p / top_k), with a generator seeded from `seed`; the prompt
        panel (`panel`: size, seed, file) answered into `panel_dir`/batch<N>.jsonl; the
        evaluation suites (`suites`, eval_suites.py), built and checked here."""
        pass_k = [int(k) for k in (eval_cfg.get("pass_k") or [])]
        num_samples, temperature = eval_cfg.get("num_samples", 1), eval_cfg.get("temperature", 1.0)
        if any(k > num_samples for k in pass_k):
            raise ConfigError(f"eval.pass_k={pass_k} asks for pass@{max(pass_k)}, but eval.num_samples={num_samples}: "
                              f"pass@k is estimated from num_samples sampled responses per prompt, so it needs "
                              f"eval.num_samples >= k")
        if pass_k and not temperature > 0:
            raise ConfigError(f"eval.temperature={temperature}: pass@k samples, so it needs a temperature > 0")
        self.eval_log_samples = eval_cfg.get("log_samples", 0)
        self.eval_samples_dir = None if samples_dir is None else Path(samples_dir)
        self.eval_pass_k, self.eval_num_samples, self.eval_seed = tuple(pass_k), num_samples, seed
        self.eval_sampling = SamplingParams(max_new_tokens=self.eval_max_new_tokens, temperature=temperature,
                                            top_p=self.rollout_cfg.top_p, top_k=self.rollout_cfg.top_k)
        self.eval_suites = tuple(build_suites(eval_cfg, self.source, self.tokenizer, seed, self.rollout_cfg.top_p,
                                              self.rollout_cfg.top_k))
        self.eval_rows_per_call = eval_cfg.get("batch_size", self.eval_rows_per_call)
        if panel_dir is not None:
            panel = eval_cfg.get("panel") or {}
            self.panel = tuple(panel_examples(self.source, eval_cfg.get("split", "validation"), panel.get("size", 0),
                                              panel.get("seed", 0), panel.get("file")))
            self.panel_dir, self.panel_batch_size = Path(panel_dir), eval_cfg.get("batch_size", self.panel_batch_size)

    def on_validation_epoch_start(self) -> None:
        self._eval_samples: list[dict] = []
        self._eval_proxy: list[float] = []  # learned reward of each greedy response (eval/proxy_reward)
        self._eval_counts: list[torch.Tensor] = []  # per prompt: correct responses of eval_num_samples
        self._eval_correct, self._eval_lengths, self._eval_confidence = [], [], []
        self._eval_episodes: list[dict] = []  # with an environment: each held-out episode's counts
        self._eval_by_source: dict[str, list[float]] = {}  # Example.source -> [correct, prompts]
        if self.eval_pass_k:
            # the same draws at every eval (each rank its own), and training's random state untouched
            rank, world = rank_and_world()
            self._eval_generator = torch.Generator(device=self.device).manual_seed(self.eval_seed * world + rank)

    def validation_step(self, batch, batch_idx):
        # every row is generated, stand-ins too: the ranks' batches have the same sizes, so they
        # make the same generate calls, each a collective under FSDP (datamodule.val_dataloader)
        scored = generate_and_score(self, batch, self.greedy_params())
        counts = None
        if self.eval_pass_k:
            counts = count_correct_samples(self, batch, self.eval_sampling, self.eval_num_samples,
                                           self._eval_generator, rows_per_call=len(batch["examples"]))
        # the prompts this rank counts: each held-out prompt is counted by one rank
        keep = batch["counted"].nonzero().flatten().tolist()
        if not keep:
            return
        examples, scored = [batch["examples"][i] for i in keep], scored.rows(keep)
        self._eval_correct += scored.correct
        self._eval_lengths += scored.lengths
        self._eval_episodes += scored.episode_metrics
        self._eval_confidence += scored.confidence
        self._eval_proxy += self.proxy_rewards(examples, scored)
        for example, correct in zip(examples, scored.correct):
            if example.source is not None:
                tally = self._eval_by_source.setdefault(example.source, [0.0, 0.0])
                tally[0], tally[1] = tally[0] + correct, tally[1] + 1
        wanted = self.eval_log_samples - len(self._eval_samples)
        if wanted > 0 and self.trainer.is_global_zero:  # only rank 0 logs: its first prompts
            self._eval_samples += self.sample_rows(examples[:wanted], scored)
        if counts is not None:
            self._eval_counts.append(counts[keep])

    def greedy_params(self) -> SamplingParams:
        """How held-out responses are generated: greedily, within the eval budget."""
        return SamplingParams(max_new_tokens=self.eval_max_new_tokens, greedy=True, temperature=0.0)

    def sample_rows(self, examples, scored: Scored) -> list[dict]:
        """Rows of the samples table for the first len(examples) responses of `scored`."""
        rewards = self.sample_rewards(examples, scored)
        rows = [{"prompt": example.prompt, "response": text, "reward": float(reward), "correct": bool(correct)}
                for example, text, reward, correct in zip(examples, scored.texts, rewards, scored.correct)]
        for row, parts in zip(rows, scored.transcripts):  # an episode's turns, the environment's marked
            row["transcript"] = parts
        return rows

    def sample_rewards(self, examples, scored: Scored) -> list[float]:
        """The reward of the first len(examples) held-out responses (`reward_components`' total)."""
        return self.reward_components(examples, scored)[0]

    def reward_components(self, examples, scored: Scored) -> tuple[list[float], dict]:
        """The reward of held-out responses and its components ({name: per response}): the
        training reward where the module has one (online RL's `reward_fn`, each response scored
        as a group of its own), else the task's correctness as the one component `accuracy`
        (SFT and offline algorithms; what `reward=accuracy` would score)."""
        reward_fn = getattr(self, "reward_fn", None)
        if reward_fn is None:
            correct = scored.correct[:len(examples)]
            return list(correct), {"accuracy": list(correct)}
        output = reward_fn(scored.as_samples(examples), self.source)
        return output.total.tolist(), {name: scores.tolist() for name, scores in output.components.items()}

    def learned_scorers(self) -> list:
        """The training reward's learned components (a reward model), if it has any."""
        reward_fn = getattr(self, "reward_fn", None)
        return [] if reward_fn is None else learned_scorers(reward_fn)

    def proxy_rewards(self, examples, scored: Scored) -> list[float]:
        """The learned reward of each greedy held-out response (the mean of the learned
        components, unweighted): logged as eval/proxy_reward beside eval/accuracy, so the point
        where optimising the proxy stops raising the verifiable accuracy shows."""
        scorers = self.learned_scorers()
        if not scorers:
            return []
        samples = scored.as_samples(examples)
        per_scorer = [torch.as_tensor(fn(samples, self.source), dtype=torch.float32).cpu() for fn in scorers]
        return torch.stack(per_scorer).mean(dim=0).tolist()

    def on_validation_epoch_end(self):
        self.answer_panel()
        suites = self.evaluate_suites()
        # each rank scored its own shard of the held-out prompts: reduce sums and counts
        counts = torch.cat(self._eval_counts) if self._eval_counts else torch.zeros(0)
        pass_sums = [float(pass_at_k(self.eval_num_samples, counts, k).sum()) for k in self.eval_pass_k]
        scalars = torch.tensor([sum(self._eval_correct), sum(self._eval_lengths), float(len(self._eval_correct)),
                                *pass_sums, sum(self._eval_proxy)], dtype=torch.float64)
        # per source: the names of the whole held-out set, the same on every rank whatever its share holds
        sources = self.eval_source_names()
        clash = sorted(set(sources) & {suite.name for suite in self.eval_suites})
        if clash:  # on every rank alike: the names are the whole set's
            raise ConfigError(f"eval.suites.{clash[0]}: the held-out examples have a source named {clash[0]!r}, "
                              f"whose eval/{clash[0]}/accuracy the suite would overwrite; rename the suite")
        by_source = torch.tensor([self._eval_by_source.get(name, [0.0, 0.0]) for name in sources],
                                 dtype=torch.float64).view(-1)
        # calibration: this rank's greedy responses binned by confidence; the bins' sums add over ranks
        bins = calibration_bins(self._eval_confidence, self._eval_correct, self.eval_calibration_bins)
        parts = [scalars, by_source, suites, bins.flatten().double()]
        summed = all_reduce_sum(torch.cat(parts).to(self.device))  # one collective
        totals, by_source, suites, bins = summed.split([len(part) for part in parts])
        bins = bins.view(3, -1)
        if self.eval_suites and not self.trainer.sanity_checking:
            self.log_dict(suites_metrics(list(self.eval_suites), suites))
        if totals[2] == 0:
            return
        self.log_dict({f"eval/{name}/accuracy": float(right / prompts)
                       for name, (right, prompts) in zip(sources, by_source.view(-1, 2).tolist()) if prompts})
        accuracy, length = float(totals[0] / totals[2]), float(totals[1] / totals[2])
        self.log_dict({"eval/accuracy": accuracy, "eval/response_len": length}, prog_bar=True)
        if self.learned_scorers():  # the same on every rank: each scored its own rows
            self.log_dict({"eval/proxy_reward": float(totals[-1] / totals[2])}, prog_bar=True)
        if self.eval_pass_k:  # every prompt has eval_num_samples samples: the same count as the greedy rows
            self.log_dict({f"eval/pass@{k}": float(totals[3 + i] / totals[2]) for i, k in enumerate(self.eval_pass_k)})
        if bins[0].sum() > 0:
            self.log_calibration(bins)
        if self.env is not None:
            self.log_episode_metrics(float(totals[2]))
        if self._eval_samples:
            self.log_samples(self._eval_samples)
        self.evaluated_at_step = self.trainer.global_step
        self._eval_correct, self._eval_lengths, self._eval_confidence = [], [], []

    def eval_source_names(self) -> list[str]:
        """The `Example.source` names of the held-out prompts (the datamodule's whole set: the same
        list on every rank), sorted; [] for an undivided task."""
        datamodule = getattr(self.trainer, "datamodule", None)
        examples = getattr(datamodule, "eval_examples", None) or []
        return sorted({e.source for e in examples if getattr(e, "source", None) is not None})

    @torch.no_grad()
    def evaluate_suites(self) -> torch.Tensor:
        """This rank's sums of every evaluation suite (eval_suites.py), in the precision and the
        forked random state of the held-out generation; none while Lightning sanity-checks (on
        every rank alike)."""
        if not self.eval_suites or self.trainer.sanity_checking:
            return torch.zeros(0, dtype=torch.float64)
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), self.trainer.precision_plugin.val_step_context():
            return suites_sums(self, list(self.eval_suites), generate_and_score, self.eval_seed,
                               self.eval_rows_per_call)

    @torch.no_grad()
    def answer_panel(self) -> None:
        """The panel's greedy responses with their reward and its components, to
        panel_dir/batch<N>.jsonl, N the training batches seen (metrics.jsonl's `batch`: runs of
        different algorithms line up). Every rank generates the whole panel, in the same calls
        (under FSDP each is a collective); rank 0 writes. Greedy, in a forked RNG (a user's
        reward function may draw): no eval metric and no training draw changes. In the precision
        the held-out batches are generated in (validation_step's: bf16 autocast under bf16-mixed)."""
        if not self.panel or self.trainer.sanity_checking:
            return
        rows = []
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), self.trainer.precision_plugin.val_step_context():
            for start in range(0, len(self.panel), self.panel_batch_size):
                examples = list(self.panel[start:start + self.panel_batch_size])
                batch = collate_prompts(examples, self.tokenizer)
                batch.update({key: batch[key].to(self.device) for key in ("prompt_ids", "prompt_mask")})
                rows += self.panel_rows(examples, generate_and_score(self, batch, self.greedy_params()))
        if self.trainer.is_global_zero:
            write_jsonl_atomic(self.panel_dir / f"batch{self.train_batches_seen:06d}.jsonl", rows)

    def panel_rows(self, examples, scored: Scored) -> list[dict]:
        """One line of a panel file per response (docs/panel.md)."""
        totals, components = self.reward_components(examples, scored)
        rows = []
        for i, example in enumerate(examples):
            rows.append({"batch": self.train_batches_seen, "step": self.trainer.global_step, "prompt": example.prompt,
                         "reference": example.response, "answer": example.answer, "response": scored.texts[i],
                         "reward": float(totals[i]),
                         "components": {name: float(values[i]) for name, values in components.items()},
                         "correct": bool(scored.correct[i]), "length": int(scored.lengths[i]),
                         "truncated": bool(scored.truncated[i])})
            if scored.transcripts:  # an episode: its turns, the environment's marked
                rows[-1]["transcript"] = scored.transcripts[i]
        return rows

    def log_episode_metrics(self, episodes: float) -> None:
        """`eval/episode/<name>`: the mean per held-out episode of its turns and of each count its
        environment reported (tool calls, tool errors, sandbox timeouts...), over every rank's
        episodes. Every rank reduces the same names in the same order: those the environment
        declares (`Environment.metric_names`), whatever its own episodes reported."""
        names = sorted({"turns", "budget_ended", *self.env.metric_names})
        sums = torch.tensor([sum(m.get(name, 0.0) for m in self._eval_episodes) for name in names],
                            dtype=torch.float64, device=self.device)
        sums = all_reduce_sum(sums)
        self.log_dict({f"eval/episode/{name}": float(value / episodes) for name, value in zip(names, sums)})

    def log_calibration(self, bins: torch.Tensor) -> None:
        """`eval/ece`: the expected calibration error of the greedy responses (confidence: the
        policy's probability of its whole response), over `eval_calibration_bins` equal-width
        bins; `eval/confidence`: their mean confidence (above `eval/accuracy`: over-confident);
        `eval/reliability/bin<b>/{share,confidence,accuracy}`: the reliability diagram, bin b
        covering confidence [b/M, (b+1)/M) (share 0: an empty bin). `bins`: summed over ranks."""
        points = reliability(bins)
        metrics = {"eval/ece": float(calibration_error(bins)), "eval/confidence": float(bins[1].sum() / bins[0].sum())}
        for b in range(bins.shape[1]):
            metrics.update({f"eval/reliability/bin{b:02d}/{name}": float(values[b]) for name, values in points.items()})
        self.log_dict(metrics)

    def log_samples(self, rows: list[dict]) -> None:
        """The samples table of this eval: to W&B as `eval/samples`, and to the run dir as
        samples/step<global step>.jsonl (readable offline and with any logger)."""
        if self.eval_samples_dir is not None:  # named like the checkpoints: by optimiser step
            write_jsonl_atomic(self.eval_samples_dir / f"step{self.trainer.global_step:06d}.jsonl", rows)
        # W&B: at the step Lightning logs this eval's metrics at (its counter of training
        # batches, docs/running.md "Step counters"), so the table lines up with eval/accuracy
        logged_step = self.trainer.fit_loop.epoch_loop._batches_that_stepped
        columns = ["prompt", "response", "reward", "correct"]
        for logger in self.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_table(key="eval/samples", columns=columns, data=[[row[c] for c in columns] for row in rows],
                                 step=logged_step)


class OfflineModule(PosttrainModule):
    """The base of the modules Lightning optimises automatically (SFT, the preference family,
    the reward model, the PRM): it owns their data parallelism without a DDP wrapper and their
    gradient-norm log. Each subclass's loss is already scaled so that the averaged gradients are
    those of one global mean over the ranks' tokens, pairs or steps."""

    def on_before_optimizer_step(self, optimizer):
        # trainer=ddp: average the ranks' gradients, before clipping; sharded (FSDP2) gradients
        # were averaged by the reduce-scatter and are left alone
        average_gradients(self.policy.parameters())

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Automatic optimisation (SFT): record the gradient norm, then clip at `max_grad_norm`
        through Lightning (precision- and strategy-aware). Online RL steps by hand and clips in
        `OnlineRLModule.optimiser_step`, where a non-finite norm also skips the step."""
        parameters = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in parameters]) if parameters else torch.zeros(())
        self.last_grad_norm = float(norm)
        if self.max_grad_norm:
            self.clip_by_norm(optimizer, parameters, self.max_grad_norm, norm)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.log("train/grad_norm", self.last_grad_norm)
