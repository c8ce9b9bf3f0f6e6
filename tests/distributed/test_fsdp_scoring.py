"""The training forward on FSDP2-sharded weights (trainer=fsdp), 2 processes on CPU with gloo.

The grouped forward runs on the sharded model: each decoder layer's step as a forward of that
layer's FSDP unit (gathered for its step alone), the embedding, the final norm and the chunked
LM-head scoring as one of the model's, also with activation checkpointing (each layer's step
recomputed in the backward, under the weights that the backward gathered). A model that the
grouped forward refuses (Qwen3) takes its own forward (SDPA attention), with its LM
head replaced by the chunked scorer inside the model's forward (where FSDP2 has gathered the
head). On every path the log-probs, entropies, full-vocabulary logits (`distill.mode=full`) and
gradients are those of one process on the whole weights, for a trainable policy and for a
frozen scorer (the reference), with uneven data on the two ranks (batch size, response
lengths)."""

import copy
import os

import pytest
import torch
import torch.distributed as dist
import transformers
from torch.distributed.tensor import DTensor

import posttrain.models.grouped_forward as grouped
from posttrain.distributed.recompute import enable_activation_checkpointing
from posttrain.distributed.sharding import ShardingPolicy, shard_lm
from posttrain.models.forward import sequence_logits, sequence_logprobs
from posttrain.models.grouped_forward import grouped_forward_unsupported_reason

from conftest import free_port, run_ranks

WORLD = 2
VARIANTS = ("grouped", "grouped_checkpointed", "grouped_selective", "model_forward")
GROUP = 2


def small_model(variant: str):
    """A 2-layer GQA decoder: Llama (the grouped forward runs it) or, for `model_forward`,
    Qwen3 (the grouped forward refuses it)."""
    shape = {"vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 48, "max_position_embeddings": 64,
             "tie_word_embeddings": False}
    with torch.random.fork_rng():
        torch.manual_seed(0)
        if variant == "model_forward":
            return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=8, **shape)).train()
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).train()


def rank_batch(rank: int):
    """Rank `rank`'s rows: 2 (rank 0) or 3 (rank 1) prompts x `GROUP` samples, left-padded
    prompts, uneven responses."""
    g = torch.Generator().manual_seed(rank)
    prompts = torch.randint(3, 50, (2 + rank, 5), generator=g)
    prompt_mask = torch.ones_like(prompts)
    prompts[1, :2], prompt_mask[1, :2] = 0, 0
    lengths = torch.tensor([1, 6, 3, 4]) if rank == 0 else torch.tensor([6, 2, 5, 5, 1, 3])
    response_mask = (torch.arange(6)[None, :] < lengths[:, None]).long()
    response_ids = torch.randint(3, 50, (len(lengths), 6), generator=g) * response_mask
    return prompts.repeat_interleave(GROUP, 0), prompt_mask.repeat_interleave(GROUP, 0), response_ids, response_mask


TEMPERATURE = 0.8


def scores_and_grads(model, batch):
    logp, entropy = sequence_logprobs(model, *batch, with_entropy=True, temperature=TEMPERATURE, chunk_tokens=3)
    loss = (logp * batch[3]).sum() + 0.1 * (entropy * batch[3]).sum()
    loss.backward()
    return logp.detach(), entropy.detach()


def full_logits_and_grads(model, batch):
    logits = sequence_logits(model, *batch)
    (logits.log_softmax(-1)[..., :7].sum(-1) * batch[3]).sum().backward()  # a loss over part of the vocabulary
    return logits.detach()


def spy_on_the_grouped_forward():
    """Records each grouped forward's (group size, checkpointed) and, for each decoder-layer
    step, (layer index, its weights whole, every other layer's sharded)."""
    seen = {"forwards": [], "steps": []}
    trunk, decoder_layer = grouped._trunk, grouped._decoder_layer

    def spied_trunk(w, *args):
        seen["forwards"].append(tuple(args[4:6]))  # group_size, checkpointed
        return trunk(w, *args)

    def spied_decoder_layer(w, block, *args, **kwargs):
        others = [p for other in w.blocks if other is not block for p in other.parameters()]
        seen["steps"].append((w.blocks.index(block), not any(isinstance(p, DTensor) for p in block.parameters()),
                              all(isinstance(p, DTensor) for p in others)))
        return decoder_layer(w, block, *args, **kwargs)

    grouped._trunk, grouped._decoder_layer = spied_trunk, spied_decoder_layer
    return seen


