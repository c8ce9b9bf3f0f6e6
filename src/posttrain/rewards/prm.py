"""Process reward models: a score PRM(x, y<=k) for every step k of a response (data/steps.py
says where steps end), and `reward.components.prm`, which turns those scores into step rewards.

    posttrain reward=prm prm=oracle advantage=prm_step            # the task's step verifier
    posttrain reward=prm prm=learned prm.path=<algorithm=prm run>/hf_model

Two PRMs behind one interface, `ProcessRewardModel.step_scores(samples, source)`:

* `oracle`: the task's own step verifier (`source.step_labels`), for clean ablations. With
  `oracle_score: prefix` (default) step k scores 1 while every step up to k is right, 0 from
  the first wrong one on: the probability-of-still-being-right a PRM estimates. `step` scores
  each step on its own.
* `learned`: a token classifier (`<Arch>ForTokenClassification`, one label) trained by
  `algorithm=prm`; the score of step k is sigmoid(logit) at the step's last token of the row
  `prm_row` lays out (the same layout its training used).

The component turns the scores into step rewards by `step_reward` (`core.process_step_rewards`:
marginal s_k - s_{k-1}, raw s_k, or PURE's min-form), and scores each sample by their sum (a
sequence-level advantage sees the sample's return from its first step). The step rewards
themselves reach `advantage=prm_step` through the composite's `RewardOutput.step_rewards`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from transformers import AutoModelForTokenClassification

from posttrain import core
from posttrain.data.datamodule import right_padded
from posttrain.data.process import prm_row
from posttrain.data.steps import source_step_rule, split_text
from posttrain.errors import ConfigError
from posttrain.models.loading import first_line_of, load_tokenizer
from posttrain.rewards.base import ScoredSample
from posttrain.rewards.reward_model import one_label_model_config

KEY = "reward.components.prm"
PRM_KINDS = ("oracle", "learned")
ORACLE_SCORES = ("prefix", "step")


@torch.no_grad()
def score_rows(model, rows: list[list[int]], ends: list[list[int]], pad_id: int, batch_size: int) -> list[list[float]]:
    """sigmoid(logit) of a token-classification PRM at each row's step ends, `batch_size` rows a forward."""
    scores = []
    for start in range(0, len(rows), batch_size):
        input_ids, attention_mask, _ = right_padded(rows[start:start + batch_size], None, pad_id)
        logits = model(input_ids=input_ids.to(model.device), attention_mask=attention_mask.to(model.device)).logits
        probs = torch.sigmoid(logits[..., 0].float()).cpu()
        scores += [probs[i, row_ends].tolist() for i, row_ends in enumerate(ends[start:start + batch_size])]
    return scores


class ProcessRewardModel:
    """PRM(x, y<=k) for each step of each sample: the oracle or a learned model (module doc)."""

    def __init__(self, model: str = "oracle", path: str | None = None, oracle_score: str = "prefix",
                 batch_size: int = 64, *, policy=None, key: str = "prm"):
        if model not in PRM_KINDS:
            raise ConfigError(f"{key}.model={model!r} is not one of {list(PRM_KINDS)}")
        if oracle_score not in ORACLE_SCORES:
            raise ConfigError(f"{key}.oracle_score={oracle_score!r} is not one of {list(ORACLE_SCORES)}")
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ConfigError(f"{key}.batch_size={batch_size!r} must be a positive integer")
        if model == "learned":
            check_prm_dir(path, f"{key}.path")
        elif path is not None:
            raise ConfigError(f"{key}.path={path!r} is set, but {key}.model=oracle reads no model: set "
                              f"prm=learned to score with it")
        self.kind, self.path, self.oracle_score, self.batch_size = model, path, oracle_score, batch_size
        self.policy = policy
        self._model = self._tokenizer = None  # loaded on the first call: a config check loads nothing

    def step_scores(self, samples: Sequence[ScoredSample], source) -> list[list[float]]:
        """One score per step (`sample.steps`) of each sample. A sample known only as text (a
        held-out response) is split by the task's rule first (`split_text`)."""
        for sample in samples:
            if sample.steps is None:
                sample.steps = split_text(source_step_rule(source), sample.response)
        if self.kind == "oracle":
            return [self.oracle(sample, source) for sample in samples]
        model, tokenizer = self.learned()
        laid_out = [prm_row(tokenizer, s, s.steps, ended=s.ended) for s in samples]
        return score_rows(model, [row for row, _ in laid_out], [ends for _, ends in laid_out],
                          tokenizer.pad_token_id, self.batch_size)

    def oracle(self, sample: ScoredSample, source) -> list[float]:
        labels = source.step_labels(sample.example, sample.steps)
        if self.oracle_score == "step":
            return [float(ok) for ok in labels]
        scores, on_track = [], True
        for ok in labels:
            on_track = on_track and ok
            scores.append(float(on_track))
        return scores

    def learned(self):
        """The frozen PRM and its tokenizer, on the policy's (current) device."""
        if self._model is None:
            self._model, self._tokenizer = load_prm(self.path, "prm.path")
        if self.policy is not None:
            device = next(self.policy.parameters()).device
            if self._model.device != device:
                self._model = self._model.to(device)
        return self._model, self._tokenizer


