"""FSDP2 (trainer=fsdp) and plain data parallelism (trainer=ddp) on CPU with gloo, 2
processes, through Lightning's real fit loop: a GRPO run gives the same losses and weights
as a 1-process run replaying the union of the ranks' rollout batches; generation sees the
full weights; the Hugging Face export is the full model; a distributed (sharded) checkpoint
resumes, also on another number of ranks, and a ddp checkpoint resumes; bf16 mixed
precision keeps fp32 master weights; the CLI trains under torchrun with trainer=fsdp."""

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint  # noqa: F401 - torch.distributed.checkpoint.FileSystemReader below
from hydra.utils import instantiate
from omegaconf import OmegaConf

from posttrain.algorithms.experience import Experience
from posttrain.run.callbacks import RunRecord
from posttrain.data.datamodule import PosttrainDataModule, collate_prompts
from posttrain.data.sources import build_source
from posttrain.models.loading import load_tokenizer_and_model
from posttrain.rollout import SamplingParams
from posttrain.distributed.sharding import consolidated_model, full_state_dict
from posttrain.run.callbacks import build_callbacks
from posttrain.train import build_module
from posttrain.files import save_pretrained_atomic

from conftest import EASY_TASK, FAST_RUN, TORCHRUN, compose_config, free_port, run_ranks

WORLD = 2
STEPS = 3
GENERATION_PROMPTS = 8
# A small random model (no warm start): the reward below gives its random samples a spread,
# so every group has a learning signal.
SMALL_MODEL = ("model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=2",
               "model.intermediate_size=64")


def digit_share(samples, source):
    """Share of digits in a response: differs between the random samples of a group."""
    return [sum(c.isdigit() for c in s.response) / max(1, len(s.response)) for s in samples]


def grpo_config(out_dir, *overrides):
    return compose_config([*FAST_RUN, *EASY_TASK, *SMALL_MODEL, "algorithm=grpo", "algorithm.warm_start.steps=0",
                           "+reward.components.digits._target_=test_fsdp.digit_share", "algorithm.prompts_per_step=4",
                           "algorithm.group_size=4", f"trainer.max_steps={STEPS}",
                           "eval.at_start=false", "eval.num_prompts=16", "eval.batch_size=16", *overrides], out_dir)


def build_run(cfg):
    source = build_source(cfg.data)
    tokenizer, policy = load_tokenizer_and_model(cfg.model, source.alphabet)
    module = build_module(cfg, policy, tokenizer, source)
    datamodule = PosttrainDataModule(source, tokenizer, batch_size=module.batch_size,
                                     train_collate=module.train_collate, eval_split=cfg.eval.split,
                                     eval_num_prompts=cfg.eval.num_prompts, eval_batch_size=cfg.eval.batch_size,
                                     seed=cfg.seed)
    return source, tokenizer, module, datamodule


def record_updates(module) -> list[dict]:
    """Each rollout batch the update stage trained on, with its stats."""
    records, update = [], module.update

    def recording_update(exp, has_signal=True):
        stats = update(exp, has_signal)
        records.append({"exp": copy.deepcopy(exp), "has_signal": has_signal, "stats": stats})
        return stats

    module.update = recording_update
    return records


def greedy_generation(module, source, tokenizer) -> torch.Tensor:
    batch = collate_prompts([source.example("validation", i) for i in range(GENERATION_PROMPTS)], tokenizer)
    params = SamplingParams(max_new_tokens=8, greedy=True, temperature=0.0)
    return module.generate(batch["prompt_ids"], batch["prompt_mask"], params).response_ids


