"""Generation engines for online RL: sample G completions per prompt from a causal LM.

``rollout=fast`` (default) is a batched KV-cache sampler with a fused functional decode
path for Llama/Qwen2/Mistral-family models; ``rollout=hf`` wraps HF ``generate`` and is
the reference.  Both return a ``RolloutBatch`` (see base.py for which distribution the
log-probs refer to) and sample from the same distribution via ``sampling_logits_processor``.
"""

from __future__ import annotations

from .base import RolloutBatch, RolloutEngine, SamplingParams, sampling_logits_processor
from .fast import FastSampler
from .hf import HFSampler

ROLLOUT_ENGINES = {"fast": FastSampler, "hf": HFSampler}


def build_rollout(name: str, **kwargs) -> RolloutEngine:
    """The engine registered under ``name`` (the ``rollout`` config choice)."""
    if name not in ROLLOUT_ENGINES:
        raise ValueError(f"rollout={name!r} is not a known engine; choose one of {sorted(ROLLOUT_ENGINES)}")
    return ROLLOUT_ENGINES[name](**kwargs)


__all__ = [
    "ROLLOUT_ENGINES",
    "FastSampler",
    "HFSampler",
    "RolloutBatch",
    "RolloutEngine",
    "SamplingParams",
    "build_rollout",
    "sampling_logits_processor",
]
