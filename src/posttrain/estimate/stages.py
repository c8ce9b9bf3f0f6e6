"""Memory and FLOPs of one rollout batch on one device, stage by stage (generate, annotate,
update, evaluate), and lower bounds on the seconds each stage takes on a device. The formulas
are `posttrain.core.cost`'s; docs/estimate.md says what each term holds."""

from __future__ import annotations

from posttrain.core import cost
from posttrain.core.cost import DecoderShape
from posttrain.core.logprobs import HIDDEN_CHUNK_ELEMENTS
from posttrain.distributed.recompute import MODES as CHECKPOINTING_MODES
from posttrain.estimate.architecture import Role
from posttrain.estimate.batch import Batch
from posttrain.estimate.memory import DTYPE_BYTES, layout_of

HALF_PRECISIONS = ("bf16-mixed", "16-mixed", "bf16-true", "16-true", "bf16", "16")


# --- memory ----------------------------------------------------------------------------------

def activation_dtype_bytes(cfg) -> int:
    precision = str(cfg.trainer.get("precision", "32-true"))
    return 2 if precision in HALF_PRECISIONS else DTYPE_BYTES[cfg.model.dtype]


def sampler_dtype_bytes(cfg) -> int:
    dtype = cfg.rollout.get("dtype", "auto")
    return DTYPE_BYTES[cfg.model.dtype] if dtype in (None, "auto") else DTYPE_BYTES[dtype]


def checkpointing_mode(cfg) -> bool | str:
    """False, True (every layer recomputed) or "selective" (model.gradient_checkpointing)."""
    strategy = cfg.trainer.get("strategy")
    sharded = hasattr(strategy, "get") and bool(strategy.get("activation_checkpointing", False))
    return cfg.model.get("gradient_checkpointing", False) or sharded


def update_activations(shape: DecoderShape, batch: Batch, act_bytes: int, weight_bytes: float,
                       checkpointed: bool | str) -> dict[str, float]:
    """What the update's micro-batch holds for its backward: per layer its activations and its
    fused weight copies (both only for the one layer being recomputed when checkpointed, beside
    what each layer keeps: its input, or with "selective" its matmuls' outputs too), the final
    hidden states, and the attention masks shared by every layer."""
    args = (shape, batch.micro_prompts, batch.prompt_tokens, batch.micro_rows, batch.response_tokens, act_bytes)
    full_layer = cost.layer_activation_bytes(*args)
    fused_layer = cost.FUSED_COPIES_WITH_GRAD * cost.fused_layer_parameters(shape) * weight_bytes
    scored = batch.micro_rows * batch.response_tokens
    head = 2 * scored * shape.hidden * act_bytes  # the last layer's output and its final-normed copy
    masks = mask_bytes(batch, act_bytes)
    if checkpointed:
        per_layer = cost.selective_layer_bytes if checkpointed == "selective" else cost.checkpointed_layer_bytes
        kept = shape.layers * per_layer(*args) + full_layer
        fused = fused_layer
    else:
        kept = shape.layers * full_layer
        fused = shape.layers * fused_layer
    return {"activations": kept + head + masks, "fused weight copies": fused}