def fit_worker(rank, world, port, cfg_dict, out_dir, ckpt_path):
    """One rank of `posttrain` under trainer=fsdp or ddp, launched as torchrun would (LOCAL_RANK set:
    Lightning does not spawn), saving what the test compares."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), RANK=str(rank),
                      NODE_RANK="0", WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    cfg = OmegaConf.create(cfg_dict)
    source, tokenizer, module, datamodule = build_run(cfg)
    records = record_updates(module)
    trainer = instantiate(cfg.trainer, logger=False, enable_progress_bar=False,
                          callbacks=build_callbacks(cfg, out_dir) + [RunRecord(cfg.algorithm.name)])
    started = {}
    module.on_train_start = lambda: started.update(  # after any restore; a copy: the weights train on
        weights={k: v.clone() for k, v in full_state_dict(module.policy).items()})
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
        trainer.save_checkpoint(out_dir / "final.ckpt")  # at the exported step (the periodic ones come every 2)
        sharded = any(type(p).__name__ == "DTensor" for p in module.policy.parameters())
        generation = greedy_generation(module, source, tokenizer)
        weights = full_state_dict(module.policy)
        export = consolidated_model(module.policy)  # every rank gathers, rank 0 writes
        if rank == 0:
            save_pretrained_atomic(export, tokenizer, out_dir / "hf_model")
        torch.save({"records": records, "weights": weights, "start_weights": started.get("weights"),
                    "generation": generation, "sharded": sharded, "global_step": trainer.global_step},
                   out_dir / f"rank{rank}.pt")
        dist.barrier()  # no rank tears the group down while another still talks to it (an abort at exit)
    finally:
        dist.destroy_process_group()


def spawn_fit(cfg, out_dir, world=WORLD, ckpt_path=None) -> list[dict]:
    OmegaConf.resolve(cfg)
    run_ranks(fit_worker, world, free_port(), OmegaConf.to_container(cfg), out_dir, ckpt_path, world=world)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


# trainer=ddp resumes through posttrain's strategy (Lightning's reads only sharded models)
DDP = ("trainer=ddp", "trainer.strategy._target_=posttrain.distributed.sharding.PosttrainModelParallelStrategy")


def two_process_run(out, *trainer):
    cfg = grpo_config(out, *trainer, f"trainer.val_check_interval={STEPS}",
                      "callbacks.checkpoint.every_n_train_steps=2")
    return cfg, spawn_fit(cfg, out), out


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """A 2-process GRPO run under trainer=fsdp (k3 KL as a loss: a sharded frozen reference)."""
    return two_process_run(tmp_path_factory.mktemp("fsdp_run"), "trainer=fsdp")


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """The same run under trainer=ddp (whole models, gradients averaged by hand)."""
    return two_process_run(tmp_path_factory.mktemp("ddp_run"), *DDP)


@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_a_two_process_grpo_run_equals_one_process_on_the_union_batches(kind, request, tmp_path):
    cfg, ranks, _ = request.getfixturevalue(f"{kind}_run")
    assert all(r["sharded"] == (kind == "fsdp") for r in ranks) and ranks[0]["global_step"] == STEPS
    steps = list(zip(*(r["records"] for r in ranks)))
    assert len(steps) == STEPS and all(any(rec["has_signal"] for rec in step) for step in steps)

    # the 1-process run: the same config on one process, its rollout replaced by the union
    # of the two ranks' batches (their groups kept apart)
    single_cfg = grpo_config(tmp_path, "+trainer.limit_val_batches=0")
    OmegaConf.resolve(single_cfg)
    _, tokenizer, single, datamodule = build_run(single_cfg)
    unions = []
    for step in steps:
        parts = [copy.deepcopy(rec["exp"]) for rec in step]
        parts[1].group_index = parts[1].group_index + 10_000
        unions.append(Experience.concat(parts, tokenizer.pad_token_id))
    single.collect = lambda step: (unions[step], {}, True)
    replay = record_updates(single)
    trainer = instantiate(single_cfg.trainer, logger=False, enable_progress_bar=False, enable_checkpointing=False)
    trainer.fit(single, datamodule=datamodule)

    for index, (step, one) in enumerate(zip(steps, replay)):
        # each rank's loss is its share of the global loss (global token counts, x dp_size)
        two = sum(rec["stats"]["policy/loss"] for rec in step) / WORLD
        assert two == pytest.approx(one["stats"]["policy/loss"], abs=1e-5), f"step {index}"
        assert ranks[0]["records"][index]["stats"]["policy/grad_norm"] == pytest.approx(
            one["stats"]["policy/grad_norm"], rel=1e-4)
    expected = single.policy.state_dict()
    for name, value in ranks[0]["weights"].items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-5, msg=name)
    moved = max(float((ranks[0]["weights"][k] - v).abs().max()) for k, v in ranks[0]["start_weights"].items())
    assert moved > 1e-4  # the steps did change the weights, by far more than the tolerance


def test_generation_under_fsdp_sees_the_full_weights(fsdp_run):
    cfg, ranks, _ = fsdp_run
    source = build_source(cfg.data)
    tokenizer, policy = load_tokenizer_and_model(cfg.model, source.alphabet)
    policy.load_state_dict(ranks[0]["weights"])
    plain = build_module(cfg, policy, tokenizer, source)
    expected = greedy_generation(plain, source, tokenizer)
    for rank in ranks:
        assert torch.equal(rank["generation"], expected)


def test_the_hf_export_of_an_fsdp_run_is_the_full_model(fsdp_run):
    from transformers import AutoModelForCausalLM

    _, ranks, out = fsdp_run
    exported = AutoModelForCausalLM.from_pretrained(out / "hf_model")
    state = exported.state_dict()
    assert state.keys() == ranks[0]["weights"].keys()
    for name, value in ranks[0]["weights"].items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)


def test_a_sharded_checkpoint_starts_a_one_process_run_with_the_full_policy(fsdp_run):
    """model.init_from=<a trainer=fsdp checkpoint directory>, in a process with no process
    group: the policy gets the whole trained weights, those of the run's HF export."""
    from transformers import AutoModelForCausalLM

    cfg, _, out = fsdp_run
    assert not dist.is_initialized()
    single_cfg = copy.deepcopy(cfg)
    single_cfg.model.init_from = str(out / "final.ckpt")  # a directory of shards, at the exported step
    _, policy = load_tokenizer_and_model(single_cfg.model, build_source(cfg.data).alphabet)
    exported = AutoModelForCausalLM.from_pretrained(out / "hf_model").state_dict()
    assert policy.state_dict().keys() == exported.keys()
    for name, value in policy.state_dict().items():
        torch.testing.assert_close(value, exported[name], rtol=0, atol=0, msg=name)

    single_cfg.model.init_from = str(out / "checkpoints" / "step000002.ckpt")  # an earlier step: other weights
    _, earlier = load_tokenizer_and_model(single_cfg.model, build_source(cfg.data).alphabet)
    assert any(not torch.equal(v, exported[k]) for k, v in earlier.state_dict().items())


