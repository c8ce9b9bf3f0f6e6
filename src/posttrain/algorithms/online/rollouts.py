"""The collect stage as the trainer sees it: who collects (this process, or a producer process
up to rollout.max_staleness policy versions ahead: producer.py), and what the ranks must agree
on once a batch is consumed — the pre-filter accuracy curricula read, whether any rank has a
learning signal, the budget counters (rollout/samples_seen, rollout/tokens_seen), how stale
the batch's tokens are, and with a mixture of sources (data=mixture) each source's metrics
(`source_metrics`). The collector itself (collect.py) takes no collective.
"""

from __future__ import annotations

import copy
import math

import torch

from posttrain import core
from posttrain.algorithms.experience import Experience
from posttrain.algorithms.online.collect import Collector, CollectSettings
from posttrain.algorithms.online.producer import InlineProducer, ProcessProducer
from posttrain.algorithms.online.sampler import PolicySampler
from posttrain.algorithms import rules
from posttrain.distributed.collectives import (all_reduce_max, all_reduce_sum, any_rank_needs, rank_and_world,
                                               this_ranks, with_every_rank)
from posttrain.models.loading import DTYPES
from posttrain.rollout import SamplingParams, build_rollout, engine_options
from posttrain.rollout.repetition import repetition_rule


def sampling_params(rollout, keep_sampling_mask: bool) -> SamplingParams:
    """How the training samples are drawn, from the `rollout` node: looping responses are
    stopped and flagged (rollout.repetition; evaluation does not use it); rollout.dtype rounds
    the fast sampler's weights (vLLM took it when it started); the kept top-k/top-p support is
    returned when the log-probs are taken over it (keep_sampling_mask)."""
    dtype = rollout.get("dtype", "auto")
    weights_dtype = DTYPES[dtype] if dtype != "auto" and rollout.engine != "vllm" else None
    return SamplingParams(max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature,
                          top_p=rollout.top_p, top_k=rollout.top_k, return_support=keep_sampling_mask,
                          repetition=repetition_rule(rollout.get("repetition")), weights_dtype=weights_dtype)


class Rollouts:
    """Rollout batches for the trainer: `next(step)` -> (Experience on `device`, metrics,
    has_signal). Built in the module's setup (`build`), started when training starts,
    told of each update (`publish`), checkpointed with `save` / `load`."""

    def __init__(self, rollout_cfg):
        self.rollout_cfg = rollout_cfg
        self.max_staleness = int(rollout_cfg.get("max_staleness") or 0)
        self.kind = rollout_cfg.get("producer") or ("process" if self.max_staleness else "inline")
        self.threads = rollout_cfg.get("producer_threads")
        self.partial_budget = rollout_cfg.get("partial_budget")  # partial rollouts: tokens per generate call
        rules.refuse(rules.producer_problem(self.kind, self.max_staleness))
        self.collector = self.producer = None
        self.collector_state: dict = {}  # the collector's state after the last batch trained on
        # budget counters over every rank (checkpointed): completions and response tokens of the
        # rollout batches trained on
        self.samples_seen = 0
        self.tokens_seen = 0
        self.source_names: tuple[str, ...] = ()  # a mixture's sources (data=mixture): metrics per source

    def build(self, sampler: PolicySampler, tokenizer, source, curriculum, reward_fn, settings: CollectSettings,
              device) -> None:
        rank, world = rank_and_world()
        self.device = device
        self.source_names = tuple(getattr(source, "source_names", None) or ())
        self.collector = Collector(sampler, tokenizer, source, curriculum, reward_fn, settings, rank=rank,
                                   world=world, device=device, rounds_agree=any_rank_needs)
        if self.kind == "inline":
            self.producer = InlineProducer(self.collector)
            return
        # the same collector, sampling with this process's engine settings on a copy of the
        # policy, taken here, before a sharding strategy splits the policy
        collector = copy.copy(self.collector)
        collector.sampler = PolicySampler(build_rollout(self.rollout_cfg.engine, **engine_options(self.rollout_cfg)),
                                          copy.deepcopy(sampler.model).cpu(), sampler.eos_ids, sampler.pad_token_id)
        self.producer = ProcessProducer(collector, self.max_staleness, threads=self.threads or torch.get_num_threads())
        self.producer.launch()  # now: its imports (seconds) overlap the trainer's own start-up

    def start(self, index: int, policy, autocast_dtype) -> None:
        if isinstance(self.producer, ProcessProducer):
            self.producer.autocast_dtype = autocast_dtype
        self.producer.start(index, index, policy, self.collector_state)

    def sample_and_score(self, examples, first_group: int, generator, group_size: int | None = None,
                         version: int = 0):
        """`group_size` (default: the algorithm's) samples of each example with the trainer's
        policy at `version`, scored: (Experience, reward metrics) (curricula's pass rates)."""
        self.collector.version = version
        return self.collector.sample_and_score(examples, first_group, generator, group_size)

    def next(self, step: int, curriculum) -> tuple[Experience, dict, bool]:
        """Rollout batch `step` from the producer, with what the ranks must agree on all-reduced:
        the batch, its metrics, and whether any rank has a group with a reward spread (without
        one, no optimiser step is taken)."""
        produced = self.producer.next_batch(step)
        if not isinstance(self.producer, InlineProducer):
            # the producer drew the prompts: its curriculum's state after this batch becomes ours
            curriculum.load_state_dict(produced.state["curriculum"])
        self.collector_state = produced.state
        exp = produced.experience.to(self.device)
        metrics = dict(produced.metrics)
        if self.max_staleness or self.partial_budget or not isinstance(self.producer, InlineProducer):
            metrics.update(self.staleness_metrics(exp, step, produced.generate_s,
                                                  metrics.pop("rollout/pending_responses", 0.0)))
        # the first round is an unbiased sample of the policy: what curricula and logs should
        # see, over every rank's first round, so that a curriculum decides alike on every rank
        # (a NaN accuracy, a reward without a verifier, is NaN on every rank); in the same
        # collective, the budget counters: the completions and response tokens sampled for the
        # batch, dynamic sampling's dropped rounds included
        reward_sum, correct_sum, rows, sampled_rows, sampled_tokens = all_reduce_sum(
            torch.tensor(produced.first_round + produced.sampled, dtype=torch.float64, device=self.device)).tolist()
        self.samples_seen += int(sampled_rows)
        self.tokens_seen += int(sampled_tokens)
        metrics["rollout/prefilter_reward_mean"] = reward_sum / rows
        if not math.isnan(correct_sum):
            metrics["rollout/prefilter_accuracy"] = correct_sum / rows
        has_signal = bool(all_reduce_sum(torch.tensor(float(produced.kept_any), device=self.device)) > 0)
        if self.source_names:
            metrics.update(source_metrics(exp, self.source_names))
        return exp, metrics, has_signal

    def staleness_metrics(self, exp: Experience, step: int, generate_s: list[float],
                          pending: float) -> dict[str, float]:
        """How far behind the trainer's policy (version `step`) the batch's tokens were sampled,
        and how many responses were continued from an earlier generate call (partial rollouts),
        over every rank's rows; and this rank's generate calls (the longest is how long the batch
        waited for its longest response). `pending`: this rank's responses under way."""
        mask = exp.response_mask
        lag = (step - exp.policy_version).double() * mask
        continued = (exp.segments > 1).double()
        sums = all_reduce_sum(torch.stack([lag.sum(), mask.double().sum(), continued.sum(),
                                           torch.tensor(float(len(exp)), dtype=torch.float64, device=self.device),
                                           torch.tensor(pending, dtype=torch.float64, device=self.device)])).tolist()
        maxima = all_reduce_max(torch.stack([lag.max(), exp.segments.double().max()])).tolist()
        metrics = {"rollout/staleness_mean": sums[0] / max(sums[1], 1.0), "rollout/staleness_max": maxima[0]}
        if self.partial_budget:
            metrics.update({"rollout/continued_frac": sums[2] / max(sums[3], 1.0), "rollout/segments_max": maxima[1],
                            "rollout/pending_responses": sums[4]})
        if generate_s:
            metrics.update({"perf/generate_s": sum(generate_s), "perf/longest_generate_s": max(generate_s)})
        return metrics

    def publish(self, version: int, policy, feedback: dict) -> None:
        self.producer.publish(version, policy, feedback)

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()

    def save(self, checkpoint: dict) -> None:
        checkpoint["samples_seen"], checkpoint["tokens_seen"] = self.samples_seen, self.tokens_seen
        if self.partial_budget:  # the responses under way, and the ended groups waiting for a batch
            with_every_rank(checkpoint, "partial_rollouts", {k: v for k, v in self.collector_state.items()
                                                             if k != "curriculum"})

    def load(self, checkpoint: dict) -> None:
        self.samples_seen = checkpoint.get("samples_seen", 0)
        self.tokens_seen = checkpoint.get("tokens_seen", 0)
        if self.partial_budget and "partial_rollouts" in checkpoint:
            self.collector_state = this_ranks(checkpoint, "partial_rollouts")