def mask_bytes(batch: Batch, act_bytes: int) -> int:
    """The grouped forward's two additive attention masks, rows padded to 16 elements."""
    def padded(n: int) -> int:
        return -(-n // 16) * 16

    prompt = batch.micro_prompts * batch.prompt_tokens * padded(batch.prompt_tokens)
    response = batch.micro_rows * batch.response_tokens * padded(batch.prompt_tokens + batch.response_tokens)
    return (prompt + response) * act_bytes


def logit_chunk_tokens(vocab: int) -> int:
    return max(1, HIDDEN_CHUNK_ELEMENTS // vocab)


def memory_by_stage(cfg, roles: list[Role], shape: DecoderShape, batch: Batch,
                    scores: bool) -> tuple[dict, dict, bool]:
    """(stage -> term -> bytes, the update's activations without, with and with selective
    checkpointing, the checkpointing mode) on one device. `scores`: whether the annotate stage runs a forward
    (reference, old, teacher log-probs; critic values)."""
    layout = layout_of(cfg)
    policy = roles[0]
    weight_bytes = DTYPE_BYTES[cfg.model.dtype]
    act_bytes = activation_dtype_bytes(cfg)
    held = {f"{r.role} weights": r.parameters * r.weight_bytes for r in roles}
    optimiser = {f"{r.role} AdamW moments": 2 * r.parameters * r.weight_bytes for r in roles if r.trainable}
    gradients = {f"{r.role} gradients": r.parameters * r.weight_bytes for r in roles if r.trainable}
    gathered = {}
    if layout.shards > 1:  # fsdp: the sampler reads the whole weights, gathered for the rollout
        gathered = {"gathered policy weights": policy.parameters * weight_bytes * (1 - 1 / layout.shards)}
    persistent = {**held, **optimiser}

    chunk = logit_chunk_tokens(shape.vocab)
    scored = batch.micro_rows * batch.response_tokens
    logits = cost.logit_chunk_bytes(shape.vocab, scored, chunk)
    head_gradient = shape.vocab * shape.hidden * weight_bytes  # one chunk's LM-head gradient, before it is added
    checkpointed = checkpointing_mode(cfg)
    each = {mode: update_activations(shape, batch, act_bytes, weight_bytes, mode) for mode in CHECKPOINTING_MODES}
    kept = each[checkpointed]
    critic = next((r for r in roles if r.role == "critic" and r.trainable and r.shape is not None), None)
    if critic is not None:  # PPO's critic with its own backbone: its forward's activations too
        critic_kept = update_activations(critic.shape, batch, act_bytes, weight_bytes, checkpointed)
        kept = {**kept, **{f"critic {term}": value for term, value in critic_kept.items()}}
    # the backward frees each layer's activations as it fills that layer's gradients: the stage
    # peaks at its start (activations, the logits' backward) or at its end (every gradient);
    # a later micro-batch runs its forward and backward with the gradients already there
    at_start = sum(kept.values()) + logits + head_gradient
    all_gradients = sum(gradients.values())
    if batch.micro_batches > 1:
        backward = {**gradients, **kept, "logits (chunked)": logits, "LM-head gradient chunk": head_gradient}
    elif at_start >= all_gradients:
        backward = {**kept, "logits (chunked)": logits, "LM-head gradient chunk": head_gradient}
    else:
        backward = gradients

    sampler = sampler_dtype_bytes(cfg)
    fused_sampler = shape.layers * cost.fused_layer_parameters(shape) * sampler
    if sampler != weight_bytes:  # the sampler holds every weight in its own dtype
        fused_sampler = policy.parameters * sampler
    fast = cfg.rollout.get("engine", "fast") == "fast"
    positions = batch.prompt_tokens + batch.response_tokens
    generate = {**persistent, **gathered,
                "KV cache": cost.kv_cache_bytes(shape, batch.rows, positions, sampler),
                "prefill (one layer)": prefill_bytes(shape, batch.prompts, batch.prompt_tokens, sampler)}
    if fast:
        generate["sampler's fused weights"] = fused_sampler
    forward_tokens = batch.micro_prompts * batch.prompt_tokens + scored
    forward_only = {**persistent,
                    "one layer's forward": forward_tokens * cost.forward_working_elements_per_token(shape) * act_bytes,
                    "attention masks": mask_bytes(batch, act_bytes),
                    "logits (chunked)": cost.logit_chunk_bytes(shape.vocab, scored, chunk)}
    evaluate = {**persistent, **gathered,
                "KV cache": cost.kv_cache_bytes(shape, batch.eval_rows, batch.prompt_tokens + batch.eval_tokens, sampler),
                "prefill (one layer)": prefill_bytes(shape, batch.eval_rows, batch.prompt_tokens, sampler)}
    if fast:
        evaluate["sampler's fused weights"] = fused_sampler
    stages = {"generate": generate, "annotate": forward_only, "update": {**persistent, **backward},
              "evaluate": evaluate}
    if not scores:
        del stages["annotate"]
    if cfg.algorithm.get("kind") != "online":
        stages = {"update": stages["update"], "evaluate": evaluate}
    activations = {"without checkpointing": each[False]["activations"], "with checkpointing": each[True]["activations"],
                   "with selective checkpointing": each["selective"]["activations"]}
    return stages, activations, checkpointed


def prefill_bytes(shape: DecoderShape, prompts: int, prompt_tokens: int, dtype_bytes: int) -> int:
    """One layer's working tensors over the unique prompts while the sampler prefills them."""
    return prompts * prompt_tokens * cost.forward_working_elements_per_token(shape) * dtype_bytes


# --- FLOPs and seconds -----------------------------------------------------------------------

def flops_by_stage(cfg, roles: list[Role], shape: DecoderShape, batch: Batch) -> dict[str, float]:
    """FLOPs of one rollout batch on one device, by stage."""
    algorithm = cfg.algorithm
    whole = (shape, batch.prompts, batch.prompt_tokens, batch.rows, batch.response_tokens)
    flops = {}
    if algorithm.get("kind") == "online":
        flops["generate"] = cost.generation_flops(*whole)
        if batch.optimiser_steps > 1:  # pi_old differs from the policy after the first step
            flops["old log-probs"] = cost.forward_flops(*whole)
        for r in roles[1:]:
            if r.shape is not None and r.role in ("reference", "teacher", "reward model"):
                flops[f"{r.role} forward"] = cost.forward_flops(r.shape, *whole[1:])
    epochs = int(algorithm.get("ppo_epochs", 1) or 1)
    prompts_computed = batch.rows * batch.micro_prompts // batch.micro_rows  # once per group within a micro-batch
    policy_forward = cost.forward_flops(shape, prompts_computed, batch.prompt_tokens, batch.rows, batch.response_tokens)
    flops["update"] = epochs * cost.training_flops(policy_forward, checkpointing_mode(cfg))
    critic = next((r for r in roles if r.role == "critic" and r.shape is not None), None)
    if critic is not None:
        critic_forward = cost.forward_flops(critic.shape, *whole[1:])
        flops["critic"] = critic_forward + epochs * cost.training_flops(critic_forward, checkpointing_mode(cfg))
    return flops


def seconds_by_stage(cfg, flops: dict[str, float], roles: list[Role], shape: DecoderShape, batch: Batch,
                     peak_flops: float, bandwidth: float) -> dict[str, float]:
    """Lower bounds: FLOPs at the device's peak; generation also at least one read of the
    sampler's weights per decode step, and of the KV cache so far, at its bandwidth."""
    sampler = sampler_dtype_bytes(cfg)
    seconds = {}
    for stage, count in flops.items():
        bytes_read = 0
        if stage == "generate":
            weights = cost.matmul_parameters(shape) * sampler
            bytes_read = cost.decode_bytes_read(weights, shape, batch.rows, batch.prompt_tokens,
                                                batch.response_tokens, sampler)
        seconds[stage] = cost.seconds_at_least(count, peak_flops, bytes_read, bandwidth)
    seconds["step"] = sum(seconds.values())
    return seconds
