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
from dataclasses import dataclass, field, fields, replace

import torch

from posttrain.algorithms.experience import Experience
from posttrain.algorithms.online.sampler import PolicySampler
from posttrain.data.datamodule import collate_prompts
from posttrain.envs.episodes import Budget, Episodes, Trajectory, TrajectoryBatch, as_batch, outcome
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
class CollectSettings:
    """What one rollout batch is: `group_size` samples of `prompts_per_step` prompts drawn with
    `sampling`, ended by any of `eos_ids`; `partial_budget` tokens per generate call (partial
    rollouts; None: whole responses); `env` an environment answering each turn (`turn_tokens`
    per turn, `max_new_tokens` in all). The rest comes from the parts that are on: a process
    reward's `step_rule`, `process_reward` and `prm_stop_below` (parts/process_rewards.py),
    the constraint's `cost_component` (parts/constraint.py)."""

    sampling: SamplingParams
    group_size: int
    prompts_per_step: int
    seed: int
    eos_ids: list[int]
    partial_budget: int | None = None
    env: object = None               # an Environment (envs/): multi-turn episodes
    turn_tokens: int | None = None   # env.turn_tokens: a policy turn's budget (None: the rest)
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
        self.env = s.env
        self.episodes = Episodes(s.env, tokenizer, Budget(s.sampling.max_new_tokens, s.turn_tokens,
                                                          s.env.max_turns if s.env is not None else 1), s.eos_ids)
        self.rounds_agree = rounds_agree
        self.cost_component = s.cost_component  # reward.constraint's cost: its scores go to Experience.cost
        self.version = 0
        # partial rollouts: responses not ended, and ended groups waiting for a batch
        self.pending: list[Trajectory] = []
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
        """`group_size` samples of each example, scored: (Experience, reward metrics). With an
        environment each sample is an episode, run turn by turn to its end."""
        group_size = group_size or self.group_size
        self._sampled[0] += len(examples) * group_size
        if self.env is not None:
            trajectories = self.episodes.start_all(examples, first_group, group_size, self.sampling.return_support)
            while any(not t.ended for t in trajectories):
                self.advance([t for t in trajectories if not t.ended], None, generator)
            return self.score_trajectories(trajectories)
        prompts = collate_prompts(examples, self.tokenizer)
        prompt_ids = prompts["prompt_ids"].to(self.device).repeat_interleave(group_size, dim=0)
        prompt_mask = prompts["prompt_mask"].to(self.device).repeat_interleave(group_size, dim=0)
        batch = self.timed_generate(prompt_ids, prompt_mask, self.sampling, generator)
        groups = [first_group + i // group_size for i in range(len(batch.response_ids))]
        return self.score(batch, [examples[i // group_size] for i in range(len(groups))], groups)

    def advance(self, active: list[Trajectory], per_call: int | None, generator) -> None:
        """One generate call over the trajectories under way: each gets at most `per_call`
        tokens more (None: to the end of its turn), then its episode answers a turn it ended."""
        ids, mask = self.episodes.inputs(active, self.tokenizer.pad_token_id)
        params = replace(self.sampling, max_new_tokens=self.episodes.call_budget(active, per_call))
        batch = self.timed_generate(ids.to(self.device), mask.to(self.device), params, generator)
        for i, trajectory in enumerate(active):
            self.episodes.extend(trajectory, batch, i, self.version)
        self.stop_repeats_across_segments([t for t in active if t.segments > 1 and not t.repeated])

    def score(self, batch: RolloutBatch, examples: list, groups: list[int], versions=None, segments=None,
              trajectories: TrajectoryBatch | None = None, episodes: list[Trajectory] | None = None):
        """A sampled batch's responses scored (rows: `examples`, `groups`): (Experience, reward
        metrics). `versions` [B, T]: the policy version of each token (default: the current);
        `segments` [B]: generate calls per response (default 1); `trajectories`, `episodes`:
        what an environment added (its tokens, turn rewards), and the trajectories themselves."""
        samples, step_ends = rollout_samples(self.tokenizer, batch, examples, groups, self.step_rule)
        if episodes is not None and self.env is not None:
            for sample, trajectory in zip(samples, episodes):
                # the final answer is the last turn; the environment's rewards and verdict ride along
                ended = outcome(trajectory, self.tokenizer)
                sample.response, sample.env_return, sample.env_correct = ended.final, ended.env_return, ended.correct
                sample.transcript = ended.transcript
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
        if trajectories is not None and trajectories.env_mask is not None:
            # each turn's reward where it was earned, weighted as the `environment` component is in `scores`
            weight = self.reward_fn.weight_of("environment")
            experience.env_mask, experience.turns = trajectories.env_mask, trajectories.turns
            experience.turn_rewards = trajectories.turn_rewards * weight
            scored.metrics.update(episode_metrics(episodes))
        if scored.step_rewards is not None:
            rewards, ends = place_step_rewards(scored.step_rewards, step_ends, batch.response_mask.shape)
            experience.step_rewards, experience.step_mask = rewards.to(self.device), ends.to(self.device)
        if self.cost_component is not None:  # weighted 0, so not in `scores`: the trainer adds it with its lambda
            experience.cost = scored.components[self.cost_component].to(self.device)
        names = getattr(self.source, "source_names", None)
        if names:  # a mixture of sources (data/mixture.py): each row's, for the metrics per source
            experience.source_index = torch.tensor([names.index(e.source) for e in examples], device=self.device)
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
        """One generate call of `partial_budget` tokens over every trajectory under way and G
        new ones per example; returns the groups that ended in it, scored (None if none)."""
        self.pending += self.episodes.start_all(examples, self.next_group, self.group_size,
                                                self.sampling.return_support)
        self.next_group += len(examples)
        self._sampled[0] += len(examples) * self.group_size
        active = [t for t in self.pending if not t.ended]
        if active:
            self.advance(active, self.partial_budget, generator)
        unfinished = {t.group for t in self.pending if not t.ended}
        done = [t for t in self.pending if t.group not in unfinished]
        if not done:
            return None, {}
        self.pending = [t for t in self.pending if t.group in unfinished]
        return self.score_trajectories(done)

    def stop_repeats_across_segments(self, trajectories: list[Trajectory]) -> None:
        """The repetition stop over each continued response as a whole (its segments joined):
        the sampler sees one segment at a time, so a loop spanning segments is found here, at
        the token where sampling in one call would have found it."""
        rule = self.sampling.repetition
        # an episode's current turn only: earlier turns were checked as they were sampled, and
        # the environment's tokens are not the policy's to repeat
        trajectories = [t for t in trajectories if rule is not None and len(t.tokens) - t.turn_start >= rule.window]
        if not trajectories:
            return
        width = max(len(t.tokens) - t.turn_start for t in trajectories)
        tokens = torch.full((len(trajectories), width), self.tokenizer.pad_token_id, dtype=torch.long)
        for i, t in enumerate(trajectories):
            tokens[i, :len(t.tokens) - t.turn_start] = t.tokens[t.turn_start:]
        found = first_repetition(tokens, self.eos_ids, rule).tolist()
        for trajectory, at in zip(trajectories, found):
            if 0 <= at < len(trajectory.tokens) - trajectory.turn_start:  # a detection in the padding is not one
                self.episodes.cut_at(trajectory, trajectory.turn_start + at + 1)
                if self.episodes.env is not None:  # the episode judges the turn the stop cut
                    self.episodes.end_turn(trajectory, closed=False, last=True)
                trajectory.ended, trajectory.repeated, trajectory.truncated = True, True, False

    def score_trajectories(self, trajectories: list[Trajectory]) -> tuple[Experience, dict]:
        """Ended trajectories, whole groups in order, as one scored Experience."""
        batch = as_batch(trajectories, self.sampling.max_new_tokens, self.tokenizer.pad_token_id, self.device)
        return self.score(batch.rollout, [t.example for t in trajectories], [t.group for t in trajectories],
                          versions=batch.versions, segments=batch.segments, trajectories=batch, episodes=trajectories)

    # --- state (checkpoints, a producer's hand-over) ------------------------------------------
    def state_dict(self) -> dict:
        """The curriculum's state, and the partial rollouts under way: what a resume (or a new
        producer) needs to go on where this batch left off."""
        return {"curriculum": self.curriculum.state_dict(),
                "pending": [trajectory.to_state() for trajectory in self.pending],
                "ready": [({f.name: getattr(exp, f.name) for f in fields(exp)}, dict(metrics))
                          for exp, metrics in self.ready],
                "next_group": self.next_group}

    def load_partial_state(self, state: dict) -> None:
        """The partial rollouts of `state_dict` (the curriculum is restored by its owner)."""
        self.pending = [Trajectory.from_state(trajectory) for trajectory in state.get("pending", [])]
        for trajectory in self.pending:  # an environment's episodes under way, replayed to where they were
            if not trajectory.ended:
                self.episodes.rebuild_episode(trajectory)
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


def episode_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """Per-episode means over a scored batch's trajectories: `episode/turns`, `episode/return`
    (the environment's rewards summed), `episode/reward_turn<k>` (the mean reward of turn k
    over the episodes that reached it) and each count the replies gave (`episode/tool_calls`,
    `episode/tool_errors`, `episode/sandbox_timeouts`, ...)."""
    n = len(trajectories)
    metrics = {"episode/turns": sum(t.turns for t in trajectories) / n,
               "episode/return": sum(sum(t.turn_rewards) for t in trajectories) / n}
    for name in sorted({name for t in trajectories for name in t.metrics}):
        metrics[f"episode/{name}"] = sum(t.metrics.get(name, 0.0) for t in trajectories) / n
    for turn in range(max(t.turns for t in trajectories)):
        rewards = [t.turn_rewards[turn] for t in trajectories if t.turns > turn]
        metrics[f"episode/reward_turn{turn}"] = sum(rewards) / len(rewards)
    return metrics
