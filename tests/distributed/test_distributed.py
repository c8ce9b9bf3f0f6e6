"""Data parallelism on CPU with gloo, 2 processes: the ranks draw disjoint prompts, and the
averaged gradient of a 2-process update equals a 1-process update on the union of their
batches. Then the real CLI under torchrun with `trainer=ddp`."""

import json
import os
import subprocess

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from posttrain.algorithms.experience import Experience
from posttrain.data.sources import build_source
from posttrain.distributed.collectives import average_gradients
from posttrain.models.loading import load_tokenizer_and_model
from posttrain.train import build_module

from conftest import TORCHRUN, free_port, rl_config, run_ranks

WORLD = 2


def build(cfg_dict):
    cfg = OmegaConf.create(cfg_dict)
    source = build_source(cfg.data)
    tokenizer, policy = load_tokenizer_and_model(cfg.model, source.alphabet)
    module = build_module(cfg, policy, tokenizer, source)
    module.setup("fit")  # the curriculum's cursor learns this process's rank here
    module.manual_backward = lambda loss: loss.backward()
    if hasattr(module, "learner"):  # online RL: the learner backwards through its steppers
        module.learner.steppers.backward = module.manual_backward
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
        module.learner.accumulate_gradients(exp)
        average_gradients(list(module.policy.parameters()))
        torch.save({"exp": exp, "prompts": prompts_of(exp, tokenizer),
                    "grads": [p.grad for p in module.policy.parameters()]}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_ranks_draw_disjoint_prompts_and_average_to_the_union_gradient(make_config, sft_start, tmp_path):
    cfg = rl_config(make_config, sft_start, "algorithm=grpo")  # k3 KL as a loss, seq-mean-token-mean
    OmegaConf.resolve(cfg)
    cfg_dict = OmegaConf.to_container(cfg)
    run_ranks(rank_update, free_port(), cfg_dict, str(tmp_path))
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
    single.learner.accumulate_gradients(union)
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
    run_ranks(sft_rank_gradients, free_port(), cfg_dict, batches, str(tmp_path))
    grads = [torch.load(tmp_path / f"sft_rank{r}.pt") for r in range(WORLD)]

    single.log = lambda *args, **kwargs: None
    single.training_step(collate_sft(examples, tokenizer), 0).backward()
    for (name, param), g0, g1 in zip(single.policy.named_parameters(), *grads):
        torch.testing.assert_close(g0, g1, rtol=0, atol=0)  # averaged: the same on every rank
        torch.testing.assert_close(g0, param.grad, rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.slow  # the README's torchrun command runs the same job in CI
def test_the_cli_trains_with_two_processes_under_torchrun(sft_start, tmp_path):
    overrides = ["trainer=ddp", "algorithm=grpo", f"model.init_from={sft_start}", "data.min_digits=2",
                 "data.max_digits=2", "algorithm.prompts_per_step=2", "algorithm.group_size=4",
                 "trainer.max_steps=2", "trainer.val_check_interval=2", "callbacks.checkpoint.every_n_train_steps=2",
                 "eval.num_prompts=32", "eval.batch_size=32", "logger=csv", "callbacks.progress_bar=none",
                 f"hydra.run.dir={tmp_path}/run", f"paths.cache_dir={tmp_path}/cache"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([*TORCHRUN, "-m", "posttrain.train", *overrides], capture_output=True, text=True, env=env,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["global_step"] == 2 and "eval/accuracy" in summary
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.slow  # 21 s; one warm start shared by concurrent processes runs in CI in tests/run/test_sweeps.py
def test_rank_0_of_a_torchrun_job_trains_the_warm_start_once_and_every_rank_starts_from_it(tmp_path):
    """An uncached warm start in a job of 2 ranks: rank 0 trains it alone (its trainer joins
    no process group: the other rank is not in one yet), rank 1 waits for the cache entry,
    then both train GRPO from it."""
    overrides = ["trainer=ddp", "algorithm=grpo", "algorithm.warm_start.steps=4",
                 "algorithm.warm_start.until_accuracy=null", "data.min_digits=2", "data.max_digits=2",
                 "algorithm.prompts_per_step=2", "algorithm.group_size=4", "trainer.max_steps=1", "eval.at_start=false", "eval.num_prompts=16", "eval.batch_size=16",
                 "logger=none", "callbacks.progress_bar=none", "num_threads=1",
                 f"hydra.run.dir={tmp_path}/run", f"paths.cache_dir={tmp_path}/cache"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([*TORCHRUN, "-m", "posttrain.train", *overrides], capture_output=True, text=True, env=env,
                            timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert output.count("Warm start: SFT for 4 steps") == 1, output[-3000:]  # trained once, by one rank
    # rank 1 waited for rank 0, unless it reached the cache after rank 0's 4 steps were done (a
    # race the scheduler decides: the waiting itself is test_ranks_of_a_job_wait_for_rank_0_...)
    assert output.count("Warm start: rank 1 of 2 waits for rank 0") <= 1, output[-3000:]
    (entry,) = (tmp_path / "cache" / "warm_start").iterdir()  # one entry; no lock file or scratch left
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["global_step"] == 1 and summary["warm_start"] == str(entry / "hf_model")


def test_ranks_of_a_job_wait_for_rank_0_and_stop_when_it_never_trains(make_config, monkeypatch, tmp_path):
    """A rank other than 0 never trains the warm start: it waits as long as the lock is held
    (rank 0 training), and stops with an error when nobody has held it for RANK_ZERO_START_S
    (rank 0 failed) instead of waiting for the job's time limit."""
    import threading

    import posttrain.prepare.cache as cache_module
    import posttrain.prepare.warm_start as warm_start_module
    from posttrain.errors import CheckpointError
    from posttrain.train import run

    cfg = make_config("algorithm=grpo", f"paths.cache_dir={tmp_path}/cache")
    OmegaConf.resolve(cfg)
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SUBMITIT_LOCAL_GLOBALID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "1")  # a SLURM job's second task
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setattr(cache_module, "RANK_ZERO_START_S", 0.2)
    monkeypatch.setattr(cache_module, "POLL_S", 0.05)
    monkeypatch.setattr(warm_start_module, "train_warm_start", lambda *args: pytest.fail("rank 1 trained"))
    with pytest.raises(CheckpointError, match="rank 0 of this job has not held its lock"):
        warm_start_module.warm_start(cfg, train=run)

    _, target = warm_start_module.warm_start_plan(cfg)
    with cache_module.cache_lock(target):  # rank 0 trains it, for longer than RANK_ZERO_START_S
        finish = threading.Timer(1.0, lambda: (target / "hf_model").mkdir(parents=True))
        finish.start()
        assert warm_start_module.warm_start(cfg, train=run) == str(target / "hf_model")
    assert finish.finished.is_set()
