"""The fast sampler's decode step with fixed shapes, replayed as CUDA graphs (``rollout.cuda_graphs``).

Why: on a GPU a small model's eager decode step waits on kernel launches, not on arithmetic.
``FunctionalDecoder.step`` launches ~20 kernels per layer (SmolLM2-135M: 30 layers, ~600
launches per token), each a few microseconds of CPU time against less of GPU work; on an
H100 at 64 rows posttrain sampled 1,219 tokens/s in bf16-mixed and 1,921 in fp32
(docs/results.md, "The same preset on a GPU"). A CUDA graph records one step's kernels once
and replays them with one launch.

A graph replays the same kernels on the same memory, so the step may not change a shape or
an address from one token to the next. ``FunctionalDecoder.step`` does both (it attends over
the ``end`` columns filled so far, a Python int). Here:

* the cache column written and the step's RoPE row are device tensors (``column``,
  ``rope_row``) that the step itself advances; the K/V of the new token go in with
  ``index_copy_`` at ``column``;
* attention reads a fixed *window* of the cache, its first W columns, W a multiple of a block
  (``WINDOW_BLOCK`` columns, wider for caches over ``MAX_WINDOWS`` blocks; the smallest
  multiple that holds the columns filled so far, capped at the cache's length), with the
  columns after ``column`` masked: one graph per window, so a step reads less than one block
  of masked columns more than the eager step;
* the cache is zeroed before each prefill, so a masked column holds finite numbers (its
  softmax weight is exactly 0, and 0 x finite = 0; garbage, or another call's NaN, would not be);
* the token goes in through a static buffer, and the logits come out of one.

Sampling (``base.sample_next_token``), the EOS and repetition checks stay outside the graph,
eager: a few dozen kernels per step, not per layer, and the generator's stream stays the
eager path's.

**Kept across calls.** Capturing costs a few eager steps per window, so the decoder (its
fused weights, KV cache and graphs) is kept by the sampler and reused by the next ``generate``
with the same batch size, padded prompt width (prompts are left-padded to a multiple of
``PROMPT_BLOCK`` columns), budget, dtype and model: its fused weights are refreshed in place
(``load_weights``: the same fusing as the eager path, copied into the captured tensors), so a
replay never reads stale weights. At most ``KEPT_DECODERS`` decoders are kept (a training batch
and an evaluation batch); between rollouts they hold one fused copy of the weights, the KV
cache and the graphs' memory pool each. ``cuda_graphs=false`` holds nothing between calls.

On a CPU (or with ``graphs=False``) the same fixed-shape step runs eagerly: the CPU tests check
it against the eager path (tests/rollout/test_static_cache.py); the graph capture itself is
tested on CUDA only (``-m gpu``). On a CPU it is slower than the eager step (the tiny model, 64
rows x 32 tokens, one thread: 12.0k against 15.9k tokens/s, one run on a shared machine, the
masked columns and the wider prompt cost more than they save there), hence ``auto`` = off there.
Not yet run on a GPU (2026-11-28): benchmarks/gpu_check.sh measures it against the eager step.
"""

from __future__ import annotations

import logging
import weakref
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.models.functional import (
    FunctionalDecoder,
    FusedWeights,
    _rope_,
    _unit_rms,
    softmax_last,
)

log = logging.getLogger(__name__)

WINDOW_BLOCK = 64  # attention windows are multiples of this many cache columns
MAX_WINDOWS = 16  # at most this many graphs per decoder: a longer cache takes wider blocks
PROMPT_BLOCK = 64  # prompts are left-padded to a multiple of this width, so that calls share a decoder
KEPT_DECODERS = 2  # decoders kept between calls (e.g. one for training batches, one for evaluation)


class GraphCaptureError(RuntimeError):
    """Capturing a decode step as a CUDA graph failed (``rollout.cuda_graphs=auto`` then falls
    back to the eager step, with a warning)."""