def test_a_sharded_checkpoint_resumes_exactly_and_on_another_number_of_ranks(fsdp_run, tmp_path):
    cfg, ranks, out = fsdp_run
    checkpoint = out / "checkpoints" / "step000002.ckpt"
    assert checkpoint.is_dir() and (checkpoint / "meta.pt").is_file()  # one shard per rank
    assert not list((out / "checkpoints").glob(".*"))  # written beside, then swapped in: nothing left over
    # the frozen reference is rebuilt from its config, not stored
    stored = torch.distributed.checkpoint.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    assert any(k.startswith("state_dict.policy.") for k in stored)
    assert not any(k.startswith("state_dict.reference.") for k in stored)

    # 2 ranks: resuming at step 2 and training to step 3 gives the uninterrupted run's weights
    resumed_cfg = copy.deepcopy(cfg)
    resumed_cfg.paths.output_dir = str(tmp_path / "resumed")
    resumed_cfg.trainer.default_root_dir = str(tmp_path / "resumed")
    resumed = spawn_fit(resumed_cfg, tmp_path / "resumed", ckpt_path=str(checkpoint))
    assert resumed[0]["global_step"] == STEPS and len(resumed[0]["records"]) == 1
    for name, value in ranks[0]["weights"].items():
        torch.testing.assert_close(resumed[0]["weights"][name], value, rtol=0, atol=1e-6, msg=name)

    # 1 rank (FSDP over a mesh of one): the same weights at step 2 as the 2-rank resume loaded
    one_cfg = copy.deepcopy(cfg)
    one_cfg.trainer.devices = 1
    one_cfg.trainer.strategy.data_parallel_size = 1
    one_cfg.trainer.max_steps = 2
    one_cfg.paths.output_dir = one_cfg.trainer.default_root_dir = str(tmp_path / "one")
    one = spawn_fit(one_cfg, tmp_path / "one", world=1, ckpt_path=str(checkpoint))
    assert one[0]["global_step"] == 2 and not one[0]["records"]  # loaded, nothing left to train
    for name, value in resumed[0]["start_weights"].items():
        torch.testing.assert_close(one[0]["weights"][name], value, rtol=0, atol=0, msg=name)


