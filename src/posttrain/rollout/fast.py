"""`rollout=fast`: batched KV-cache sampling with low per-token overhead.

Llama/Qwen2/Mistral-family models run through ``FunctionalDecoder`` (fused weights,
static cache; see functional.py).  A batch of prompts each repeated G times in a row, as
online RL samples a group per prompt, is prefilled once per prompt there.  Any other
causal LM, or a sharded one, falls back to a generic loop over the HF forward with
``past_key_values``: correct, just slower.

Per step the loop only samples, stores the token and its log-prob, and checks whether
every row has produced an EOS or started looping (``SamplingParams.repetition``,
repetition.py), to stop early.  Masking and padding after EOS happen once,
vectorised, in ``finalize_rollout``; a finished row keeps being fed its own samples until
all rows are done (that arithmetic is paid for anyway and is discarded).

The decode step runs eagerly (no ``torch.compile``): on the tiny CPU model a compile
costs more seconds than a whole rollout stage, and the step is already a handful of ops
per layer. On a GPU that eager step waits on kernel launches (~20 per layer), so there
``cuda_graphs`` (``rollout.cuda_graphs``; auto: on for a CUDA model, off on the CPU) takes the
fixed-shape decode step of static_cache.py and replays it as CUDA graphs: one launch for the
whole model per token, the sampling around it eager. Speed against ``hf`` and the forward-only
ceiling: benchmarks/rollout_speed.py; on a GPU, eager against graphs: benchmarks/gpu_check.sh
(not yet run on a GPU, 2026-11-28).
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch
from torch import nn

from posttrain.models.functional import (
    FunctionalDecoder,
    real_token_positions,
    unsupported_reason,
    without_adapter_wrapper,
)

from .base import (
    RolloutBatch,
    SamplingParams,
    check_prompts,
    eos_tensor,
    eval_mode,
    finalize_rollout,
    sample_next_token,
)
from .repetition import RepetitionDetector
from .static_cache import GraphCaptureError, StaticDecoders, pad_prompts_left, padded_prompt_width

log = logging.getLogger(__name__)


CUDA_GRAPHS = ("auto", True, False)


class FastSampler:
    """Args:
    use_functional: take the fused functional path when the architecture supports it
        (False forces the generic HF-forward loop, e.g. to compare the two).
    cuda_graphs: ``rollout.cuda_graphs``. ``auto``: on when the model is on a CUDA device (a
        failed capture is warned about once and the eager step takes over).
        ``true``: the fixed-shape decode step of static_cache.py, replayed as CUDA graphs on a
        CUDA device and run eagerly on the CPU (slower there than the default step: for tests).
        ``false``: the eager ``FunctionalDecoder`` step. Only for the functional path.

    Without graphs the fused weights are rebuilt on every call (~1 ms on the tiny model):
    caching them would risk sampling from stale weights after an update that bypasses the
    version counter (``param.data.copy_``), and their memory is freed between rollouts. With
    them the decoder (fused weights, KV cache, graphs) is kept between calls and its weights
    are re-fused from the model, in place, at every call (static_cache.py, "Kept across calls").
    """

    config_keys = ("cuda_graphs",)

    def __init__(self, use_functional: bool = True, cuda_graphs: str | bool = "auto"):
        if not any(type(cuda_graphs) is type(option) and cuda_graphs == option for option in CUDA_GRAPHS):
            raise ValueError(f"cuda_graphs must be one of {CUDA_GRAPHS}, got {cuda_graphs!r}")
        self.use_functional = use_functional
        self.cuda_graphs = cuda_graphs
        self._warned: set[str] = set()
        self._decoders = StaticDecoders()
        self._graphs_failed = False

    def __getstate__(self) -> dict:
        """Pickled or deep-copied (a producer process gets its own engine) without the kept
        decoders: a cache, rebuilt by the first call that needs one."""
        state = dict(self.__dict__)
        state["_decoders"] = StaticDecoders()
        return state

    def uses_functional_path(self, model: nn.Module) -> bool:
        return self.use_functional and unsupported_reason(without_adapter_wrapper(model)) is None

    def uses_static_cache(self, device: torch.device) -> bool:
        """Whether a functional-path call on ``device`` takes the fixed-shape decode step."""
        if self.cuda_graphs == "auto":
            return device.type == "cuda" and not self._graphs_failed
        return self.cuda_graphs

    def release(self) -> None:
        """Free the decoders kept between calls (their weights, KV caches and graphs)."""
        self._decoders.clear()

    def _generate_static(self, model, prompt_ids, prompt_mask, params, eos, pad_token_id, generator):
        """The call on the fixed-shape step (static_cache.py): prompts left-padded to the kept
        decoder's width, its weights refreshed, replayed as graphs on CUDA."""
        device = prompt_ids.device
        graphs = device.type == "cuda"
        if not graphs and "static-eager" not in self._warned:
            self._warned.add("static-eager")
            log.info("rollout=fast: cuda_graphs=true on %s runs the fixed-shape decode step eagerly", device)
        width = padded_prompt_width(prompt_ids.shape[1])
        ids, mask = pad_prompts_left(prompt_ids, prompt_mask, width, pad_token_id)
        decoder = self._decoders.get(model, ids.shape[0], width + params.max_new_tokens, params.weights_dtype, graphs)
        logits = decoder.prefill(ids, mask)
        return self._sample_loop(logits, decoder.step, prompt_ids, prompt_mask, params, eos, pad_token_id, generator)

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
        check_prompts(prompt_ids, prompt_mask)
        eos = eos_tensor(eos_token_id, prompt_ids.device)
        batch, plen = prompt_ids.shape
        model = without_adapter_wrapper(model)  # a LoRA policy: its adapter is read from its layers
        with eval_mode(model):
            reason = unsupported_reason(model) if self.use_functional else "use_functional=False"
            if reason is None and self.uses_static_cache(prompt_ids.device):
                rng = generator.get_state() if generator is not None else None
                try:
                    return self._generate_static(model, prompt_ids, prompt_mask, params, eos, pad_token_id,
                                                 generator)
                except GraphCaptureError as err:
                    if self.cuda_graphs is True:
                        raise
                    # auto: the eager step from now on, this call again from the same generator state
                    self._graphs_failed = True
                    self._decoders.clear()
                    if rng is not None:
                        generator.set_state(rng)
                    log.warning("rollout=fast: capturing the decode step as a CUDA graph failed (%s); sampling "
                                "with the eager step from now on (rollout.cuda_graphs=false silences this)", err)
            if reason is None:
                decoder = FunctionalDecoder(model, batch, plen + params.max_new_tokens, dtype=params.weights_dtype)
                logits = decoder.prefill(prompt_ids, prompt_mask)
                step = decoder.step
            else:
                if params.weights_dtype is not None:
                    raise ValueError(f"rollout.dtype={str(params.weights_dtype).removeprefix('torch.')} needs the "
                                     f"fused sampling path, which cannot run this model: {reason}; use "
                                     f"rollout.dtype=auto")
                if self.use_functional and reason not in self._warned:
                    self._warned.add(reason)
                    log.warning("rollout=fast: generic HF loop (slower) because %s", reason)
                stepper = _HFStepper(model, prompt_ids, prompt_mask, params.max_new_tokens)
                logits = stepper.prefill()
                step = stepper.step
            return self._sample_loop(logits, step, prompt_ids, prompt_mask, params, eos, pad_token_id, generator)

    @staticmethod
    def _sample_loop(logits, step, prompt_ids, prompt_mask, params, eos, pad_token_id, generator):
        batch = prompt_ids.shape[0]
        device = prompt_ids.device
        steps_max = params.max_new_tokens
        # [T, B] buffers so each step writes one contiguous row
        tokens = torch.empty((steps_max, batch), dtype=torch.long, device=device)
        logprobs = torch.empty((steps_max, batch), dtype=torch.float32, device=device)
        if params.return_support:
            support_sizes = torch.empty((steps_max, batch), dtype=torch.int32, device=device)
            support_logprobs = torch.empty((steps_max, batch), dtype=torch.float32, device=device)
        single_eos = int(eos[0]) if eos.numel() == 1 else None
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        # a looping row is done too (repetition.py); no check when the budget is below the window
        rule = params.repetition
        detector = RepetitionDetector(rule, batch, device) if rule is not None and steps_max >= rule.window else None
        # the all-done check reads a value back; on an accelerator that is a sync, so do
        # it every few steps there (rows finished in between are masked later anyway)
        check_every = 1 if device.type == "cpu" else 8
        steps = 0
        while True:
            token, logprob, support = sample_next_token(logits, params, generator)
            tokens[steps] = token
            logprobs[steps] = logprob
            if support is not None:
                support_sizes[steps], support_logprobs[steps] = support
            if detector is not None:
                done |= detector.update(steps, token, done)
            steps += 1
            done |= (token == single_eos) if single_eos is not None else torch.isin(token, eos)
            if steps == steps_max or (steps % check_every == 0 and bool(done.all())):
                break
            logits = step(token)

        support = {}
        if params.return_support:
            support = {"support_sizes": support_sizes[:steps].t(), "support_logprobs": support_logprobs[:steps].t()}
        return finalize_rollout(
            prompt_ids,
            prompt_mask,
            tokens[:steps].t(),
            logprobs[:steps].t(),
            steps_max,
            eos,
            pad_token_id,
            **support,
            repeated_at=detector.repeated_at if detector is not None else None,
        )


