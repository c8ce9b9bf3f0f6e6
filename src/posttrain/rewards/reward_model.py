"""Learned rewards: a Bradley–Terry reward model (or an ensemble of them) scoring online-RL samples.

    reward=reward_model reward.path=<dir>                 # one model
    reward=reward_model reward.paths=[<dir1>,<dir2>]      # an ensemble: mean - std_coef * std

A reward model directory is a Hugging Face `AutoModelForSequenceClassification` export with
one label and a pad token (what `algorithm=reward_model` writes). It is loaded once, frozen,
in eval mode, on the policy's device, and scores `prompt + response (+ EOS)` laid out the way
SFT and preference training saw them (data/datamodule.py): the prompt rendered with the chat
template when the task is chat-form, the response's tokens, and EOS when the response ended
(a truncated, looping or PRM-stopped one never did, so it gets none). A row longer than the reward model's context
(max_position_embeddings) keeps its last tokens: the prompt's start is dropped, the response's
end, where the score is read, is kept; the share of rows cut is `rewards/reward_model/truncated_frac`
(logged at the steps where any was).

An ensemble (Coste et al. 2023, "Reward Model Ensembles Help Mitigate Overoptimization")
scores each sample by every model and returns mean - k * std over the models, k =
`std_coef`: the policy gains less where the models disagree. The spread is logged as
`rewards/reward_model/std`, each model's mean as `rewards/reward_model/model<i>/mean`.

A reward model with several heads (algorithm=reward_model algorithm.heads=[correct,concise]; its
config.json names them in `reward_heads`) scores each sample by every head; the reward is the
weighted sum sum_h w_h * r_h, w = `head_weights` ({correct: 1.0, concise: 0.3}; a head it does
not name weighs 0; null: every head weighs 1, so one head's score is the reward as before). Each
head's mean is logged as `rewards/reward_model/<head>/mean`. A weight naming a head the model does
not have is refused at start-up, naming the model's heads.

Over-optimisation: a scorer marked `learned` also scores the greedy held-out responses at each
evaluation (`eval/proxy_reward`, beside `eval/accuracy`; algorithms/base.py), so the point
where the proxy keeps rising while the verifiable accuracy stalls or falls is visible.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

import torch
from transformers import AutoModelForSequenceClassification

from posttrain.core import ensemble_lower_bound, weighted_head_sum
from posttrain.data.datamodule import prompt_text, prompt_token_ids, right_padded
from posttrain.data.preference import DEFAULT_HEADS
from posttrain.errors import ConfigError
from posttrain.models import loading
from posttrain.models.loading import TOKENIZER_FILES, check_vocabulary_fits, declared_context, first_line_of
from posttrain.rewards.base import ScoredSample

KEY = "reward.components.reward_model"


def learned_scorers(reward_fn) -> list:
    """The components of a composite reward that a learned model scores (`learned = True`)."""
    return [fn for fn, _ in getattr(reward_fn, "components", []) if getattr(fn, "learned", False)]


class RewardModelScorer:
    """`reward.components.reward_model`: the score of one reward model, or an ensemble's
    mean - std_coef * std; of a model with several heads, the `head_weights`-weighted sum of its
    heads' scores. `policy` and `tokenizer` are the run's, supplied by `build_reward` (the
    policy's device is where the models run; its tokenizer, with `share_tokenizer`)."""

    name = "reward_model"
    learned = True  # held-out evaluation logs its score as eval/proxy_reward

    def __init__(self, path: str | None = None, paths: list[str] | None = None, std_coef: float = 1.0,
                 batch_size: int = 16, share_tokenizer: bool = False, head_weights: dict | None = None, *,
                 policy=None, tokenizer=None):
        if (path is None) == (not paths):
            raise ConfigError(f"{KEY} needs exactly one of path (one reward model; reward.path) or paths (an "
                              f"ensemble; reward.paths), got path={path!r}, paths={paths!r}")
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ConfigError(f"{KEY}.batch_size={batch_size!r} must be a positive integer")
        if isinstance(std_coef, bool) or not isinstance(std_coef, (int, float)) or not std_coef >= 0:
            raise ConfigError(f"{KEY}.std_coef={std_coef!r} must be a number >= 0")
        keyed = [(f"{KEY}.path", path)] if path is not None else [(f"{KEY}.paths[{i}]", p) for i, p in enumerate(paths)]
        self.heads = same_heads([(f"{key}={directory!r}", check_reward_model_dir(directory, key))
                                 for key, directory in keyed])
        self.head_weights = head_weight_vector(head_weights, self.heads)
        self.keyed_paths = keyed
        self.std_coef, self.batch_size = float(std_coef), batch_size
        self.share_tokenizer = share_tokenizer
        self.policy = policy
        self.policy_tokenizer = tokenizer
        if share_tokenizer and tokenizer is not None:
            for key, directory in keyed:
                check_same_vocabulary(directory, key, tokenizer)
        self._models: list | None = None      # loaded on the first call: a config check builds none
        self._tokenizers: list | None = None
        self._metrics: dict[str, float] = {}

    # --- loading -------------------------------------------------------------------------------
    def device_and_dtype(self) -> tuple[torch.device, torch.dtype]:
        if self.policy is None:
            return torch.device("cpu"), torch.float32
        weight = next(self.policy.parameters())
        return weight.device, weight.dtype

    def models(self) -> list:
        """The frozen models, loaded once and kept on the policy's (current) device."""
        device, dtype = self.device_and_dtype()
        if self._models is None:
            self._models = [load_reward_model(directory, key, dtype) for key, directory in self.keyed_paths]
            if self.share_tokenizer and self.policy_tokenizer is None:
                raise ConfigError(f"{KEY}.share_tokenizer=true, but no policy tokenizer was given to share")
            self._tokenizers = [self.policy_tokenizer if self.share_tokenizer else load_tokenizer(directory, key)
                                for key, directory in self.keyed_paths]
            for model, tokenizer, (key, directory) in zip(self._models, self._tokenizers, self.keyed_paths):
                check_vocabulary_fits(tokenizer, model, f"{key}={directory!r}")
        if self._models[0].device != device:  # Lightning moved the policy (to the GPU) after the build
            self._models = [model.to(device) for model in self._models]
        return self._models

    # --- scoring -------------------------------------------------------------------------------
    def __call__(self, samples: Sequence[ScoredSample], source) -> torch.Tensor:
        models = self.models()
        self._metrics = {}  # this call's: score_with adds the truncated share
        per_head = torch.stack([self.score_with(model, tokenizer, samples)
                                for model, tokenizer in zip(models, self._tokenizers)])  # [models, B, heads]
        per_model = weighted_head_sum(per_head, self.head_weights)
        scores, spread = ensemble_lower_bound(per_model, self.std_coef)
        if len(self.heads) > 1 and per_head.numel():  # each objective's mean (over the ensemble's models too)
            self._metrics.update({f"rewards/{self.name}/{head}/mean": float(per_head[..., h].mean())
                                  for h, head in enumerate(self.heads)})
        if len(models) > 1:  # one model's mean is rewards/reward_model/mean already
            self._metrics.update({f"rewards/{self.name}/model{i}/mean": float(row.mean())
                                  for i, row in enumerate(per_model)})
            self._metrics[f"rewards/{self.name}/std"] = float(spread.mean())
        return scores

    def take_metrics(self) -> dict[str, float]:
        """The per-model means (and the ensemble's spread) of the last call, and the share of its rows
        cut to a model's context where any was, for the composite to log."""
        metrics, self._metrics = self._metrics, {}
        return metrics

    @torch.no_grad()
    def score_with(self, model, tokenizer, samples: Sequence[ScoredSample]) -> torch.Tensor:
        """[B, heads] float32 scores of one model, `batch_size` rows per forward. A row longer than the
        model's context keeps its last tokens (the score is read at the last one, the response's
        end); the share of rows cut is logged as rewards/reward_model/truncated_frac."""
        rows = [self.token_row(tokenizer, sample) for sample in samples]
        context = declared_context(model.config)
        if context is not None and rows:
            cut = sum(len(row) > context for row in rows)
            if cut:
                key = f"rewards/{self.name}/truncated_frac"  # of an ensemble: the most any model cut
                self._metrics[key] = max(self._metrics.get(key, 0.0), cut / len(rows))
                rows = [row[-context:] for row in rows]
        pad_id = model.config.pad_token_id
        scores = []
        for start in range(0, len(rows), self.batch_size):
            # right-padded: the sequence classifier reads its score at each row's last non-pad token
            input_ids, attention_mask, _ = right_padded(rows[start:start + self.batch_size], None, pad_id)
            input_ids, attention_mask = input_ids.to(model.device), attention_mask.to(model.device)
            scores.append(model(input_ids=input_ids, attention_mask=attention_mask).logits.float().cpu())
        return torch.cat(scores) if scores else torch.zeros(0, len(self.heads))

    def token_row(self, tokenizer, sample: ScoredSample) -> list[int]:
        """prompt + response (+ EOS when the response ended with one: not when it was cut by the
        budget, stopped as looping or cut by the PRM early stop), as SFT's collate_sft lays it
        out. The policy's own prompt ids (truncated to fit, if they were) only with its tokenizer."""
        example = sample.example
        if self.share_tokenizer:
            prompt = prompt_token_ids(example, tokenizer)
        else:
            prompt = tokenizer(prompt_text(example, tokenizer), add_special_tokens=False)["input_ids"]
        response = tokenizer(sample.response, add_special_tokens=False)["input_ids"]
        return prompt + response + ([tokenizer.eos_token_id] if sample.ended else [])


# --- checks and loading of a reward model directory -------------------------------------------------

def check_reward_model_dir(directory, key: str) -> list[str]:
    """Refuse, from config.json alone, what is not a sequence classifier with a pad token and one
    label, or a label per head it names (`reward_heads`); return the heads' names (a model that
    names none has one head, `reward`)."""
    config = model_config(directory, key, "ForSequenceClassification", "a reward model", "algorithm=reward_model")
    heads = config.get("reward_heads") or list(DEFAULT_HEADS)
    labels = label_count(config)
    if labels != len(heads):
        named = f"names the heads {heads}" if config.get("reward_heads") else "names no reward heads (reward_heads)"
        raise ConfigError(f"{key}={directory!r} is not a reward model: its config.json {named} but has "
                          f"num_labels={labels}; expected an AutoModelForSequenceClassification with a label per head "
                          f"(one, without reward_heads), as algorithm=reward_model exports")
    if config.get("pad_token_id") is None:
        raise ConfigError(f"{key}={directory!r}: config.json sets no pad_token_id, so the model cannot find the "
                          f"last token of a padded row; set it to the tokenizer's pad id")
    return list(heads)


def same_heads(keyed_heads: list[tuple[str, list[str]]]) -> list[str]:
    """The heads every model of an ensemble has (their weighted sums are compared), each model named
    by its key and directory; else a ConfigError."""
    (first, heads), *others = keyed_heads
    for model, other in others:
        if other != heads:
            raise ConfigError(f"{model} has the heads {other}, {first} has {heads}: an ensemble's reward models "
                              f"must have the same heads")
    return heads


def head_weight_vector(head_weights, heads: list[str]) -> list[float]:
    """`head_weights` ({head: weight}) as one weight per head, in the model's order: a head not
    named weighs 0; null: every head weighs 1. A name the model lacks is a ConfigError."""
    if head_weights is None:
        return [1.0] * len(heads)
    key = f"{KEY}.head_weights"
    if not hasattr(head_weights, "items"):
        raise ConfigError(f"{key}={head_weights!r} must be a mapping head -> weight, e.g. {{{heads[0]}: 1.0}}, or null")
    unknown = [name for name in head_weights if name not in heads]
    if unknown:
        raise ConfigError(f"{key} names {unknown}, not heads of the reward model, whose heads are {heads}")
    for name, weight in head_weights.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ConfigError(f"{key}.{name}={weight!r} must be a finite number")
    return [float(head_weights.get(name, 0.0)) for name in heads]


def label_count(config: dict) -> int:
    # a config without id2label has transformers' default of two labels
    return config.get("num_labels", len(config.get("id2label") or {}) or 2)


def one_label_model_config(directory, key: str, head: str, what: str, exported_by: str) -> dict:
    """config.json of `directory` (the value of config key `key`), refused unless it is a Hugging
    Face model whose architecture ends in `head` (e.g. ForSequenceClassification) with one label:
    `what` (a reward model, a PRM) as the hf_model/ of an `exported_by` run writes it."""
    config = model_config(directory, key, head, what, exported_by)
    if label_count(config) != 1:
        raise ConfigError(f"{key}={directory!r} is not {what}: expected an AutoModel{head} model with one label "
                          f"(num_labels=1), found num_labels={label_count(config)}")
    return config


def model_config(directory, key: str, head: str, what: str, exported_by: str) -> dict:
    """config.json of `directory` (the value of config key `key`), refused unless it is a Hugging
    Face model whose architecture ends in `head` (e.g. ForSequenceClassification): `what` (a reward
    model, a PRM) as the hf_model/ of an `exported_by` run writes it."""
    if not isinstance(directory, str) or not directory:
        raise ConfigError(f"{key}={directory!r} must be {what} directory (a path)")
    config_file = Path(directory).expanduser() / "config.json"
    if not Path(directory).expanduser().is_dir():
        raise ConfigError(f"{key}={directory!r}: no such directory ({what} exported by {exported_by}: its run "
                          f"dir's hf_model)")
    if not config_file.is_file():
        raise ConfigError(f"{key}={directory!r} holds no config.json: not a Hugging Face model directory")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{key}={directory!r}: {config_file} is not readable JSON: {err}") from None
    architectures = config.get("architectures") or []
    if not any(a.endswith(head) for a in architectures):
        raise ConfigError(f"{key}={directory!r} is not {what}: expected an AutoModel{head} model, found "
                          f"architectures={architectures}, num_labels={label_count(config)}")
    return config


def has_tokenizer(directory: str) -> bool:
    return any((Path(directory).expanduser() / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(directory: str, key: str):
    if not has_tokenizer(directory):
        raise ConfigError(f"{key}={directory!r} holds no tokenizer (looked for {', '.join(TOKENIZER_FILES)}); save "
                          f"it there, or set {KEY}.share_tokenizer=true to use the policy's")
    return loading.load_tokenizer(str(Path(directory).expanduser()))


def check_same_vocabulary(directory: str, key: str, policy_tokenizer) -> None:
    """With share_tokenizer the rows are the policy's tokens: the reward model must have learned
    the same ids (its own tokenizer, where it has one, has the policy's vocabulary)."""
    if not has_tokenizer(directory):
        return
    own = load_tokenizer(directory, key).get_vocab()
    theirs = policy_tokenizer.get_vocab()
    if own != theirs:
        differing = sorted(set(own.items()) ^ set(theirs.items()))[:3]
        raise ConfigError(f"{key}={directory!r}: {KEY}.share_tokenizer=true, but the reward model's tokenizer "
                          f"({len(own)} tokens) differs from the policy's ({len(theirs)} tokens), e.g. {differing}; "
                          f"set share_tokenizer=false to tokenise with the reward model's own tokenizer")


def load_reward_model(directory: str, key: str, dtype: torch.dtype):
    """The frozen sequence classifier of `directory`, in eval mode, without gradients."""
    try:
        model = AutoModelForSequenceClassification.from_pretrained(str(Path(directory).expanduser()), dtype=dtype)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{key}={directory!r} could not be loaded as a sequence-classification model: "
                          f"{first_line_of(err)}") from None
    return model.requires_grad_(False).eval()
