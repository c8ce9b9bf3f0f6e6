"""`rollout=hf`: the reference engine, a thin wrapper around Hugging Face ``generate``.

HF's own sampling warpers are all switched off and our ``sampling_logits_processor`` is
passed in as the only logits processor, so both engines sample from exactly the same
distribution.  Log-probs and the kept support are computed afterwards from the RAW
logits HF returns (``output_logits=True``), with the same shared code as ``fast``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch
from torch import nn
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from .base import (
    RolloutBatch,
    SamplingParams,
    check_prompts,
    eos_tensor,
    eval_mode,
    finalize_rollout,
    fork_rng_from,
    sampling_logits_processor,
    support_of,
)
from .repetition import first_repetition


class _SharedProcessor(LogitsProcessor):
    def __init__(self, params: SamplingParams):
        self.params = params

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return sampling_logits_processor(scores, self.params)[0]


@contextlib.contextmanager
def _neutral_generation_config(model: nn.Module) -> Iterator[None]:
    """``generate`` fills every setting we leave unset from ``model.generation_config``
    (a hub model may ship temperature=0.7, top_k=20, repetition_penalty=1.05...); swap in
    the library defaults for the call so nothing but our processor shapes the logits."""
    saved = getattr(model, "generation_config", None)
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


class HFSampler:
    @torch.inference_mode()
    def generate(
        self,
        model: nn.Module,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: SamplingParams,
        eos_token_id: int | Sequence[int],
        pad_token_id: int,
        generator: Optional[torch.Generator] = None,
    ) -> RolloutBatch:
        params.validate()
        if params.weights_dtype is not None:
            raise ValueError("rollout=hf samples with the policy's own weights: rollout.dtype must be auto "
                             "(rollout=fast samples in another precision)")
        check_prompts(prompt_ids, prompt_mask)
        eos = eos_tensor(eos_token_id, prompt_ids.device)
        sampling = {}
        if not params.greedy:
            # HF warpers off (top_k=0 disables the library default of 50): ours does it all
            sampling = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
        config = GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            do_sample=not params.greedy,
            eos_token_id=eos.tolist(),
            pad_token_id=pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
            use_cache=True,
            **sampling,
        )
        processors = LogitsProcessorList([_SharedProcessor(params)])
        with eval_mode(model), _neutral_generation_config(model), fork_rng_from(generator, prompt_ids.device):
            out = model.generate(
                input_ids=prompt_ids,
                attention_mask=prompt_mask,
                generation_config=config,
                logits_processor=processors,
            )
        raw_tokens = out.sequences[:, prompt_ids.shape[1] :]
        raw_logits = torch.stack(out.logits, dim=1).float()  # [B, T', V], before any processor
        full = raw_logits / params.logprob_temperature
        raw_logprobs = full.log_softmax(dim=-1).gather(2, raw_tokens[..., None]).squeeze(2)
        support = {}
        if params.return_support:
            processed, keep = sampling_logits_processor(raw_logits, params)
            sizes, support_logprobs = support_of(processed, keep, raw_tokens)
            support = {"support_sizes": sizes, "support_logprobs": support_logprobs}
        # a looping row is cut post hoc where ``fast`` would have stopped it (same check, replayed);
        # HF samples every row at every step, so the other rows' draws do not depend on the cut
        repeated_at = first_repetition(raw_tokens, eos, params.repetition) if params.repetition is not None else None
        return finalize_rollout(
            prompt_ids,
            prompt_mask,
            raw_tokens,
            raw_logprobs,
            params.max_new_tokens,
            eos,
            pad_token_id,
            **support,
            repeated_at=repeated_at,
        )