def rollout_metrics(exp: Experience) -> dict[str, float]:
    """`rollout/*` of this rank's batch as trained on (after the parts' changes to its rewards)."""
    lengths = exp.response_mask.sum(dim=1)
    informative = core.informative_groups(exp.scores, exp.group_index)
    flat_groups = exp.group_index[~informative].unique().numel() / exp.group_index.unique().numel()
    metrics = {
        "rollout/reward_mean": float(exp.scores.mean()),
        "rollout/reward_std": float(exp.scores.std()) if len(exp.scores) > 1 else 0.0,
        "rollout/response_len_mean": float(lengths.mean()),
        "rollout/truncated_frac": float(exp.truncated.float().mean()),
        "rollout/frac_zero_std_groups": flat_groups,
    }
    if exp.repeated is not None:
        metrics["rollout/repetition_frac"] = float(exp.repeated.float().mean())
    if exp.prm_stopped is not None:
        metrics["rollout/prm_stop_frac"] = float(exp.prm_stopped.float().mean())
    if not torch.isnan(exp.correct).any():
        metrics["rollout/accuracy"] = float(exp.correct.mean())
    return metrics


def source_metrics(exp: Experience, names: tuple[str, ...]) -> dict[str, float]:
    """`rollout/<source>/count`, `reward_mean` and `accuracy` of a mixture's sources (data=mixture),
    over every rank's rows of the batch as trained on. The ranks hold different examples, so each
    reduces the same [sources, 3] sums — reward, correct, rows — whose names come from the config,
    not from its own rows: every rank logs the same keys. A source without rows in the batch logs
    its count (0) alone; without an accuracy reward there is no accuracy (NaN on every rank)."""
    sums = torch.zeros(len(names), 3, dtype=torch.float64, device=exp.scores.device)
    index = exp.source_index.to(sums.device)
    sums[:, 0].index_add_(0, index, exp.scores.double())
    sums[:, 1].index_add_(0, index, exp.correct.double())
    sums[:, 2].index_add_(0, index, torch.ones_like(index, dtype=torch.float64))
    metrics = {}
    for name, (reward, correct, rows) in zip(names, all_reduce_sum(sums).tolist()):
        metrics[f"rollout/{name}/count"] = rows
        if rows:
            metrics[f"rollout/{name}/reward_mean"] = reward / rows
            if not math.isnan(correct):
                metrics[f"rollout/{name}/accuracy"] = correct / rows
    return metrics
