"""Common interface of the generation engines: sampling settings, the rollout batch, and
the one logits processor both engines share.

Which distribution ``RolloutBatch.logprobs`` refers to
------------------------------------------------------
``logprobs[b, t] = log_softmax(logits_t / temperature)[token]`` over the FULL vocabulary,
i.e. temperature applied, top-k / top-p NOT applied.  This is what verl/TRL recompute as
"old" log-probs during training (they never truncate the vocabulary), so a fresh policy
forward at the same weights reproduces them and the PPO ratio starts at exactly 1.
Greedy decoding reports the same quantity (with ``temperature`` if > 0, else 1).

The kept top-k / top-p support (``return_support=True``)
-------------------------------------------------------
When top-k/top-p are on, the token was actually drawn from the distribution renormalised
over the kept tokens.  Both filters keep a prefix of the tokens sorted by logit, so the
support at each position is fully described by its size: ``support_size[b, t]`` = number
of kept tokens, i.e. the kept set is the top-``support_size`` tokens of the tempered
logits (a dense [B, T, V] mask would be hundreds of GB at real sizes).  Training
renormalises the new policy over the same set with
``core.token_logprobs_and_entropy(..., support_size=batch.support_size)`` (DeepSeek-V3.2
"keep sampling mask"); ``support_logprobs`` is the sampler's own log-prob renormalised over
that set, the quantity to compare it with (e.g. for V3.2's off-policy sequence mask).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields
from typing import Iterator, Optional, Protocol, Sequence

import torch
from torch import nn

from .repetition import RepetitionRule


@dataclass
class SamplingParams:
    """How to sample.  ``top_k=0`` and ``top_p=1.0`` switch those filters off."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    return_support: bool = False  # fill RolloutBatch.support_size / support_logprobs
    repetition: Optional[RepetitionRule] = None  # stop looping rows (repetition.py); None: off
    # sample with the weights rounded to this dtype (rollout.dtype: a bf16 sampler for an fp32
    # policy, as an inference engine would run it); None: the model's own. rollout=fast only.
    weights_dtype: Optional[torch.dtype] = None

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.greedy and not self.temperature > 0:
            raise ValueError(
                f"SamplingParams.temperature must be > 0 when sampling, got {self.temperature} "
                "(use greedy=True for argmax decoding)"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.repetition is not None:
            self.repetition.validate()

    @property
    def logprob_temperature(self) -> float:
        """Temperature used for the reported log-probs (greedy may pass temperature=0)."""
        return self.temperature if self.temperature > 0 else 1.0


@dataclass
class RolloutBatch:
    """G completions per prompt, flattened to a batch of B rows (row i = prompt i // G when
    the caller repeated each prompt G times).  Shapes: P prompt columns, T response columns.
    """

    prompt_ids: torch.Tensor  # [B, P] long, left-padded with pad_token_id
    prompt_mask: torch.Tensor  # [B, P] long, 1 = real prompt token
    response_ids: torch.Tensor  # [B, T] long, pad after the EOS (the EOS itself is kept)
    response_mask: torch.Tensor  # [B, T] long, 1 = generated token, including the ending EOS
    logprobs: torch.Tensor  # [B, T] float, log_softmax(logits / T) of the sampled token; 0 on padding
    truncated: torch.Tensor  # [B] bool, True = hit max_new_tokens without EOS (and not stopped as repeated)
    # Only with SamplingParams.return_support (else None); both 0 on padding:
    support_size: Optional[torch.Tensor] = None  # [B, T] int32, tokens kept by top-k/top-p (V if no filter)
    support_logprobs: Optional[torch.Tensor] = None  # [B, T] float, log-prob renormalised over that support
    # [B] bool, True = stopped early because it started looping (SamplingParams.repetition), without
    # an EOS; always filled by the engines (all False when the check is off)
    repeated: Optional[torch.Tensor] = None

    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(dim=1)

    def to(self, device) -> "RolloutBatch":
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            moved[f.name] = value.to(device) if isinstance(value, torch.Tensor) else value
        return RolloutBatch(**moved)


class RolloutEngine(Protocol):
    def generate(
        self,
        model: nn.Module,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: SamplingParams,
        eos_token_id: int | Sequence[int],
        pad_token_id: int,
        generator: torch.Generator | None = None,
    ) -> RolloutBatch: ...


# --------------------------------------------------------------------------- sampling


def sampling_logits_processor(
    logits: torch.Tensor, params: SamplingParams
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Temperature (``logprob_temperature``), then top-k, then top-p (on the top-k-renormalised distribution), the
    order HF and vLLM use.  Returns float32 ``processed`` logits (dropped tokens at -inf)
    and the boolean ``keep_mask`` [B, V] (None when no filter is on, meaning "all kept").

    top-k keeps exactly k tokens (ties broken by ``topk``); top-p keeps the smallest
    prefix of the descending-sorted distribution whose mass reaches top_p, i.e. a token is
    kept when the mass strictly before it is < top_p (so the most likely token always is).
    """
    scaled = logits.float()
    if params.logprob_temperature != 1.0:
        # also under greedy: argmax is unchanged, and top-p then means the same thing
        scaled = scaled / params.logprob_temperature
    vocab = scaled.shape[-1]
    keep = None
    if 0 < params.top_k < vocab:
        top_idx = scaled.topk(params.top_k, dim=-1).indices
        keep = torch.zeros_like(scaled, dtype=torch.bool).scatter_(-1, top_idx, True)
        scaled = scaled.masked_fill(~keep, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        keep_sorted = mass_before < params.top_p
        keep_sorted[..., 0] = True  # guard against rounding when top_p is tiny
        keep_p = torch.zeros_like(keep_sorted).scatter_(-1, sorted_idx, keep_sorted)
        # AND with top-k: a dropped token has probability 0 but, by rounding, could still
        # see mass_before < top_p when top_p is close to 1.
        keep = keep_p if keep is None else keep & keep_p
        scaled = scaled.masked_fill(~keep, float("-inf"))
    return scaled, keep


def draw_from(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One sample per row of ``probs`` [B, V] (need not sum exactly to 1) by inverting the
    CDF with a single uniform per row.  ``torch.multinomial`` draws V exponentials per
    row instead: ~45x slower at V=32k on CPU, and it dominated the decode step.

    Zero-probability tokens are never drawn: their CDF interval is empty, and ``u`` is
    kept strictly below the total so rounding cannot select the (maybe dropped) tail.
    """
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    u = torch.rand(total.shape, generator=generator, device=probs.device, dtype=cdf.dtype) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).squeeze(1)


def support_of(
    processed: torch.Tensor, keep: Optional[torch.Tensor], token: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(support_size, support_logprob) of ``token`` [...] given ``sampling_logits_processor``'s
    output for it ([..., V]): the number of kept tokens (V when no filter is on) and the
    token's log-prob renormalised over them."""
    if keep is None:
        size = torch.full(token.shape, processed.shape[-1], dtype=torch.int32, device=token.device)
    else:
        size = keep.sum(dim=-1, dtype=torch.int32)
    logprob = processed.log_softmax(dim=-1).gather(-1, token.unsqueeze(-1)).squeeze(-1)
    return size, logprob


def sample_next_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor, Optional[tuple[torch.Tensor, torch.Tensor]]]:
    """One decoding step shared by the KV-cache loops: returns (token [B], logprob [B],
    support), ``support`` = ``support_of(...)`` when ``params.return_support`` else None.
    ``logprob`` follows the module docstring convention."""
    processed, keep = sampling_logits_processor(logits, params)
    if keep is None:
        full = processed  # no filter: the processed logits ARE the full tempered logits
    else:
        full = logits.float() / params.logprob_temperature
    logp = full.log_softmax(dim=-1)
    if params.greedy:
        token = processed.argmax(dim=-1)
    elif keep is None:
        token = draw_from(logp.exp(), generator)
    else:
        token = draw_from(processed.softmax(dim=-1), generator)
    logprob = logp.gather(1, token[:, None]).squeeze(1)
    support = support_of(processed, keep, token) if params.return_support else None
    return token, logprob, support


# --------------------------------------------------------------------------- helpers


def eos_tensor(eos_token_id: int | Sequence[int], device) -> torch.Tensor:
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if not ids:
        raise ValueError("eos_token_id must be an int or a non-empty list of ints")
    return torch.tensor(ids, dtype=torch.long, device=device)


def check_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> None:
    if prompt_ids.dim() != 2 or prompt_ids.shape != prompt_mask.shape:
        raise ValueError(
            f"prompt_ids and prompt_mask must both be [B, P]; got {tuple(prompt_ids.shape)} "
            f"and {tuple(prompt_mask.shape)}"
        )
    if prompt_ids.shape[1] == 0:
        raise ValueError("prompts must have at least one column")
    # Left padding is what every engine assumes: the last column must be a real token.
    if not bool(prompt_mask[:, -1].all()):
        raise ValueError("prompts must be left-padded: prompt_mask[:, -1] has zeros")


def finalize_rollout(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    raw_tokens: torch.Tensor,
    raw_logprobs: torch.Tensor,
    max_new_tokens: int,
    eos: torch.Tensor,
    pad_token_id: int,
    support_sizes: Optional[torch.Tensor] = None,
    support_logprobs: Optional[torch.Tensor] = None,
    repeated_at: Optional[torch.Tensor] = None,
) -> RolloutBatch:
    """Turn what a loop sampled ([B, T'] tokens, T' <= T; anything after a row's first EOS
    is ignored) into a RolloutBatch padded to T = max_new_tokens columns.  The optional
    ``support_*`` [B, T'] (see ``support_of``) are padded the same way, with 0.
    ``repeated_at`` [B] (``RepetitionDetector.repeated_at``; -1: none) ends a looping row after
    that step's token, without an EOS, and flags it ``repeated`` rather than ``truncated``.

    Doing the EOS bookkeeping once here, vectorised, keeps it out of the per-token loop.
    """
    batch, steps = raw_tokens.shape
    device = raw_tokens.device
    tokens = torch.full((batch, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    tokens[:, :steps] = raw_tokens
    is_eos = torch.isin(tokens, eos)
    is_eos[:, steps:] = False  # the pad filler may equal an EOS id
    # a token is part of the response if no EOS came strictly before it
    eos_before = is_eos.long().cumsum(dim=1) - is_eos.long()
    position = torch.arange(max_new_tokens, device=device)
    in_response = (eos_before == 0) & (position < steps)
    if repeated_at is None:
        repeated = torch.zeros(batch, dtype=torch.bool, device=device)
    else:
        repeated = repeated_at >= 0
        in_response &= ~repeated[:, None] | (position[None, :] <= repeated_at[:, None])
    tokens = tokens.masked_fill(~in_response, pad_token_id)
    truncated = ~is_eos.any(dim=1) & ~repeated

    def per_token(raw: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
        if raw is None:
            return None
        out = torch.zeros((batch, max_new_tokens), dtype=dtype, device=device)
        out[:, :steps] = raw
        return out.masked_fill(~in_response, 0)

    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask.long(),
        response_ids=tokens,
        response_mask=in_response.long(),
        logprobs=per_token(raw_logprobs, torch.float32),
        truncated=truncated,
        support_size=per_token(support_sizes, torch.int32),
        support_logprobs=per_token(support_logprobs, torch.float32),
        repeated=repeated,
    )


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Put every submodule in eval mode (no dropout) and restore each one's own flag after,
    so a policy that was training keeps training and a frozen part stays frozen."""
    saved = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, was_training in saved:
            module.training = was_training


def fork_rng_from(generator: torch.Generator | None, device) -> contextlib.AbstractContextManager:
    """For code that can only use the global RNG (HF ``generate``): seed it from
    ``generator`` inside a forked RNG state, so the run is reproducible from the generator
    and the caller's global RNG stream is left untouched."""
    if generator is None:
        return contextlib.nullcontext()
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device).item())
    device = torch.device(device)
    ctx = torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else [])

    @contextlib.contextmanager
    def seeded():
        with ctx:
            torch.manual_seed(seed)
            yield

    return seeded()


def decode_responses(tokenizer, response_ids: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
    """Response texts without padding and special tokens (EOS)."""
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(response_ids, response_mask)]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)