def test_a_ddp_checkpoint_resumes_exactly(ddp_run, tmp_path):
    cfg, ranks, out = ddp_run
    checkpoint = out / "checkpoints" / "step000002.ckpt"
    assert checkpoint.is_file()  # save_distributed_checkpoint=false: one ordinary file
    resumed_cfg = copy.deepcopy(cfg)
    resumed_cfg.paths.output_dir = resumed_cfg.trainer.default_root_dir = str(tmp_path)
    resumed = spawn_fit(resumed_cfg, tmp_path, ckpt_path=str(checkpoint))
    assert resumed[0]["global_step"] == STEPS and len(resumed[0]["records"]) == 1
    for name, value in ranks[0]["weights"].items():
        torch.testing.assert_close(resumed[0]["weights"][name], value, rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow  # 20 s; FSDP2 trains on 2 ranks in CI in tests/distributed/test_uneven_ranks.py and the cases above
def test_the_cli_trains_with_fsdp_under_torchrun(tmp_path):
    """run() end to end: held-out evaluation before and after (generation gathers the
    weights), a distributed checkpoint directory, the consolidated Hugging Face export."""
    import json
    import subprocess

    from transformers import AutoModelForCausalLM

    overrides = [*FAST_RUN, *EASY_TASK, *SMALL_MODEL, "trainer=fsdp", "algorithm=grpo", "algorithm.warm_start.steps=0",
                 "+reward.components.digits._target_=test_fsdp.digit_share", "algorithm.prompts_per_step=2",
                 "algorithm.group_size=4", "trainer.max_steps=2", "trainer.val_check_interval=2",
                 "callbacks.checkpoint.every_n_train_steps=2", "eval.num_prompts=16", "eval.batch_size=16",
                 "logger=csv", f"hydra.run.dir={tmp_path}/run", f"paths.cache_dir={tmp_path}/cache"]
    here, tests_dir = os.path.dirname(__file__), os.path.dirname(os.path.dirname(__file__))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",  # the reward above (and the conftest it imports)
           "PYTHONPATH": os.pathsep.join([here, tests_dir, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([*TORCHRUN, "-m", "posttrain.train", *overrides], capture_output=True, text=True, env=env,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "run"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["global_step"] == 2 and "eval/accuracy" in summary and "eval/accuracy_start" in summary
    assert (run_dir / "checkpoints" / "last.ckpt" / "meta.pt").is_file()  # a distributed checkpoint
    exported = AutoModelForCausalLM.from_pretrained(run_dir / "hf_model")
    assert exported.config.hidden_size == 32 and exported.dtype == torch.float32


def test_a_critic_on_the_policy_backbone_is_refused_under_fsdp_before_anything_is_built(tmp_path):
    """Its value head would read the sharded policy's decoder outside the policy's forward (see
    sharding.shard_module); its own backbone under fsdp, and a shared one under ddp, are fine."""
    from posttrain.config.check import check_config
    from posttrain.errors import ConfigError

    with pytest.raises(ConfigError, match=r"roles.critic.shared_backbone=true is not supported with trainer=fsdp"):
        check_config(compose_config(["algorithm=ppo", "trainer=fsdp", "roles.critic.shared_backbone=true"], tmp_path),
                     {})
    check_config(compose_config(["algorithm=ppo", "trainer=fsdp"], tmp_path), {})
    check_config(compose_config(["algorithm=ppo", "trainer=ddp", "roles.critic.shared_backbone=true"], tmp_path), {})


class Roles(torch.nn.Module):
    """Just what `shard_module` reads of a PosttrainModule: roles, the mesh, the strategy."""

    def __init__(self, policy, reference, sharding, mesh):
        super().__init__()
        self.policy, self.reference, self.critic = policy, reference, None
        self.device_mesh = mesh
        self._trainer = type("Trainer", (), {"strategy": type("Strategy", (), {"sharding": sharding})})()

    def frozen_roles(self):
        return ["reference"]


def mixed_precision_worker(rank, port, out_dir):
    from torch.distributed.device_mesh import init_device_mesh

    from posttrain.models.tiny import build_tiny_model
    from posttrain.distributed.sharding import ShardingPolicy, shard_module

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("data_parallel",))
        results = {}
        for checkpointing in (False, True):
            policy = build_tiny_model(vocab_size=16, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2,
                                      intermediate_size=64).to(torch.bfloat16)  # loaded in bf16
            reference = copy.deepcopy(policy).float().requires_grad_(False)
            sharding = ShardingPolicy(param_dtype="bfloat16", reduce_dtype="float32",
                                      activation_checkpointing=checkpointing, frozen_roles="replicate_bf16")
            roles = Roles(policy, reference, sharding, mesh)
            shard_module(roles)
            policy.train()
            ids = torch.randint(2, 16, (2, 6), generator=torch.Generator().manual_seed(rank))
            logits = policy(input_ids=ids).logits
            logits.float().logsumexp(-1).mean().backward()
            params = list(policy.parameters())
            before = [p.detach().full_tensor().clone() for p in params]
            torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0).step()
            after = [p.detach().full_tensor() for p in params]
            results[checkpointing] = {
                "logits_dtype": logits.dtype, "param_dtypes": {p.dtype for p in params},
                "param_types": {type(p).__name__ for p in params},
                "grad_dtypes": {p.grad.dtype for p in params}, "grads": [p.grad.full_tensor() for p in params],
                "reference": {(type(p).__name__, p.dtype) for p in reference.parameters()},
                "before": before, "after": after, "checkpointing": policy.is_activation_checkpointing,
            }
        torch.save(results, out_dir / f"mp{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_mixed_precision_keeps_fp32_master_weights_and_small_updates(tmp_path):
    """param_dtype=bfloat16: the blocks compute in bf16, but the sharded master weights and
    the reduced gradients are fp32, so an AdamW step of 1e-5 changes (nearly) every weight
    where pure-bf16 weights would round most of it away. Frozen roles in replicate_bf16 are
    whole bf16 copies; activation checkpointing gives the same gradients."""
    run_ranks(mixed_precision_worker, free_port(), tmp_path)
    result = torch.load(tmp_path / "mp0.pt", weights_only=False)
    plain, checkpointed = result[False], result[True]
    assert plain["logits_dtype"] == torch.bfloat16
    assert plain["param_dtypes"] == {torch.float32} and plain["param_types"] == {"DTensor"}
    assert plain["grad_dtypes"] == {torch.float32}
    assert plain["reference"] == {("Parameter", torch.bfloat16)}
    changed = sum(int((a != b).sum()) for a, b in zip(plain["after"], plain["before"]))
    kept_in_bf16 = sum(int((a.bfloat16() != b.bfloat16()).sum()) for a, b in zip(plain["after"], plain["before"]))
    total = sum(b.numel() for b in plain["before"])
    assert changed > 0.95 * total and kept_in_bf16 < 0.5 * total
    assert checkpointed["checkpointing"] and not plain["checkpointing"]
    for a, b in zip(plain["grads"], checkpointed["grads"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
