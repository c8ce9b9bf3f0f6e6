"""Generation engines for online RL: sample G completions per prompt from a causal LM.

``rollout=fast`` (default) is a batched KV-cache sampler with a fused functional decode
path for Llama/Qwen2/Mistral-family models; ``rollout=hf`` wraps HF ``generate`` and is
the reference.  Both return a ``RolloutBatch`` (see base.py for which distribution the
log-probs refer to) and sample from the same distribution via ``sampling_logits_processor``.
``rollout=vllm`` (vllm.py) generates with vLLM on the training GPU; it needs CUDA and the
optional vllm package, so it is registered apart from the engines that run anywhere.
``rollout=vllm_server`` (vllm_server.py) samples through a vLLM server in its own process and
interpreter (``rollout.server_python``, a venv with vLLM), on the CPU or a GPU; the trainer's
process never imports vLLM.
"""

from __future__ import annotations

from .base import RolloutBatch, RolloutEngine, SamplingParams, sampling_logits_processor
from .fast import FastSampler
from .hf import HFSampler
from .vllm import VLLMEngine
from .vllm_server import VLLMServerEngine

# Engines that run on any machine (the CPU tests run each of them).
ROLLOUT_ENGINES = {"fast": FastSampler, "hf": HFSampler}
# Engines that need a GPU and an optional package.
GPU_ROLLOUT_ENGINES = {"vllm": VLLMEngine}
# Engines served by another process: they need that process's interpreter (a venv with vLLM).
SERVED_ROLLOUT_ENGINES = {"vllm_server": VLLMServerEngine}
ALL_ROLLOUT_ENGINES = {**ROLLOUT_ENGINES, **GPU_ROLLOUT_ENGINES, **SERVED_ROLLOUT_ENGINES}  # the `rollout` choices


def build_rollout(name: str, **kwargs) -> RolloutEngine:
    """The engine registered under ``name`` (the ``rollout`` config choice)."""
    if name not in ALL_ROLLOUT_ENGINES:
        raise ValueError(f"rollout={name!r} is not a known engine; choose one of {sorted(ALL_ROLLOUT_ENGINES)}")
    return ALL_ROLLOUT_ENGINES[name](**kwargs)


def engine_options(rollout_cfg) -> dict:
    """The settings of the ``rollout`` config node that the chosen engine's constructor takes
    (its ``config_keys``: the fast engine's ``cuda_graphs``, vLLM's engine settings; hf takes none)."""
    engine = ALL_ROLLOUT_ENGINES.get(rollout_cfg.engine)
    return {key: rollout_cfg[key] for key in getattr(engine, "config_keys", ()) if key in rollout_cfg}


__all__ = [
    "ALL_ROLLOUT_ENGINES",
    "GPU_ROLLOUT_ENGINES",
    "ROLLOUT_ENGINES",
    "SERVED_ROLLOUT_ENGINES",
    "FastSampler",
    "HFSampler",
    "RolloutBatch",
    "RolloutEngine",
    "SamplingParams",
    "VLLMEngine",
    "VLLMServerEngine",
    "build_rollout",
    "engine_options",
    "sampling_logits_processor",
]
