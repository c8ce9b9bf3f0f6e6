"""The typed batch every online-RL stage reads and extends.

`collect` fills the rollout fields; `annotate` adds what the configured scorers compute
(old, reference log-probs, critic values); `advantages` adds token rewards, advantages and
returns. A field no stage needs stays None: nothing is computed that nobody reads.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch


@dataclass
class Experience:
    """A scored rollout batch: B = prompts x group_size rows, T response columns."""

    prompt_ids: torch.Tensor        # [B, P] left-padded
    prompt_mask: torch.Tensor       # [B, P]
    response_ids: torch.Tensor      # [B, T]
    response_mask: torch.Tensor     # [B, T] float, 1 = generated token (incl. EOS)
    rollout_logprobs: torch.Tensor  # [B, T] from the sampler (full vocabulary)
    truncated: torch.Tensor         # [B] bool
    scores: torch.Tensor            # [B] total reward
    correct: torch.Tensor           # [B] float, verifier accuracy (nan when no accuracy reward)
    group_index: torch.Tensor       # [B] prompt id
    support_size: torch.Tensor | None = None       # [B, T] kept top-k/top-p support per token
    support_logprobs: torch.Tensor | None = None   # [B, T] sampler log-probs renormalised on it
    repeated: torch.Tensor | None = None           # [B] bool, stopped early for looping (rollout.repetition)
    prm_stopped: torch.Tensor | None = None        # [B] bool, cut at a low PRM score (rollout.prm_stop_below)
    step_rewards: torch.Tensor | None = None       # [B, T] process reward of each step at its last token (reward=prm)
    step_mask: torch.Tensor | None = None          # [B, T] bool, True at each step's last token
    policy_version: torch.Tensor | None = None     # [B, T] long, the policy version that sampled each token
    segments: torch.Tensor | None = None           # [B] long, generate calls per response (partial rollouts)
    # [B] the score of reward.constraint's cost component (out of `scores`): the trainer adds it,
    # times its own lambda, since the reward stage may run in a producer process that holds no lambda
    cost: torch.Tensor | None = None
    # [B] long, each row's source: its index in the task source's `source_names` (data=mixture),
    # for the metrics per source (rollouts.py); None with one undivided source
    source_index: torch.Tensor | None = None
    # --- with an environment (envs/): a trajectory of several turns ---
    env_mask: torch.Tensor | None = None       # [B, T] float, 1 = the environment's token: read, never trained on
    turn_rewards: torch.Tensor | None = None   # [B, T] each turn's weighted reward at the turn's last token
    turns: torch.Tensor | None = None          # [B] long, policy turns
    # --- annotate: one field per scorer ---
    old_logp: torch.Tensor | None = None   # [B, T] pi_old (None on-policy: the training forward's own)
    ref_logp: torch.Tensor | None = None   # [B, T] frozen reference
    values: torch.Tensor | None = None     # [B, T] critic V(s_t) at sampling time
    teacher_logp: torch.Tensor | None = None  # [B, T] frozen teacher (distillation)
    # --- advantages ---
    token_rewards: torch.Tensor | None = None  # [B, T] score at the last token (+ KL shaping)
    advantages: torch.Tensor | None = None     # [B, T]
    returns: torch.Tensor | None = None        # [B, T] critic targets

    def sequence_mask(self) -> torch.Tensor:
        """[B, T] the response tokens a forward reads: the policy's and the environment's.
        `response_mask` (the policy's alone) is what every loss, KL and entropy counts."""
        return self.response_mask if self.env_mask is None else self.response_mask + self.env_mask

    def model_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(prompt_ids, prompt_mask, response_ids, sequence_mask): what a model's forward takes."""
        return self.prompt_ids, self.prompt_mask, self.response_ids, self.sequence_mask()

    def policy_tokens_only(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """`x` [B, T] with the environment's positions set to 0 (a forward scores them too)."""
        if x is None or self.env_mask is None:
            return x
        return torch.where(self.response_mask.bool(), x, torch.zeros_like(x))

    def without_trailing_padding(self) -> "Experience":
        """Drop the response columns that are padding in every row. Attention is causal, so
        they never touch a real token: removing them changes no log-prob, only the cost."""
        width = max(1, int(response_extent(self.sequence_mask()).max()))
        return replace(self, **{f.name: getattr(self, f.name)[:, :width] for f in fields(self)
                                if f.name in PER_TOKEN and getattr(self, f.name) is not None})

    def without_padding(self) -> "Experience":
        """Drop the columns that are padding in every row: the response's trailing ones and the
        prompt's leading ones (prompts are left-padded). Positions count real tokens only
        (models.functional.real_token_positions), so no real token moves: the log-probs are
        unchanged, the cost is that of the widest prompt + the widest response of these rows."""
        prompt_width = max(1, int(prompt_extent(self.prompt_mask).max()))
        first = max(0, self.prompt_mask.shape[1] - prompt_width)  # a batch without prompt columns keeps none
        return replace(self.without_trailing_padding(), **{name: getattr(self, name)[:, first:] for name in PER_PROMPT})

    def row_widths(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([B] prompt, [B] response) columns each row needs: from its first real prompt token,
        up to its last response token. A batch of these rows trimmed by `without_padding` is
        (its widest prompt + its widest response) columns wide."""
        return prompt_extent(self.prompt_mask), response_extent(self.sequence_mask())

    def to(self, device) -> "Experience":
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})

    def select(self, rows: torch.Tensor) -> "Experience":
        return Experience(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[rows]
                             for f in fields(self)})

    def __len__(self) -> int:
        return len(self.scores)

    @staticmethod
    def concat(parts: list["Experience"], pad_token_id: int) -> "Experience":
        """Stack rounds; prompts of different widths are left-padded to the widest."""
        width = max(p.prompt_ids.shape[1] for p in parts)

        def left_pad(x: torch.Tensor, value: int) -> torch.Tensor:
            return torch.nn.functional.pad(x, (width - x.shape[1], 0), value=value)

        merged = {}
        for f in fields(Experience):
            values = [getattr(p, f.name) for p in parts]
            if values[0] is None:
                merged[f.name] = None
            elif f.name == "prompt_ids":
                merged[f.name] = torch.cat([left_pad(v, pad_token_id) for v in values])
            elif f.name == "prompt_mask":
                merged[f.name] = torch.cat([left_pad(v, 0) for v in values])
            else:
                merged[f.name] = torch.cat(values)
        return Experience(**merged)


PER_PROMPT = ("prompt_ids", "prompt_mask")  # the [B, P] fields: left-padded
PER_TOKEN = ("response_ids", "response_mask", "rollout_logprobs", "support_size", "support_logprobs", "step_rewards",
             "step_mask", "env_mask", "turn_rewards", "policy_version", "old_logp", "ref_logp", "values", "teacher_logp", "token_rewards", "advantages", "returns")


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """[B] the index of each row's last token in `mask` [B, T] (0 for an empty row). Not the
    mask's sum - 1: a multi-turn response has the environment's tokens between the policy's."""
    return response_extent(mask).sub(1).clamp(min=0)


def response_extent(mask: torch.Tensor) -> torch.Tensor:
    """[B] columns of `mask` [B, T] up to and including each row's last token (0 for an empty row)."""
    if mask.shape[1] == 0:  # no column at all (prompts of width 0): amax would have nothing to reduce
        return torch.zeros(mask.shape[0], dtype=torch.long, device=mask.device)
    columns_so_far = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return ((mask > 0).long() * columns_so_far).amax(dim=1)


def prompt_extent(mask: torch.Tensor) -> torch.Tensor:
    """[B] columns of a left-padded `mask` [B, P] from each row's first token to the end (0 for
    an empty row): `response_extent` read from the right."""
    return response_extent(mask.flip(dims=[1]))