def worker(rank, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        mesh = dist.device_mesh.init_device_mesh("cpu", (WORLD,))
        batch = rank_batch(rank)
        seen = spy_on_the_grouped_forward()
        for variant in VARIANTS:
            seen["forwards"].clear(), seen["steps"].clear()
            policy, reference = small_model(variant), small_model(variant).requires_grad_(False).eval()
            if variant == "grouped_selective":  # model.gradient_checkpointing=selective, set when the model loads
                enable_activation_checkpointing(policy, "selective")
            shard_lm(policy, mesh, ShardingPolicy(activation_checkpointing=variant.endswith("checkpointed")),
                     trainable=True)
            shard_lm(reference, mesh, ShardingPolicy(), trainable=False)
            result = {"refused": grouped_forward_unsupported_reason(policy)}
            result["logp"], result["entropy"] = scores_and_grads(policy, batch)
            # FSDP2's reduce-scatter averages the ranks' gradients
            result["grads"] = {name: p.grad.full_tensor() for name, p in policy.named_parameters()}
            with torch.no_grad():
                result["ref_logp"] = sequence_logprobs(reference, *batch, temperature=TEMPERATURE)[0]
            result["forwards"], result["steps"] = list(seen["forwards"]), list(seen["steps"])
            # the full-vocabulary logits (distill.mode=full, PPO-ptx), and the gradients through them
            policy.zero_grad(set_to_none=True)
            result["logits"] = full_logits_and_grads(policy, batch)
            result["logit_grads"] = {name: p.grad.full_tensor() for name, p in policy.named_parameters()}
            torch.save(result, f"{out_dir}/{variant}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded_results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("fsdp_scoring")
    run_ranks(worker, free_port(), str(out_dir))
    return {variant: [torch.load(out_dir / f"{variant}-rank{r}.pt", weights_only=False) for r in range(WORLD)]
            for variant in VARIANTS}


def on_one_process(variant, compute) -> list[tuple]:
    """For each rank's batch, `compute(model, batch)` on a fresh copy of the whole model (no
    sharding, no checkpointing): (its output, the batch, the gradients it left) per rank."""
    model = small_model(variant)
    per_rank = []
    for rank in range(WORLD):
        one, batch = copy.deepcopy(model), rank_batch(rank)
        output = compute(one, batch)
        per_rank.append((output, batch, {name: p.grad for name, p in one.named_parameters()}))
    return per_rank


def assert_the_rank_average(sharded_grads: dict, per_rank: list[tuple]) -> None:
    """FSDP2's reduce-scatter averages the ranks' gradients."""
    for name, grad in sharded_grads.items():
        expected = sum(grads[name] for _, _, grads in per_rank) / WORLD
        assert expected.abs().sum() > 0, name
        torch.testing.assert_close(grad, expected, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("variant", VARIANTS)
def test_sharded_scoring_gives_the_one_process_logprobs_and_gradients(sharded_results, variant):
    ranks = sharded_results[variant]
    per_rank = on_one_process(variant, scores_and_grads)
    for result, ((logp, entropy), batch, _) in zip(ranks, per_rank):
        real = batch[3].bool()
        torch.testing.assert_close(result["logp"][real], logp[real], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(result["entropy"][real], entropy[real], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(result["ref_logp"][real], logp[real], atol=1e-5, rtol=1e-5)
    assert_the_rank_average(ranks[0]["grads"], per_rank)
    for name, grad in ranks[0]["grads"].items():
        torch.testing.assert_close(ranks[1]["grads"][name], grad)


@pytest.mark.parametrize("variant", VARIANTS)
def test_sharded_full_logits_are_the_one_process_logits_and_gradients(sharded_results, variant):
    ranks = sharded_results[variant]
    per_rank = on_one_process(variant, full_logits_and_grads)
    for result, (logits, batch, _) in zip(ranks, per_rank):
        real = batch[3].bool()
        assert result["logits"].shape == logits.shape == (*batch[3].shape, small_model(variant).config.vocab_size)
        torch.testing.assert_close(result["logits"][real], logits[real], atol=1e-5, rtol=1e-5)
    assert_the_rank_average(ranks[0]["logit_grads"], per_rank)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_grouped_forward_runs_on_sharded_weights_one_layer_gathered_at_a_time(sharded_results, variant):
    for result in sharded_results[variant]:
        if variant == "model_forward":
            assert "qwen3" in result["refused"] and result["forwards"] == [] and result["steps"] == []
            continue
        assert result["refused"] is None
        checkpointed = variant in ("grouped_checkpointed", "grouped_selective")
        # the policy's (with grad), then the reference's (no grad: never checkpointed); prompts shared
        assert result["forwards"] == [(GROUP, checkpointed), (GROUP, False)]
        forward = [(0, True, True), (1, True, True)]  # each layer gathered for its own step only
        if checkpointed:  # each step again in the backward, last layer first, with its weights whole
            assert result["steps"][:2] + result["steps"][4:] == forward + forward
            assert [step[:2] for step in result["steps"][2:4]] == [(1, True), (0, True)]
        else:
            assert result["steps"] == forward + forward
