"""Trajectories: responses sampled over one or more generate calls, and, with an environment,
over several turns.

A `Trajectory` holds a prompt and the tokens after it: the ids the policy sampled and, between
its turns, the environment's observation ids (`from_env`). Each generate call continues every
trajectory under way from its prompt and its own tokens so far (`advance`); `extend` appends
what a call sampled for one row, cut at the trajectory's budget and at its turn's budget, and
decides how it goes on:

  no environment     the response ends at an end-of-turn token, a loop (rollout.repetition) or
                     the budget; a call that stops short of all three (partial rollouts' budget
                     per call) leaves it to be continued by the next call
  an environment     an ended turn (end-of-turn token, or the turn's token budget) goes to the
                     episode; its reply's reward is recorded at the turn's last token; unless the
                     episode is done, out of turns, or its observation leaves no room for a
                     next turn, the observation's ids are appended and the next turn begins

The policy's ids are never decoded and re-encoded: a turn's text is handed to the episode to
read, and the trainer sees the ids as sampled. Environment tokens get log-prob 0 and are
masked out of every loss (`Experience.env_mask`).

Partial rollouts and a producer's hand-over save trajectories as plain values; the episode
objects under way are rebuilt on load by replaying their turns (`rebuild_episode`): an
environment must answer the same turns with the same replies.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import torch

from posttrain.data.datamodule import left_padded, prompt_token_ids
from posttrain.data.examples import Example
from posttrain.envs.base import Environment, Turn, observation_ids
from posttrain.errors import DataError
from posttrain.rollout import RolloutBatch


@dataclass
class Trajectory:
    """A response under way or ended: its prompt, and what its generate calls (and its
    environment) have produced."""

    example: Example
    group: int                   # its group's id
    prompt: torch.Tensor         # [P] the prompt's token ids
    tokens: torch.Tensor         # [n] sampled so far, the environment's observations included
    logprobs: torch.Tensor       # [n] the sampler's log-probs of them (0 on environment tokens)
    versions: torch.Tensor       # [n] the policy version that sampled each (0 on environment tokens)
    support_size: torch.Tensor | None = None      # [n] with keep_sampling_mask
    support_logprobs: torch.Tensor | None = None  # [n]
    from_env: torch.Tensor | None = None          # [n] bool, the environment's tokens (with one)
    segments: int = 0            # generate calls it took part in
    ended: bool = False
    truncated: bool = False      # ended at the budget without an EOS
    repeated: bool = False       # ended by the repetition stop
    # --- with an environment ---
    turn_start: int = 0          # where the policy turn under way began
    turn_ends: list[int] = field(default_factory=list)      # each ended turn's last token
    turn_rewards: list[float] = field(default_factory=list)  # each ended turn's reward
    correct: bool | None = None  # the episode's verdict, when it gave one
    metrics: dict[str, float] = field(default_factory=dict)  # the replies' counts, summed
    episode: object = None       # the environment's episode (not saved: rebuilt by replay)

    @property
    def turns(self) -> int:
        return len(self.turn_ends)

    def policy_mask(self) -> torch.Tensor:
        """[n] bool, the tokens the policy sampled."""
        return torch.ones(len(self.tokens), dtype=torch.bool) if self.from_env is None else ~self.from_env

    def to_state(self) -> dict:
        """Plain values and tensors (what a checkpoint loads with weights_only)."""
        return {**{f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("example", "episode")},
                "example": asdict(self.example)}

    @staticmethod
    def from_state(state: dict) -> Trajectory:
        return Trajectory(**{**state, "example": Example(**state["example"])})


@dataclass
class Budget:
    """How long a trajectory may grow: `tokens` in all after its prompt (the response width),
    `turn_tokens` per policy turn (None: the rest of `tokens`), `max_turns` policy turns."""

    tokens: int
    turn_tokens: int | None = None
    max_turns: int = 1


class Episodes:
    """Runs trajectories forward: the environment (None: single responses), the tokenizer its
    observations are encoded with, the budget, the end-of-turn ids."""

    def __init__(self, env: Environment | None, tokenizer, budget: Budget, eos_ids):
        self.env, self.tokenizer, self.budget = env, tokenizer, budget
        self.eos_ids = torch.as_tensor(eos_ids, dtype=torch.long)

    # --- starting ------------------------------------------------------------------------------
    def start_all(self, examples: list[Example], first_group: int, group_size: int,
                  with_support: bool) -> list[Trajectory]:
        """`group_size` trajectories of each example, nothing sampled yet (with an environment, the
        example as it prepares it and the episodes started), groups numbered from `first_group`."""
        trajectories = []
        for number, example in enumerate(examples):
            if self.env is not None:
                example = self.env.prepare(example)
            prompt = torch.tensor(prompt_token_ids(example, self.tokenizer), dtype=torch.long)
            trajectories += [self.start(example, first_group + number, prompt, with_support) for _ in range(group_size)]
        return trajectories

    def start(self, example: Example, group: int, prompt: torch.Tensor, with_support: bool) -> Trajectory:
        empty = torch.zeros(0, dtype=torch.long)
        trajectory = Trajectory(
            example=example, group=group, prompt=prompt, tokens=empty, logprobs=torch.zeros(0), versions=empty,
            support_size=torch.zeros(0, dtype=torch.int32) if with_support else None,
            support_logprobs=torch.zeros(0) if with_support else None,
            from_env=torch.zeros(0, dtype=torch.bool) if self.env is not None else None)
        if self.env is not None:
            trajectory.episode = self.env.start(example)
        return trajectory

    # --- one generate call ---------------------------------------------------------------------
    def call_budget(self, active: list[Trajectory], per_call: int | None) -> int:
        """The most tokens any of `active` may take in the next call (each is cut to its own).
        Without an environment, partial rollouts' calls always ask for `per_call`."""
        if self.env is None and per_call is not None:
            return per_call
        return max(min(self.room(t), per_call or self.budget.tokens) for t in active)

    def room(self, trajectory: Trajectory) -> int:
        """Tokens `trajectory` may still sample in its turn under way."""
        left = self.budget.tokens - len(trajectory.tokens)
        if self.budget.turn_tokens is not None:
            left = min(left, self.budget.turn_tokens - (len(trajectory.tokens) - trajectory.turn_start))
        return left

    def inputs(self, active: list[Trajectory], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each trajectory's prompt and tokens so far, left-padded: what the next call continues."""
        return left_padded([torch.cat([t.prompt, t.tokens]).tolist() for t in active], pad_token_id)

    def extend(self, trajectory: Trajectory, batch: RolloutBatch, row: int, version: int) -> None:
        """Append row `row` of a generate call's batch, cut at the room the trajectory has, and
        decide how it goes on (the module docstring)."""
        length = int(batch.response_mask[row].sum())
        room = self.room(trajectory)
        take = min(length, room)
        self._append(trajectory, batch.response_ids[row, :take].cpu(), batch.logprobs[row, :take].float().cpu(),
                     torch.full((take,), version, dtype=torch.long), from_env=False,
                     support=None if trajectory.support_size is None else (
                         batch.support_size[row, :take].cpu(), batch.support_logprobs[row, :take].float().cpu()))
        trajectory.segments += 1
        whole = take == length  # nothing cut at the room
        if whole and bool(batch.repeated[row]):
            if self.env is not None:  # the episode still judges the turn the repetition stop cut
                self.end_turn(trajectory, closed=False, last=True)
            trajectory.ended, trajectory.repeated = True, True
        elif whole and not bool(batch.truncated[row]):
            self.end_turn(trajectory, closed=True)  # an EOS
        elif len(trajectory.tokens) >= self.budget.tokens:
            if self.env is not None:  # the episode still answers (and judges) the turn the budget cut
                self.end_turn(trajectory, closed=False)
            trajectory.ended, trajectory.truncated = True, True
        elif self.room(trajectory) <= 0:
            self.end_turn(trajectory, closed=False)  # the turn's own budget is spent

    def end_turn(self, trajectory: Trajectory, closed: bool, last: bool = False) -> None:
        """A policy turn is over: the episode answers it (with an environment), or the response
        has ended (without one). `last`: the trajectory ends here whatever the episode says (a
        repetition stop): its verdict and reward are kept, its reply is not appended."""
        if self.env is None:
            trajectory.ended = True
            trajectory.truncated = not closed
            return
        ids = trajectory.tokens[trajectory.turn_start:].tolist()
        turn = Turn(text=self.tokenizer.decode(ids, skip_special_tokens=True), token_ids=ids, ended=closed,
                    index=trajectory.turns)
        reply = trajectory.episode.step(turn)
        trajectory.turn_ends.append(len(trajectory.tokens) - 1)
        trajectory.turn_rewards.append(float(reply.reward))
        for name, value in reply.metrics.items():
            trajectory.metrics[name] = trajectory.metrics.get(name, 0.0) + float(value)
        if reply.correct is not None:
            trajectory.correct = bool(reply.correct)
        if last or reply.done or trajectory.turns >= self.env.max_turns:
            trajectory.ended = True
            trajectory.truncated = not closed and not reply.done
            return
        observation = torch.tensor(observation_ids(reply, self.tokenizer), dtype=torch.long)
        if len(trajectory.tokens) + len(observation) >= self.budget.tokens:  # no room for another turn
            trajectory.ended, trajectory.truncated = True, True
            trajectory.metrics["budget_ended"] = trajectory.metrics.get("budget_ended", 0.0) + 1.0
            return
        self._append(trajectory, observation, torch.zeros(len(observation)),
                     torch.zeros(len(observation), dtype=torch.long), from_env=True,
                     support=None if trajectory.support_size is None else (
                         torch.zeros(len(observation), dtype=torch.int32), torch.zeros(len(observation))))
        trajectory.turn_start = len(trajectory.tokens)

    @staticmethod
    def _append(trajectory: Trajectory, tokens, logprobs, versions, *, from_env: bool, support) -> None:
        trajectory.tokens = torch.cat([trajectory.tokens, tokens])
        trajectory.logprobs = torch.cat([trajectory.logprobs, logprobs])
        trajectory.versions = torch.cat([trajectory.versions, versions])
        if support is not None:
            trajectory.support_size = torch.cat([trajectory.support_size, support[0]])
            trajectory.support_logprobs = torch.cat([trajectory.support_logprobs, support[1]])
        if trajectory.from_env is not None:
            trajectory.from_env = torch.cat([trajectory.from_env, torch.full((len(tokens),), from_env)])

    def cut_at(self, trajectory: Trajectory, keep: int) -> None:
        """Keep the first `keep` tokens (the repetition stop across segments)."""
        for name in ("tokens", "logprobs", "versions", "support_size", "support_logprobs", "from_env"):
            if getattr(trajectory, name) is not None:
                setattr(trajectory, name, getattr(trajectory, name)[:keep])

    # --- a resume ------------------------------------------------------------------------------
    def rebuild_episode(self, trajectory: Trajectory) -> None:
        """The episode of a saved trajectory, brought to where it was by replaying its ended
        turns; an environment that answers one differently the second time is an error (its
        state cannot be restored that way)."""
        if self.env is None:
            return
        trajectory.episode = self.env.start(trajectory.example)
        start = 0
        for number, end in enumerate(trajectory.turn_ends):
            ids = trajectory.tokens[start:end + 1].tolist()
            closed = bool(torch.isin(trajectory.tokens[end], self.eos_ids))
            reply = trajectory.episode.step(Turn(self.tokenizer.decode(ids, skip_special_tokens=True), ids,
                                                 ended=closed, index=number))
            after = end + 1
            while after < len(trajectory.tokens) and bool(trajectory.from_env[after]):
                after += 1
            if after > end + 1 and observation_ids(reply, self.tokenizer) != trajectory.tokens[end + 1:after].tolist():
                raise DataError(f"environment {type(self.env).__name__}: replaying turn {number} of a saved episode "
                                f"gave a different reply; an environment must answer the same turns the same way "
                                f"for a run to resume with episodes under way")
            start = after


# --- trajectories as a batch ---------------------------------------------------------------------

@dataclass
class TrajectoryBatch:
    """Ended trajectories as tensors: the rollout batch (its response mask: the policy's
    tokens), and what the environment added ([B, T] each)."""

    rollout: RolloutBatch
    versions: torch.Tensor               # [B, T] long
    segments: torch.Tensor               # [B] long
    env_mask: torch.Tensor | None = None       # [B, T] float, 1 on the environment's tokens
    turn_rewards: torch.Tensor | None = None   # [B, T] each turn's reward at its last token
    turns: torch.Tensor | None = None          # [B] long, policy turns


def as_batch(trajectories: list[Trajectory], width: int, pad_token_id: int, device) -> TrajectoryBatch:
    n = len(trajectories)
    prompt_ids, prompt_mask = left_padded([t.prompt.tolist() for t in trajectories], pad_token_id)
    response_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((n, width), dtype=torch.long)
    logprobs, versions = torch.zeros((n, width)), torch.zeros((n, width), dtype=torch.long)
    support = trajectories[0].support_size is not None
    support_size = torch.zeros((n, width), dtype=torch.int32) if support else None
    support_logprobs = torch.zeros((n, width)) if support else None
    with_env = trajectories[0].from_env is not None
    env_mask = torch.zeros((n, width)) if with_env else None
    turn_rewards = torch.zeros((n, width)) if with_env else None
    for i, t in enumerate(trajectories):
        k = len(t.tokens)
        policy = t.policy_mask()
        response_ids[i, :k], response_mask[i, :k] = t.tokens, policy.long()
        logprobs[i, :k], versions[i, :k] = t.logprobs, t.versions
        if support:
            support_size[i, :k], support_logprobs[i, :k] = t.support_size, t.support_logprobs
        if with_env:
            env_mask[i, :k] = t.from_env.float()
            turn_rewards[i, t.turn_ends] = torch.tensor(t.turn_rewards, dtype=torch.float32)
    batch = RolloutBatch(
        prompt_ids=prompt_ids.to(device), prompt_mask=prompt_mask.to(device), response_ids=response_ids.to(device),
        response_mask=response_mask.to(device), logprobs=logprobs.to(device),
        truncated=torch.tensor([t.truncated for t in trajectories], device=device),
        support_size=support_size.to(device) if support else None,
        support_logprobs=support_logprobs.to(device) if support else None,
        repeated=torch.tensor([t.repeated for t in trajectories], device=device))
    return TrajectoryBatch(
        rollout=batch, versions=versions, segments=torch.tensor([t.segments for t in trajectories]),
        env_mask=env_mask.to(device) if with_env else None,
        turn_rewards=turn_rewards.to(device) if with_env else None,
        turns=torch.tensor([t.turns for t in trajectories], device=device) if with_env else None)


@dataclass
class Outcome:
    """An ended episode as its scorers and logs read it."""

    final: str                 # the policy's last turn, decoded (what a final-answer verifier reads)
    env_return: float          # the environment's rewards, summed over the turns
    correct: bool | None       # the environment's verdict, where it gave one
    transcript: list[dict]     # the whole episode, [{"role": "policy" | "env", "text"}]


def outcome(trajectory: Trajectory, tokenizer) -> Outcome:
    return Outcome(last_turn_text(trajectory, tokenizer), sum(trajectory.turn_rewards), trajectory.correct,
                   transcript(trajectory, tokenizer))


def last_turn_text(trajectory: Trajectory, tokenizer) -> str:
    """The policy's last turn, decoded (what a final-answer verifier reads)."""
    return tokenizer.decode(trajectory.tokens[trajectory.turn_start:].tolist(), skip_special_tokens=True)


def transcript(trajectory: Trajectory, tokenizer) -> list[dict]:
    """The trajectory as alternating parts, [{"role": "policy" | "env", "text": ...}], each
    decoded on its own (special tokens kept: the environment's chat framing shows)."""
    parts, start = [], 0
    flags = trajectory.policy_mask().tolist()
    for i in range(1, len(flags) + 1):
        if i == len(flags) or flags[i] != flags[start]:
            parts.append({"role": "policy" if flags[start] else "env",
                          "text": tokenizer.decode(trajectory.tokens[start:i].tolist())})
            start = i
    return parts


def marked_text(parts: list[dict]) -> str:
    """A transcript as one text, each environment part marked (samples/, the panel)."""
    return "".join(p["text"] if p["role"] == "policy" else f"[env: {p['text']}]" for p in parts)
