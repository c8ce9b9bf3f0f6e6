"""The collect stage of online RL, as an object of its own: prompts from the curriculum -> G
samples each -> their steps (for a process reward) -> rewards, with dynamic sampling's extra
rounds and Kimi k1.5's partial rollouts.

The trainer runs it in its own process (`rollout.max_staleness=0`, the synchronous pipeline),
or a rollout producer runs it beside the trainer with a copy of the weights (producer.py).
Either way it holds no Lightning state and takes no collective of its own: what the ranks
must agree on (the pre-filter accuracy, whether any rank has a signal) is reduced by the
trainer when it consumes the batch (`OnlineRLModule.collect`, module.py). Only the synchronous
pipeline's rounds of dynamic sampling ask the ranks (`rounds_agree`), as they always have.

Partial rollouts (`rollout.partial_budget=N`, Kimi k1.5): each generate call gives every
unfinished response at most N more tokens. A response that has not ended is kept (prompt,
tokens so far, their log-probs and the policy version that sampled each) and continued in
a later call, after the prompt and its own tokens so far, with whatever weights are current
then; a group is scored and trained on once all its responses have ended (EOS, the
repetition stop, or `max_new_tokens` in all). Before each call new prompts top the groups
under way up to `prompts_per_step`; the batch takes the groups that end, so a long response
never holds up a batch: it goes on in the next batch's calls. Groups that end beyond what
the batch needs wait, scored, for the next batch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace

import torch

from posttrain.algorithms.experience import Experience
from posttrain.algorithms.online.sampler import PolicySampler
from posttrain.data.datamodule import collate_prompts, left_padded, prompt_token_ids
from posttrain.data.examples import Example
from posttrain.rewards.samples import rollout_samples
from posttrain.rollout import RolloutBatch, SamplingParams
from posttrain.rollout.repetition import first_repetition


def still_needs(need: int) -> bool:
    """Whether this rank's batch still needs groups (the rounds of a rank that asks no other)."""
    return need > 0


def rank_seed(base: int, rank: int, world: int) -> int:
    """A generator seed of this rank: the run's own seed in a single process."""
    return base * world + rank


@dataclass
class CollectedBatch:
    """One rollout batch as the collect stage hands it over: this rank's alone, before any
    collective (the trainer reduces what the ranks must agree on)."""

    index: int                    # which rollout batch (the trainer's train_batches_seen)
    experience: Experience        # the kept groups (the first round's when none was kept)
    metrics: dict[str, float]     # reward components, curriculum counts, partial-rollout counts
    first_round: list[float]      # [reward sum, correct sum, rows] of the first scored round
    kept_any: bool                # whether a group was kept (False: nothing to learn from here)
    state: dict                   # the collector's state after this batch (curriculum, partial rollouts)
    generate_s: list[float] = field(default_factory=list)  # each generate call's duration
    # [completions started, response tokens generated] by this rank's generate calls for the batch,
    # dynamic sampling's dropped rounds and partial rollouts' continuations included: the budget spent
    sampled: list[float] = field(default_factory=lambda: [0.0, 0.0])


@dataclass
class PartialResponse:
    """A response of partial rollouts: its prompt, and what its segments have produced."""

    example: object
    group: int                   # its group's id, unique over the collector's life
    prompt: torch.Tensor         # [P] the prompt's token ids
    tokens: torch.Tensor         # [n] sampled so far
    logprobs: torch.Tensor       # [n] the sampler's log-probs of them
    versions: torch.Tensor       # [n] the policy version that sampled each
    support_size: torch.Tensor | None = None      # [n] with keep_sampling_mask
    support_logprobs: torch.Tensor | None = None  # [n]
    segments: int = 0            # generate calls it took part in
    ended: bool = False
    truncated: bool = False      # ended at max_new_tokens without an EOS
    repeated: bool = False       # ended by the repetition stop

    def to_state(self) -> dict:
        """Plain values and tensors (what a checkpoint loads with weights_only)."""
        return {**{f.name: getattr(self, f.name) for f in fields(self) if f.name != "example"},
                "example": asdict(self.example)}

    @staticmethod
    def from_state(state: dict) -> PartialResponse:
        return PartialResponse(**{**state, "example": Example(**state["example"])})


