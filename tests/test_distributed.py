"""Data parallelism on CPU with gloo, 2 processes: the ranks draw disjoint prompts, and the
averaged gradient of a 2-process update equals a 1-process update on the union of their
batches. Then the real CLI under torchrun with `trainer=ddp`."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from posttrain.algorithms.experience import Experience
from posttrain.data.sources import build_source
from posttrain.distributed import average_gradients
from posttrain.models.loading import load_tokenizer_and_model
from posttrain.train import build_module

from test_grpo import rl_config

WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(cfg_dict):
    cfg = OmegaConf.create(cfg_dict)
    source = build_source(cfg.data)
    tokenizer, policy = load_tokenizer_and_model(cfg.model, source.alphabet)
    module = build_module(cfg, policy, tokenizer, source)
    module.setup("fit")  # the curriculum's cursor learns this process's rank here
    module.manual_backward = lambda loss: loss.backward()
    return module, tokenizer


def prompts_of(exp, tokenizer) -> list[str]:
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(exp.prompt_ids, exp.prompt_mask)]
    return sorted(set(tokenizer.batch_decode(rows)))


def rank_update(rank, port, cfg_dict, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        module, tokenizer = build(cfg_dict)
        exp, _, _ = module.collect(step=0)
        exp, _ = module.compute_advantages(module.annotate(exp))
        module.policy.zero_grad()
        module.accumulate_gradients(exp)
        average_gradients(list(module.policy.parameters()))
        torch.save({"exp": exp, "prompts": prompts_of(exp, tokenizer),
                    "grads": [p.grad for p in module.policy.parameters()]}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_ranks_draw_disjoint_prompts_and_average_to_the_union_gradient(make_config, sft_start, tmp_path):
    cfg = rl_config(make_config, sft_start, "algorithm=grpo")  # k3 KL as a loss, seq-mean-token-mean
    OmegaConf.resolve(cfg)
    cfg_dict = OmegaConf.to_container(cfg)
    mp.spawn(rank_update, args=(free_port(), cfg_dict, str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]

    single, tokenizer = build(cfg_dict)
    n = cfg.algorithm.prompts_per_step
    assert not set(ranks[0]["prompts"]) & set(ranks[1]["prompts"])  # disjoint
    union_prompts = sorted({e.prompt for e in single.curriculum.next_prompts(WORLD * n)})
    assert sorted(ranks[0]["prompts"] + ranks[1]["prompts"]) == union_prompts  # together: the 1-process stream

    parts = [r["exp"] for r in ranks]
    parts[1].group_index = parts[1].group_index + 10_000  # keep the ranks' groups apart
    union = Experience.concat(parts, tokenizer.pad_token_id)
    single.policy.zero_grad()
    single.accumulate_gradients(union)
    for name_param, g0, g1 in zip(single.policy.named_parameters(), ranks[0]["grads"], ranks[1]["grads"]):
        name, param = name_param
        torch.testing.assert_close(g0, g1, rtol=0, atol=0)  # averaged: the same on every rank
        torch.testing.assert_close(g0, param.grad, rtol=1e-4, atol=1e-7, msg=name)


def sft_rank_gradients(rank, port, cfg_dict, batches, out_dir):
    """One SFT training step's gradients on this rank's batch, as Lightning would prepare them."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        module, _ = build(cfg_dict)
        module.log = lambda *args, **kwargs: None  # no trainer here
        module.training_step(batches[rank], 0).backward()
        module.on_before_optimizer_step(None)
        torch.save([p.grad for p in module.policy.parameters()], f"{out_dir}/sft_rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_sft_ranks_average_to_the_global_token_mean_gradient(make_config, tmp_path):
    """SFT under trainer=ddp: the ranks' averaged gradient is that of one token mean over the
    union batch, also when the ranks hold different numbers of completion tokens."""
    from posttrain.data.datamodule import collate_sft

    cfg = make_config("algorithm=sft", "model.hidden_size=32", "data.min_digits=1", "data.max_digits=3")
    OmegaConf.resolve(cfg)
    cfg_dict = OmegaConf.to_container(cfg)
    single, tokenizer = build(cfg_dict)
    examples = [single.source.example("train", i) for i in range(8)]
    batches = [collate_sft(examples[:3], tokenizer), collate_sft(examples[3:], tokenizer)]  # unequal sizes
    assert (batches[0]["labels"] != -100).sum() != (batches[1]["labels"] != -100).sum()
    mp.spawn(sft_rank_gradients, args=(free_port(), cfg_dict, batches, str(tmp_path)), nprocs=WORLD, join=True)
    grads = [torch.load(tmp_path / f"sft_rank{r}.pt") for r in range(WORLD)]

    single.log = lambda *args, **kwargs: None
    single.training_step(collate_sft(examples, tokenizer), 0).backward()
    for (name, param), g0, g1 in zip(single.policy.named_parameters(), *grads):
        torch.testing.assert_close(g0, g1, rtol=0, atol=0)  # averaged: the same on every rank
        torch.testing.assert_close(g0, param.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_the_cli_trains_with_two_processes_under_torchrun(sft_start, tmp_path):
    overrides = ["trainer=ddp", "algorithm=grpo", f"model.init_from={sft_start}", "data.min_digits=2",
                 "data.max_digits=2", "algorithm.prompts_per_step=2", "algorithm.group_size=4",
                 "trainer.max_steps=2", "trainer.val_check_interval=2", "callbacks.checkpoint.every_n_train_steps=2",
                 "eval.num_prompts=32", "eval.batch_size=32", "logger=csv", "callbacks.progress_bar=none",
                 f"hydra.run.dir={tmp_path}/run", f"paths.cache_dir={tmp_path}/cache"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             "-m", "posttrain.train", *overrides], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["global_step"] == 2 and "eval/accuracy" in summary
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()


def test_a_multi_process_run_refuses_to_train_an_uncached_warm_start(make_config, monkeypatch, tmp_path):
    """Every process would train its own copy and race for the cache: a clear error instead."""
    from posttrain.errors import ConfigError
    from posttrain.warm_start import warm_start

    cfg = make_config("experiment=grpo_tiny", f"paths.cache_dir={tmp_path}/cache")
    OmegaConf.resolve(cfg)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="not cached yet"):
        warm_start(cfg)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("hf_model"))