def padded_prompt_width(width: int) -> int:
    return -(-width // PROMPT_BLOCK) * PROMPT_BLOCK


def pad_prompts_left(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, width: int,
                     pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts left-padded to ``width`` columns: the extra columns are masked padding, so
    the continuation is unchanged (positions count real tokens only)."""
    extra = width - prompt_ids.shape[1]
    if extra <= 0:
        return prompt_ids, prompt_mask
    return (F.pad(prompt_ids, (extra, 0), value=pad_token_id), F.pad(prompt_mask, (extra, 0), value=0))


def window_sizes(max_len: int) -> list[int]:
    """The attention windows of a cache of ``max_len`` columns, ascending; the last is max_len."""
    block = WINDOW_BLOCK * max(1, -(-max_len // (WINDOW_BLOCK * MAX_WINDOWS)))
    sizes = list(range(block, max_len, block))
    return sizes + [max_len]


class StaticDecoder(FunctionalDecoder):
    """A ``FunctionalDecoder`` whose decode step has fixed shapes (see the module docstring),
    run eagerly or, with ``graphs=True`` on a CUDA device, as one captured CUDA graph per
    attention window. ``prefill`` is the eager path's (it fills the same cache)."""

    DECODES_WITH_SDPA = False  # its windows (a slice of the cache, masked past the column) instead

    def __init__(self, model: nn.Module, batch_size: int, max_len: int, dtype: torch.dtype | None = None,
                 graphs: bool = False):
        super().__init__(model, batch_size, max_len, dtype=dtype)
        if graphs and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the model is on {self.device}")
        self.graphs = graphs
        self._own_weights()
        self.k_cache.zero_()  # masked window columns must hold finite numbers (see module docstring)
        self.v_cache.zero_()
        hkv, half = self.num_kv_heads, self.head_dim // 2
        complex_dtype = torch.complex128 if self.dtype == torch.float64 else torch.complex64
        # the static inputs a replay reads
        self.tokens_in = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        self.column = torch.zeros(1, dtype=torch.long, device=self.device)  # cache column this step writes
        self.rope_row = torch.zeros(1, dtype=torch.long, device=self.device)  # RoPE row of this step
        self.static_rotation = torch.ones((max_len, batch_size, 1, half), dtype=complex_dtype, device=self.device)
        self.static_mask = torch.zeros((batch_size * hkv, 1, max_len), dtype=self.dtype, device=self.device)
        self.columns = torch.arange(max_len, device=self.device)
        self.windows = window_sizes(max_len)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.key: Optional[tuple] = None  # set by the sampler: what a later call must match to reuse this

    # ------------------------------------------------------------------ weights

    def _weight_slots(self, weights: FusedWeights) -> list[tuple[object, str]]:
        """(holder, attribute) of every tensor the decode step reads."""
        slots = [(weights, name) for name in ("embed", "lm_head", "lm_head_bias", "final_gain", "final_floor")]
        for layer in weights.layers:
            slots += [(layer, name) for name in layer.__dataclass_fields__]
        return slots

    def _own_weights(self) -> None:
        """Replace every weight the step reads by the decoder's own copy (strides kept, a tied
        head stays one tensor with the embedding): without a cast ``FusedWeights`` hands out the
        model's own parameters (the embedding, o_proj and down_proj as transposed views), whose
        storage an optimiser, a ``load_state_dict(assign=True)`` or a device move may replace,
        while a graph keeps reading the addresses it was captured with."""
        copies: dict[int, torch.Tensor] = {}
        for holder, name in self._weight_slots(self.w):
            tensor = getattr(holder, name)
            if tensor is not None:
                if id(tensor) not in copies:
                    copies[id(tensor)] = tensor.detach().clone()
                setattr(holder, name, copies[id(tensor)])

    def load_weights(self, model: nn.Module, dtype: torch.dtype | None = None) -> None:
        """Refresh the fused weights from ``model`` in place (the tensors a graph reads stay
        where they are). The model must have the shapes this decoder was built for."""
        fresh = FusedWeights(model, dtype)
        if self.matmul_dtype is not None:  # as at construction (under autocast)
            fresh.cast_matmul_weights(self.matmul_dtype)
        if len(fresh.layers) != len(self.w.layers):
            raise ValueError(f"the model has {len(fresh.layers)} layers, the decoder {len(self.w.layers)}")
        mine_slots, their_slots = self._weight_slots(self.w), self._weight_slots(fresh)
        pairs = [(getattr(h1, n1), getattr(h2, n2)) for (h1, n1), (h2, n2) in zip(mine_slots, their_slots)]
        for mine, theirs in pairs:
            if (mine is None) != (theirs is None):
                raise ValueError("the model's biases differ from those this decoder was built for")
            if mine is None:
                continue
            if mine.shape != theirs.shape or mine.dtype != theirs.dtype:
                raise ValueError(f"a weight of shape {tuple(theirs.shape)} ({theirs.dtype}) does not fit the "
                                 f"decoder's {tuple(mine.shape)} ({mine.dtype})")
            mine.copy_(theirs)

    # ------------------------------------------------------------------ prefill

    def prefill(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        # a kept decoder's cache holds the last call's keys and values: zeroed, so that a masked
        # column never carries a number (a NaN, say) from another call
        self.k_cache.zero_()
        self.v_cache.zero_()
        logits = super().prefill(prompt_ids, prompt_mask, all_logits)
        steps = self.step_rotation.shape[0]
        self.static_rotation[:steps].copy_(self.step_rotation)
        self.static_mask.copy_(self.decode_mask)
        self.column.fill_(self.length)
        self.rope_row.zero_()
        return logits

    # ------------------------------------------------------------------ decode

    def window_for(self, end: int) -> int:
        """The narrowest window that holds ``end`` columns."""
        return next(w for w in self.windows if w >= end)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row ([B] long), return the next-token logits [B, V] (with graphs,
        a buffer the next step overwrites: read it before)."""
        end = self.length + 1
        if end > self.max_len:
            raise RuntimeError("KV cache is full")
        window = self.window_for(end)
        self.tokens_in.copy_(tokens)
        if self.graphs:
            graph, logits = self._graphs.get(window) or self._capture(window)
            graph.replay()
        else:
            logits = self.static_step(window)
        self.length = end
        return logits

    def static_step(self, window: int) -> torch.Tensor:
        """One decode step with fixed shapes: reads ``tokens_in``, ``column``, ``rope_row``;
        writes the new K/V at ``column`` and advances ``column`` and ``rope_row`` by one."""
        hq, hkv, d, n_rep, s = self.num_heads, self.num_kv_heads, self.head_dim, self.n_rep, self.max_len
        nqk = (hq + hkv) * d
        batch = self.batch_size
        rotation = self.static_rotation.index_select(0, self.rope_row)[0]  # [B, 1, D/2]
        hidden = self.columns[:window] > self.column  # not yet written
        mask = self.static_mask[..., :window].masked_fill(hidden, float("-inf"))

        h = F.embedding(self.tokens_in, self.w.embed)  # [B, H]
        for layer, k_cache, v_cache in zip(self.w.layers, self.k_layers, self.v_layers):
            out = F.linear(_unit_rms(h, layer.floor1), layer.w_qkv, layer.b_qkv)
            qk = out[:, :nqk].view(batch, hq + hkv, d)
            _rope_(qk, rotation)
            # .to: under autocast the projections come out in its dtype, the cache keeps its own
            k_cache.index_copy_(2, self.column, qk[:, hq:, None].to(k_cache.dtype))
            v_cache.index_copy_(2, self.column, out[:, nqk:].view(batch, hkv, 1, d).to(v_cache.dtype))
            q = qk[:, :hq].reshape(batch * hkv, n_rep, d)
            keys = k_cache.view(batch * hkv, s, d)[:, :window]
            scores = torch.baddbmm(mask, q, keys.transpose(1, 2), alpha=self.scale)
            a = torch.bmm(softmax_last(scores), v_cache.view(batch * hkv, s, d)[:, :window])
            h = torch.addmm(h, a.view(batch, hq * d), layer.w_o_t)
            if layer.b_o is not None:
                h += layer.b_o
            gate_up = F.linear(_unit_rms(h, layer.floor2), layer.w_gate_up, layer.b_gate_up)
            inter = gate_up.shape[1] // 2
            act = F.silu(gate_up[:, :inter], inplace=True).mul_(gate_up[:, inter:])
            h = torch.addmm(h, act, layer.w_down_t)
            if layer.b_down is not None:
                h += layer.b_down
        self.column += 1
        self.rope_row += 1
        return self._logits(h)

    # ------------------------------------------------------------------ CUDA graphs

    def capture_all(self) -> None:
        """Capture every window's graph now. The sampler does not: it captures a window when a
        step first needs it (``step``), so the windows inside the prompt are never captured."""
        for window in self.windows:
            if window not in self._graphs:
                self._capture(window)

    def _capture(self, window: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up (cuBLAS handles, the allocator) on a side stream, then capture one step at
        this window. The warm-up steps write the cache column at ``column`` from ``tokens_in``,
        what the step that follows writes there anyway (before a prefill: a column the prefill
        overwrites); the counters are put back after."""
        column, rope_row = self.column.clone(), self.rope_row.clone()
        try:
            stream = torch.cuda.Stream(device=self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.static_step(window)
                    self.column.copy_(column)
                    self.rope_row.copy_(rope_row)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                logits = self.static_step(window)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as err:
            raise GraphCaptureError(f"window {window}: {err}") from err
        # capturing runs nothing: the counters are where the warm-up left them
        self.column.copy_(column)
        self.rope_row.copy_(rope_row)
        self._graphs[window] = (graph, logits)
        return graph, logits

    @property
    def captured_windows(self) -> list[int]:
        return sorted(self._graphs)


class StaticDecoders:
    """The decoders a sampler keeps between calls (``KEPT_DECODERS``, the newest last), each for
    one (model, batch size, padded prompt width + budget, dtype, device, autocast state).

    Under autocast (``trainer.precision=bf16-mixed`` samples inside it) the captured step casts
    each weight as the eager step does, inside the graph: the decoder's weights do not require
    grad, so autocast's weight cache, which a replay would read after it is freed, is not used."""

    def __init__(self):
        self.kept: list[StaticDecoder] = []

    def clear(self) -> None:
        self.kept.clear()

    def get(self, model: nn.Module, batch: int, max_len: int, dtype: torch.dtype | None,
            graphs: bool) -> StaticDecoder:
        device = next(model.parameters()).device
        # a graph replays the casts autocast made at its capture (bf16-mixed samples under
        # autocast): a decoder serves only calls under the same autocast
        autocast = torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type)
        key = (id(model), batch, max_len, dtype, str(device), graphs, autocast)
        for decoder in self.kept:
            if decoder.key == key and decoder.model_ref() is model:
                self.kept.remove(decoder)
                try:
                    decoder.load_weights(model, dtype)
                except ValueError:  # the model changed shape or dtype in place: build anew
                    break
                self.kept.append(decoder)
                return decoder
        while len(self.kept) >= KEPT_DECODERS:
            self.kept.pop(0)  # the oldest: its memory goes before the new one is allocated
        decoder = StaticDecoder(model, batch, max_len, dtype=dtype, graphs=graphs)
        decoder.key = key
        decoder.model_ref = weakref.ref(model)
        self.kept.append(decoder)
        return decoder
