"""Preference learning under data parallelism, 2 processes on CPU (gloo), through `posttrain.train.run`
as torchrun starts it (LOCAL_RANK set: Lightning does not spawn). DPO (trainer=ddp and
trainer=fsdp) and the Bradley–Terry reward model (trainer=ddp): the ranks train on disjoint
halves of each global batch, and end with the weights and held-out metrics of a 1-process run
at the same global batch; DPO's reference log-probs are computed by each rank for its share
of the pairs and then held whole by every rank; only rank 0 writes files."""

import json
import os

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from posttrain.data.sources import ArithmeticSource

from conftest import EASY_TASK, FAST_RUN, compose_config, free_port, run_ranks

WORLD = 2
STEPS = 3
LR = 3.0e-3
PAIRS_PER_RANK = 2
TRAIN_PAIRS, VALIDATION_PAIRS = 24, 5  # an odd held-out count: the ranks' shares differ
SMALL_MODEL = ("model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=2",
               "model.intermediate_size=64")


def write_pairs(path):
    """A local jsonl shaped like a real preference dataset: prompt, chosen, rejected columns."""
    task = ArithmeticSource()
    rows = []
    for i in range(TRAIN_PAIRS + VALIDATION_PAIRS):
        example = task.example("train", i)
        wrong = example.response[:-1] + str((int(example.response[-1]) + 1) % 10)
        rows.append({"prompt": example.prompt, "chosen": example.response, "rejected": wrong})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def preference_config(out_dir, pairs_file, algorithm, pairs_per_process, *overrides):
    cfg = compose_config([*FAST_RUN, *EASY_TASK, *SMALL_MODEL, f"algorithm={algorithm}", "algorithm.warm_start.steps=0",
                          "preference.source=dataset", f"preference.path={pairs_file}",
                          f"preference.validation_size={VALIDATION_PAIRS}", f"algorithm.batch_size={pairs_per_process}",
                          f"trainer.max_steps={STEPS}", f"trainer.val_check_interval={STEPS}",
                          f"callbacks.checkpoint.every_n_train_steps={STEPS}", "eval.num_prompts=8",
                          "eval.batch_size=8", "eval.at_start=false", "num_threads=1",
                          f"algorithm.optim.lr={LR}", "algorithm.optim.warmup_steps=0", f"paths.cache_dir={out_dir}/cache",
                          *overrides], out_dir)
    OmegaConf.resolve(cfg)
    return cfg


def recording_modules(setattr=setattr):
    """Every preference module built in this process (with its starting weights), and the
    prompts of the pairs each training step saw."""
    from posttrain.algorithms.preference import PreferenceModule
    from posttrain.algorithms.reward_model import RewardModelModule

    built, seen = [], []
    for module_class in (PreferenceModule, RewardModelModule):
        def recording_init(self, *args, init=module_class.__init__, **kwargs):
            init(self, *args, **kwargs)
            self.start_weights = {k: v.detach().clone() for k, v in self.policy.state_dict().items()}
            built.append(self)

        def recording_step(self, batch, batch_idx, step=module_class.training_step):
            seen.append([pair.prompt for pair in batch["pairs"]])
            return step(self, batch, batch_idx)

        setattr(module_class, "__init__", recording_init)
        setattr(module_class, "training_step", recording_step)
    return built, seen


def run_as_rank(rank, world, port, cfg_dict, out_dir, record):
    """`posttrain` as rank `rank` of `world` under torchrun (LOCAL_RANK set: Lightning does not
    spawn), then `record(summary)` saved to `out_dir`/record<rank>.pt."""
    from posttrain.train import run

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), RANK=str(rank),
                      NODE_RANK="0", WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        summary = run(OmegaConf.create(cfg_dict), announce=False)
        torch.save(record(summary), f"{out_dir}/record{rank}.pt")
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_worker(rank, world, port, cfg_dicts, out_dir):
    """One rank of `posttrain` under torchrun; each rank has its own paths.output_dir and
    paths.cache_dir, so what a rank other than 0 writes shows."""
    from posttrain.distributed.sharding import full_state_dict

    built, seen = recording_modules()

    def record(summary):
        module = built[-1]
        return {"summary": summary, "seen": seen, "reference_forwards": getattr(module, "reference_forwards", 0),
                "reference_logps": getattr(module, "reference_logps", {}),
                "weights": full_state_dict(module.policy, rank0_only=False),  # gathered from the shards under fsdp
                "start_weights": module.start_weights}

    run_as_rank(rank, world, port, cfg_dicts[rank], out_dir, record)


DDP = ("trainer=ddp", "trainer.strategy._target_=posttrain.distributed.sharding.PosttrainModelParallelStrategy")


def two_process_run(out, algorithm, *trainer) -> list[dict]:
    pairs_file = write_pairs(out / "pairs.jsonl")
    cfgs = [preference_config(out / f"rank{r}", pairs_file, algorithm, PAIRS_PER_RANK, *trainer) for r in range(WORLD)]
    run_ranks(run_worker, WORLD, free_port(), [OmegaConf.to_container(c) for c in cfgs], str(out))
    return [torch.load(out / f"record{r}.pt", weights_only=False) for r in range(WORLD)]