class ProcessReward:
    """`reward.components.prm`: step rewards from a PRM in the form `step_reward`; the sample's
    score is their sum. `model`, `path`, `oracle_score` and `batch_size` come from the `prm`
    config group (prm=oracle | learned)."""

    name = "prm"

    def __init__(self, model: str = "oracle", path: str | None = None, step_reward: str = "marginal",
                 oracle_score: str = "prefix", batch_size: int = 64, *, policy=None):
        if step_reward not in core.STEP_REWARD_FORMS:
            raise ConfigError(f"{KEY}.step_reward={step_reward!r} is not one of {sorted(core.STEP_REWARD_FORMS)}")
        self.prm = ProcessRewardModel(model, path, oracle_score, batch_size, policy=policy, key="prm")
        self.step_reward = step_reward
        self._step_rewards: dict[int, list[float]] = {}
        self._metrics: dict[str, float] = {}

    def __call__(self, samples: Sequence[ScoredSample], source) -> torch.Tensor:
        scores = self.prm.step_scores(samples, source)
        padded, valid = pad_steps(scores)
        rewards = core.process_step_rewards(padded, valid, self.step_reward)
        for sample, row, count in zip(samples, rewards.tolist(), valid.sum(dim=1).tolist()):
            self._step_rewards[id(sample)] = row[:count]
        self._metrics = {f"rewards/{self.name}/step_score_mean": float(padded[valid].mean()) if valid.any() else 0.0,
                         f"rewards/{self.name}/steps_mean": float(valid.sum(dim=1).float().mean())}
        return rewards.sum(dim=1)

    def take_step_rewards(self, samples: Sequence[ScoredSample]) -> list[list[float] | None]:
        """The step rewards of the last calls for these samples (None for one it did not score), then forget them."""
        taken = [self._step_rewards.get(id(sample)) for sample in samples]
        self._step_rewards = {}
        return taken

    def take_metrics(self) -> dict[str, float]:
        metrics, self._metrics = self._metrics, {}
        return metrics


def pad_steps(scores: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged per-step scores as ([B, K] float32, [B, K] bool valid), steps left-aligned."""
    width = max((len(row) for row in scores), default=0)
    padded = torch.zeros(len(scores), max(width, 1))
    valid = torch.zeros(len(scores), max(width, 1), dtype=torch.bool)
    for i, row in enumerate(scores):
        padded[i, :len(row)] = torch.tensor(row, dtype=torch.float32)
        valid[i, :len(row)] = True
    return padded, valid


# --- a learned PRM's directory --------------------------------------------------------------

def check_prm_dir(directory, key: str) -> None:
    """Refuse, from config.json alone, what is not a one-label token classifier."""
    one_label_model_config(directory, key, "ForTokenClassification", "a PRM", "algorithm=prm")


def load_prm(directory: str, key: str):
    """(the frozen token-classification PRM in eval mode, its tokenizer)."""
    check_prm_dir(directory, key)
    path = str(Path(directory).expanduser())
    try:
        model = AutoModelForTokenClassification.from_pretrained(path)
        tokenizer = load_tokenizer(path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{key}={directory!r} could not be loaded as a PRM: {first_line_of(err)}") from None
    return model.requires_grad_(False).eval(), tokenizer