@dataclass
class CollectSettings:
    """What one rollout batch is: `group_size` samples of `prompts_per_step` prompts drawn with
    `sampling`, ended by any of `eos_ids`; `partial_budget` tokens per generate call (partial
    rollouts; None: whole responses). The rest comes from the parts that are on: a process
    reward's `step_rule`, `process_reward` and `prm_stop_below` (parts/process_rewards.py),
    the constraint's `cost_component` (parts/constraint.py)."""

    sampling: SamplingParams
    group_size: int
    prompts_per_step: int
    seed: int
    eos_ids: list[int]
    partial_budget: int | None = None
    step_rule: object = None
    process_reward: object = None
    prm_stop_below: float | None = None
    cost_component: str | None = None


class Collector:
    """`sampler` (sampler.py) samples with the policy (the trainer's, or a producer's copy);
    `version` is the number of policy updates in the weights it samples with, set by whoever
    drives it. `rounds_agree(need)`: whether any rank still needs groups (None: this rank
    alone decides, a producer's case)."""

    def __init__(self, sampler: PolicySampler, tokenizer, source, curriculum, reward_fn, settings: CollectSettings,
                 *, rank: int = 0, world: int = 1, device="cpu", rounds_agree: Callable[[int], bool] | None = None):
        self.sampler, self.tokenizer, self.source = sampler, tokenizer, source
        self.curriculum, self.reward_fn = curriculum, reward_fn
        s = settings
        self.sampling, self.group_size, self.prompts_per_step = s.sampling, s.group_size, s.prompts_per_step
        self.seed, self.rank, self.world, self.device = s.seed, rank, world, torch.device(device)
        self.eos_ids = torch.tensor(s.eos_ids, dtype=torch.long)
        self.step_rule, self.process_reward, self.prm_stop_below = s.step_rule, s.process_reward, s.prm_stop_below
        self.partial_budget = s.partial_budget
        self.rounds_agree = rounds_agree
        self.cost_component = s.cost_component  # reward.constraint's cost: its scores go to Experience.cost
        self.version = 0
        # partial rollouts: responses not ended, and ended groups waiting for a batch
        self.pending: list[PartialResponse] = []
        self.ready: list[tuple[Experience, dict]] = []
        self.next_group = 0
        self._generate_s: list[float] = []
        self._sampled = [0.0, 0.0]

    # --- one rollout batch ------------------------------------------------------------------
    def collect(self, index: int) -> CollectedBatch:
        generator = torch.Generator(device=self.device).manual_seed(
            rank_seed(self.seed * 1_000_003 + index, self.rank, self.world))
        self.reward_fn.set_step(index)  # rewards with a warm-up (the Kimi length reward) count rollout batches
        self._generate_s, self._sampled = [], [0.0, 0.0]
        if self.partial_budget:
            batch = self.collect_partial(index, generator)
        else:
            batch = self.collect_whole(index, generator)
        batch.generate_s, batch.sampled = self._generate_s, self._sampled
        return batch

    def collect_whole(self, index: int, generator) -> CollectedBatch:
        """Every response sampled to its end in one call; dynamic sampling's extra rounds when
        the curriculum asks for them."""
        kept, metrics, rounds, groups_seen, dropped = [], {}, 0, 0, 0
        need = self.prompts_per_step
        first = None
        while rounds <= self.curriculum.max_extra_rounds and (self.rounds_agree or still_needs)(need):
            # a rank whose batch is full samples along on one prompt, kept by none (the ranks'
            # rounds agree, see rounds_agree)
            count = need if rounds == 0 else self.prompts_per_step if need > 0 else 1
            examples = self.curriculum.next_prompts(count)
            experience, reward_metrics = self.sample_and_score(examples, groups_seen, generator)
            if rounds == 0:
                metrics.update(reward_metrics)
                first = experience
            groups_seen += len(examples)
            if need == 0:  # sampled along only
                rounds += 1
                continue
            keep = self.curriculum.keep_groups(experience.scores, experience.correct, experience.group_index)
            dropped += int((~keep).sum()) // self.group_size
            kept_groups = experience.group_index[keep].unique()[:need]  # whole groups, no more than needed
            kept.append(experience.select(torch.isin(experience.group_index, kept_groups)))
            need -= len(kept_groups)
            rounds += 1
        return self.finish(index, first, kept, metrics, rounds - 1, dropped, need)

    def finish(self, index, first: Experience, kept: list[Experience], metrics: dict, extra_rounds: int,
               dropped: int, need: int) -> CollectedBatch:
        nonempty = [k for k in kept if len(k)]
        if self.curriculum.max_extra_rounds:
            metrics.update({"curriculum/extra_rounds": float(extra_rounds), "curriculum/dropped_groups": float(dropped),
                            "curriculum/batch_fill": 1.0 - need / self.prompts_per_step})
        # a rank without an informative group still joins the update (its advantages are 0)
        exp = Experience.concat(nonempty, self.tokenizer.pad_token_id) if nonempty else first
        first_round = [float(first.scores.double().sum()), float(first.correct.double().sum()), float(len(first))]
        return CollectedBatch(index=index, experience=exp, metrics=metrics, first_round=first_round,
                              kept_any=bool(nonempty), state=self.state_dict())

    def collect_partial(self, index: int, generator) -> CollectedBatch:
        """Partial rollouts (module docstring): calls of `partial_budget` tokens until the batch
        has its groups, each first topping the groups under way up to `prompts_per_step` with
        new prompts. The calls are bounded (a curriculum that drops every group cannot loop
        forever): as many as a group needs to end, times 1 + the curriculum's extra rounds."""
        need, kept, metrics, dropped, calls, draws = self.prompts_per_step, [], {}, 0, 0, 0
        first = None
        calls_per_response = math.ceil(self.sampling.max_new_tokens / self.partial_budget)
        max_calls = (1 + self.curriculum.max_extra_rounds) * calls_per_response
        waiting, self.ready = self.ready, []
        while need > 0:
            if waiting:
                experience, reward_metrics = waiting.pop(0)
            elif calls < max_calls:
                under_way = len({r.group for r in self.pending})
                examples = self.curriculum.next_prompts(max(0, self.prompts_per_step - under_way))
                draws += bool(examples)
                experience, reward_metrics = self.continue_partial(examples, generator)
                calls += 1
                if experience is None:  # no group ended in this call
                    continue
            else:
                break
            if first is None:
                first = experience
                metrics.update(reward_metrics)
            keep = self.curriculum.keep_groups(experience.scores, experience.correct, experience.group_index)
            dropped += int((~keep).sum()) // self.group_size
            groups = experience.group_index[keep].unique()
            kept.append(experience.select(torch.isin(experience.group_index, groups[:need])))
            if len(groups) > need:  # ended beyond what this batch needs: the next batch's first
                self.ready.append((experience.select(torch.isin(experience.group_index, groups[need:])),
                                   reward_metrics))
            need -= min(need, len(groups))
        self.ready = waiting + self.ready
        batch = self.finish(index, first, kept, metrics, max(0, draws - 1), dropped, need)
        # group ids count over the collector's life: number this batch's 0, 1, ... in order
        batch.experience.group_index = torch.unique(batch.experience.group_index, return_inverse=True)[1]
        batch.metrics["rollout/pending_responses"] = float(sum(not r.ended for r in self.pending))
        return batch

    # --- sampling and scoring -----------------------------------------------------------------
    def timed_generate(self, prompt_ids, prompt_mask, params: SamplingParams, generator) -> RolloutBatch:
        started = time.perf_counter()
        batch = self.sampler.generate(prompt_ids, prompt_mask, params, generator=generator)
        self._generate_s.append(time.perf_counter() - started)
        self._sampled[1] += float(batch.response_mask.sum())
        return batch

    def sample_and_score(self, examples, first_group: int, generator, group_size: int | None = None):
        """`group_size` samples of each example, scored: (Experience, reward metrics)."""
        group_size = group_size or self.group_size
        prompts = collate_prompts(examples, self.tokenizer)
        prompt_ids = prompts["prompt_ids"].to(self.device).repeat_interleave(group_size, dim=0)
        prompt_mask = prompts["prompt_mask"].to(self.device).repeat_interleave(group_size, dim=0)
        batch = self.timed_generate(prompt_ids, prompt_mask, self.sampling, generator)
        self._sampled[0] += len(prompt_ids)
        groups = [first_group + i // group_size for i in range(len(batch.response_ids))]
        return self.score(batch, [examples[i // group_size] for i in range(len(groups))], groups)

    def score(self, batch: RolloutBatch, examples: list, groups: list[int], versions=None, segments=None):
        """A sampled batch's responses scored (rows: `examples`, `groups`): (Experience, reward
        metrics). `versions` [B, T]: the policy version of each token (default: the current);
        `segments` [B]: generate calls per response (default 1)."""
        samples, step_ends = rollout_samples(self.tokenizer, batch, examples, groups, self.step_rule)
        prm_stopped = None
        if self.prm_stop_below is not None:
            samples, step_ends, prm_stopped = self.stop_at_low_prm_steps(batch, samples, step_ends)
        scored = self.reward_fn(samples, self.source)
        correct = scored.correct.float() if scored.correct is not None else torch.full((len(samples),), float("nan"))
        if versions is None:
            versions = torch.full(batch.response_ids.shape, self.version, dtype=torch.long)
        experience = Experience(
            prompt_ids=batch.prompt_ids, prompt_mask=batch.prompt_mask, response_ids=batch.response_ids,
            response_mask=batch.response_mask.float(), rollout_logprobs=batch.logprobs, truncated=batch.truncated,
            scores=scored.total.to(self.device), correct=correct.to(self.device),
            group_index=torch.tensor(groups, device=self.device), support_size=batch.support_size,
            support_logprobs=batch.support_logprobs, repeated=batch.repeated, prm_stopped=prm_stopped,
            policy_version=(versions.to(self.device) * batch.response_mask).long(),
            segments=(segments if segments is not None else torch.ones(len(groups), dtype=torch.long)).to(self.device),
        )
        if scored.step_rewards is not None:
            rewards, ends = place_step_rewards(scored.step_rewards, step_ends, batch.response_mask.shape)
            experience.step_rewards, experience.step_mask = rewards.to(self.device), ends.to(self.device)
        if self.cost_component is not None:  # weighted 0, so not in `scores`: the trainer adds it with its lambda
            experience.cost = scored.components[self.cost_component].to(self.device)
        return experience, scored.metrics

    def stop_at_low_prm_steps(self, batch, samples, step_ends):
        """PRM early stop (rollout.prm_stop_below): a response is cut after its first step whose
        PRM score falls below the threshold, as if generation had stopped there; the rest of its
        tokens become padding. Returns the samples and step ends of the cut batch, and the [B]
        flags. (The cut comes after generation, so it saves training and scoring, not sampling.)"""
        scores = self.process_reward.prm.step_scores(samples, self.source)
        stopped = torch.zeros(len(samples), dtype=torch.bool, device=batch.response_ids.device)
        # the engines return inference-mode tensors: edit copies
        batch.response_ids, batch.response_mask = batch.response_ids.clone(), batch.response_mask.clone()
        batch.truncated = batch.truncated.clone()
        for i, (sample, row_scores, ends) in enumerate(zip(samples, scores, step_ends)):
            low = [k for k, score in enumerate(row_scores[:-1]) if score < self.prm_stop_below]
            if not low:
                continue
            keep = low[0] + 1  # steps kept: up to and including the first low one
            batch.response_mask[i, ends[low[0]] + 1:] = 0
            batch.response_ids[i, ends[low[0]] + 1:] = self.tokenizer.pad_token_id
            stopped[i], batch.truncated[i] = True, False
            sample.steps, step_ends[i] = sample.steps[:keep], ends[:keep]
            sample.response = "".join(sample.steps)
            sample.length, sample.prm_stopped = ends[low[0]] + 1, True
        return samples, step_ends, stopped

    # --- partial rollouts ---------------------------------------------------------------------
    def continue_partial(self, examples, generator) -> tuple[Experience | None, dict]:
        """One generate call of `partial_budget` tokens over every unfinished response and G
        new ones per example; returns the groups that ended in it, scored (None if none)."""
        for example in examples:
            prompt = torch.tensor(prompt_token_ids(example, self.tokenizer), dtype=torch.long)
            empty = torch.zeros(0, dtype=torch.long)
            for _ in range(self.group_size):
                self.pending.append(PartialResponse(
                    example=example, group=self.next_group, prompt=prompt, tokens=empty,
                    logprobs=torch.zeros(0), versions=empty,
                    support_size=torch.zeros(0, dtype=torch.int32) if self.sampling.return_support else None,
                    support_logprobs=torch.zeros(0) if self.sampling.return_support else None))
            self.next_group += 1
        self._sampled[0] += len(examples) * self.group_size
        active = [r for r in self.pending if not r.ended]
        if active:
            ids, mask = left_padded([torch.cat([r.prompt, r.tokens]).tolist() for r in active],
                                    self.tokenizer.pad_token_id)
            params = replace(self.sampling, max_new_tokens=self.partial_budget)
            batch = self.timed_generate(ids.to(self.device), mask.to(self.device), params, generator)
            for i, response in enumerate(active):
                self.extend(response, batch, i)
            self.stop_repeats_across_segments([r for r in active if r.segments > 1 and not r.repeated])
        unfinished = {r.group for r in self.pending if not r.ended}
        done = [r for r in self.pending if r.group not in unfinished]
        if not done:
            return None, {}
        self.pending = [r for r in self.pending if r.group in unfinished]
        return self.score_partial(done)

    def extend(self, response: PartialResponse, batch: RolloutBatch, row: int) -> None:
        """Append row `row` of a generate call's batch to `response`, cut at the budget of
        `max_new_tokens` tokens in all, and mark how it ended."""
        length = int(batch.response_mask[row].sum())
        room = self.sampling.max_new_tokens - len(response.tokens)
        take = min(length, room)
        response.tokens = torch.cat([response.tokens, batch.response_ids[row, :take].cpu()])
        response.logprobs = torch.cat([response.logprobs, batch.logprobs[row, :take].float().cpu()])
        response.versions = torch.cat([response.versions, torch.full((take,), self.version, dtype=torch.long)])
        if response.support_size is not None:
            response.support_size = torch.cat([response.support_size, batch.support_size[row, :take].cpu()])
            response.support_logprobs = torch.cat([response.support_logprobs,
                                                   batch.support_logprobs[row, :take].float().cpu()])
        response.segments += 1
        whole = take == length  # nothing cut at the overall budget
        if whole and bool(batch.repeated[row]):
            response.ended, response.repeated = True, True
        elif whole and not bool(batch.truncated[row]):
            response.ended = True  # an EOS
        elif len(response.tokens) >= self.sampling.max_new_tokens:
            response.ended, response.truncated = True, True

    def stop_repeats_across_segments(self, responses: list[PartialResponse]) -> None:
        """The repetition stop over each continued response as a whole (its segments joined):
        the sampler sees one segment at a time, so a loop spanning segments is found here, at
        the token where sampling in one call would have found it."""
        rule = self.sampling.repetition
        responses = [r for r in responses if rule is not None and len(r.tokens) >= rule.window]
        if not responses:
            return
        width = max(len(r.tokens) for r in responses)
        tokens = torch.full((len(responses), width), self.tokenizer.pad_token_id, dtype=torch.long)
        for i, r in enumerate(responses):
            tokens[i, :len(r.tokens)] = r.tokens
        found = first_repetition(tokens, self.eos_ids, rule).tolist()
        for response, at in zip(responses, found):
            if 0 <= at < len(response.tokens):  # a detection in the padding is not one
                keep = at + 1
                for name in ("tokens", "logprobs", "versions", "support_size", "support_logprobs"):
                    if getattr(response, name) is not None:
                        setattr(response, name, getattr(response, name)[:keep])
                response.ended, response.repeated, response.truncated = True, True, False

    def score_partial(self, responses: list[PartialResponse]) -> tuple[Experience, dict]:
        """Ended responses, whole groups in order, as one scored Experience."""
        width = self.sampling.max_new_tokens
        n = len(responses)
        prompt_ids, prompt_mask = left_padded([r.prompt.tolist() for r in responses], self.tokenizer.pad_token_id)
        response_ids = torch.full((n, width), self.tokenizer.pad_token_id, dtype=torch.long)
        response_mask = torch.zeros((n, width), dtype=torch.long)
        logprobs, versions = torch.zeros((n, width)), torch.zeros((n, width), dtype=torch.long)
        support = self.sampling.return_support
        support_size = torch.zeros((n, width), dtype=torch.int32) if support else None
        support_logprobs = torch.zeros((n, width)) if support else None
        for i, r in enumerate(responses):
            k = len(r.tokens)
            response_ids[i, :k], response_mask[i, :k] = r.tokens, 1
            logprobs[i, :k], versions[i, :k] = r.logprobs, r.versions
            if support:
                support_size[i, :k], support_logprobs[i, :k] = r.support_size, r.support_logprobs
        device = self.device
        batch = RolloutBatch(
            prompt_ids=prompt_ids.to(device), prompt_mask=prompt_mask.to(device), response_ids=response_ids.to(device),
            response_mask=response_mask.to(device), logprobs=logprobs.to(device),
            truncated=torch.tensor([r.truncated for r in responses], device=device),
            support_size=support_size.to(device) if support else None,
            support_logprobs=support_logprobs.to(device) if support else None,
            repeated=torch.tensor([r.repeated for r in responses], device=device))
        return self.score(batch, [r.example for r in responses], [r.group for r in responses], versions=versions,
                          segments=torch.tensor([r.segments for r in responses]))

    # --- state (checkpoints, a producer's hand-over) ------------------------------------------
    def state_dict(self) -> dict:
        """The curriculum's state, and the partial rollouts under way: what a resume (or a new
        producer) needs to go on where this batch left off."""
        return {"curriculum": self.curriculum.state_dict(),
                "pending": [response.to_state() for response in self.pending],
                "ready": [({f.name: getattr(exp, f.name) for f in fields(exp)}, dict(metrics))
                          for exp, metrics in self.ready],
                "next_group": self.next_group}

    def load_partial_state(self, state: dict) -> None:
        """The partial rollouts of `state_dict` (the curriculum is restored by its owner)."""
        self.pending = [PartialResponse.from_state(response) for response in state.get("pending", [])]
        self.ready = [(Experience(**exp), dict(metrics)) for exp, metrics in state.get("ready", [])]
        self.next_group = state.get("next_group", 0)


def place_step_rewards(step_rewards: list[list[float]], step_ends: list[list[int]], shape) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, T] each step's reward at its last token, [B, T] bool marking those tokens)."""
    rewards = torch.zeros(shape)
    ends = torch.zeros(shape, dtype=torch.bool)
    for i, (row_rewards, row_ends) in enumerate(zip(step_rewards, step_ends)):
        rewards[i, row_ends] = torch.tensor(row_rewards, dtype=torch.float32)
        ends[i, row_ends] = True
    return rewards, ends