def one_process_run(out, algorithm) -> dict:
    """The same run in this process, at the same global batch (WORLD x PAIRS_PER_RANK pairs)."""
    from posttrain.train import run

    out.mkdir(parents=True, exist_ok=True)
    with pytest.MonkeyPatch.context() as patch:
        built, seen = recording_modules(patch.setattr)
        cfg = preference_config(out, write_pairs(out / "pairs.jsonl"), algorithm, WORLD * PAIRS_PER_RANK)
        summary = run(cfg, announce=False)
    return {"summary": summary, "seen": seen, "module": built[-1]}


@pytest.fixture(scope="module")
def dpo_single(tmp_path_factory):
    return one_process_run(tmp_path_factory.mktemp("dpo_single"), "dpo")


@pytest.fixture(scope="module")
def reward_model_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("reward_model")
    return two_process_run(out, "reward_model", *DDP), one_process_run(out / "single", "reward_model"), out


def check_only_rank_0_wrote(tmp_path):
    written = sorted(str(p.relative_to(tmp_path / "rank1")) for p in (tmp_path / "rank1").rglob("*") if p.is_file())
    assert written == [], written
    assert (tmp_path / "rank0" / "summary.json").is_file() and (tmp_path / "rank0" / "hf_model").is_dir()
    assert (tmp_path / "rank0" / "checkpoints" / "last.ckpt").exists()


def check_disjoint_halves_of_the_global_batches(ranks, single):
    assert len(ranks[0]["seen"]) == len(ranks[1]["seen"]) == len(single["seen"]) == STEPS
    for step, (mine, theirs, whole) in enumerate(zip(ranks[0]["seen"], ranks[1]["seen"], single["seen"])):
        assert len(mine) == len(theirs) == PAIRS_PER_RANK, step
        assert sorted(mine + theirs) == sorted(whole), step  # together: the 1-process batch


def check_same_weights(ranks, single):
    expected = single["module"].policy.state_dict()
    for name, value in ranks[0]["weights"].items():
        torch.testing.assert_close(ranks[1]["weights"][name], value, rtol=0, atol=0, msg=name)
        if name.endswith("k_proj.bias"):
            # its exact gradient is 0 (a key bias adds the same q.b to every score of a query, and
            # softmax ignores that), so AdamW normalises rounding noise into steps of up to lr:
            # the two runs' noise differs, only its bound is comparable
            torch.testing.assert_close(value, expected[name], rtol=0, atol=STEPS * LR, msg=name)
            continue
        torch.testing.assert_close(value, expected[name], rtol=0, atol=5e-5, msg=name)  # AdamW: tiny gradients round apart
    moved = max(float((ranks[0]["weights"][k] - v).abs().max()) for k, v in ranks[0]["start_weights"].items())
    assert moved > 1e-3  # the steps changed the weights, by far more than the tolerance


# fsdp: the same run sharded; slow only for its cost (~40 s on 2 busy cores), run it with -m slow
@pytest.mark.parametrize("trainer", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_two_process_dpo_equals_one_process_at_the_same_global_batch(trainer, dpo_single, tmp_path):
    ranks, single = two_process_run(tmp_path, "dpo", *(DDP if trainer == "ddp" else ("trainer=fsdp",))), dpo_single
    check_disjoint_halves_of_the_global_batches(ranks, single)
    check_same_weights(ranks, single)

    # the reference cache: each rank scored its share of the pairs, every rank holds them all,
    # equal to the 1-process cache
    module = single["module"]
    for split in ("train", "validation"):
        for rank in ranks:
            torch.testing.assert_close(rank["reference_logps"][split], module.reference_logps[split],
                                       rtol=1e-5, atol=1e-5)
    # each rank scores every other pair, in batches of 2; a shorter share ends with a stand-in
    # pair, so that every rank runs as many forwards (each a collective under fsdp)
    forwards = [rank["reference_forwards"] for rank in ranks]
    rounds = sum(-(-count // (WORLD * PAIRS_PER_RANK)) for count in (TRAIN_PAIRS, VALIDATION_PAIRS))
    assert forwards == [rounds] * WORLD

    # held-out metrics are reduced over the ranks: the 1-process run's
    for name in ("eval/loss", "eval/rewards/accuracy", "eval/rewards/margins", "eval/accuracy", "train/loss"):
        assert ranks[0]["summary"][name] == pytest.approx(single["summary"][name], abs=1e-4), name
    assert ranks[0]["summary"]["eval/rewards/margins"] != 0.0  # the policy moved from its reference
    check_only_rank_0_wrote(tmp_path)


def test_two_process_reward_model_equals_one_process_at_the_same_global_batch(reward_model_runs):
    ranks, single, out = reward_model_runs
    check_disjoint_halves_of_the_global_batches(ranks, single)
    check_same_weights(ranks, single)
    check_only_rank_0_wrote(out)


def test_two_process_reward_model_pair_accuracy_counts_each_held_out_pair_once(reward_model_runs):
    ranks, single, _ = reward_model_runs
    for name in ("eval/pair_accuracy", "eval/rewards/chosen", "eval/rewards/margin"):
        assert ranks[0]["summary"][name] == pytest.approx(single["summary"][name], abs=1e-5), name