class _HFStepper:
    """Generic fallback: the HF forward with its own cache; positions from the mask, as
    in HF ``generate``."""

    def __init__(self, model, prompt_ids, prompt_mask, max_new_tokens):
        self.model = model
        self.prompt_ids = prompt_ids
        batch = prompt_ids.shape[0]
        ones = torch.ones((batch, max_new_tokens), dtype=prompt_mask.dtype, device=prompt_mask.device)
        self.attention_mask = torch.cat([prompt_mask, ones], dim=1)
        self.length = prompt_ids.shape[1]
        self.position = prompt_mask.long().sum(dim=1, keepdim=True)  # next position, per row
        self.past = None

    def prefill(self) -> torch.Tensor:
        mask = self.attention_mask[:, : self.length]
        positions = real_token_positions(mask)
        out = self.model(input_ids=self.prompt_ids, attention_mask=mask, position_ids=positions, use_cache=True)
        self.past = out.past_key_values
        return out.logits[:, -1]

    def step(self, token: torch.Tensor) -> torch.Tensor:
        self.length += 1
        out = self.model(
            input_ids=token[:, None],
            attention_mask=self.attention_mask[:, : self.length],
            position_ids=self.position,
            past_key_values=self.past,
            use_cache=True,
        )
        self.position = self.position + 1
        self.past = out.past_key_values
        return out.logits[:, -1]
