"""The training forward on FSDP2-sharded weights (trainer=fsdp), 2 processes on CPU with gloo:
the grouped forward refuses sharded DTensors, so the model's own forward (SDPA attention)
runs, with its LM head replaced by the chunked scorer inside the model's forward (where FSDP2
has gathered the head). Its log-probs, entropies and gradients are those of one process on
the whole weights, for a trainable policy and for a frozen scorer (the reference)."""

import copy
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers

from posttrain.distributed.sharding import ShardingPolicy, shard_lm
from posttrain.models.forward import sequence_logprobs
from posttrain.models.grouped_forward import grouped_forward_unsupported_reason

from conftest import free_port

WORLD = 2


def small_llama():
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).train()


def rank_batch(rank: int):
    """Rank `rank`'s rows: 2 prompts x 2 samples, left-padded prompts, uneven responses."""
    g = torch.Generator().manual_seed(rank)
    prompts = torch.randint(3, 50, (2, 5), generator=g)
    prompt_mask = torch.ones_like(prompts)
    prompts[1, :2], prompt_mask[1, :2] = 0, 0
    lengths = torch.tensor([1, 6, 3, 4]) if rank == 0 else torch.tensor([6, 2, 5, 5])
    response_mask = (torch.arange(6)[None, :] < lengths[:, None]).long()
    response_ids = torch.randint(3, 50, (4, 6), generator=g) * response_mask
    return prompts.repeat_interleave(2, 0), prompt_mask.repeat_interleave(2, 0), response_ids, response_mask


TEMPERATURE = 0.8


def scores_and_grads(model, batch):
    logp, entropy = sequence_logprobs(model, *batch, with_entropy=True, temperature=TEMPERATURE, chunk_tokens=3)
    loss = (logp * batch[3]).sum() + 0.1 * (entropy * batch[3]).sum()
    loss.backward()
    return logp.detach(), entropy.detach()


def worker(rank, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        mesh = dist.device_mesh.init_device_mesh("cpu", (WORLD,))
        policy, reference = small_llama(), small_llama().requires_grad_(False).eval()
        shard_lm(policy, mesh, ShardingPolicy(), trainable=True)
        shard_lm(reference, mesh, ShardingPolicy(), trainable=False)
        batch = rank_batch(rank)
        result = {"refused": grouped_forward_unsupported_reason(policy)}
        result["logp"], result["entropy"] = scores_and_grads(policy, batch)
        # FSDP2's reduce-scatter averages the ranks' gradients
        result["grads"] = {name: p.grad.full_tensor() for name, p in policy.named_parameters()}
        with torch.no_grad():
            result["ref_logp"] = sequence_logprobs(reference, *batch, temperature=TEMPERATURE)[0]
        torch.save(result, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_sharded_scoring_gives_the_one_process_logprobs_and_gradients(tmp_path):
    mp.spawn(worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    model = small_llama()
    grads = []
    for rank, result in enumerate(ranks):
        assert "sharded" in result["refused"]
        one = copy.deepcopy(model)
        batch = rank_batch(rank)
        logp, entropy = scores_and_grads(one, batch)  # the grouped forward, whole weights
        real = batch[3].bool()
        torch.testing.assert_close(result["logp"][real], logp[real], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(result["entropy"][real], entropy[real], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(result["ref_logp"][real], logp[real], atol=1e-5, rtol=1e-5)
        grads.append({name: p.grad for name, p in one.named_parameters()})
    for name, grad in ranks[0]["grads"].items():
        expected = (grads[0][name] + grads[1][name]) / WORLD
        assert expected.abs().sum() > 0, name
        torch.testing.assert_close(grad, expected, atol=1e-5, rtol=1e-4, msg=name)
        torch.testing.assert_close(ranks[1]["grads"][name], grad)
