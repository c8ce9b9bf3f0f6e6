"""Decisions taken from metrics are global, and fit start does only what a resume needs.

* 2 processes (gloo): the adaptive KL controller, the difficulty schedule and the whitening of
  advantages read the statistics of every rank's rows, so every rank holds one state, that of a
  1-process run on the union of the ranks' batches.
* One process, with a strategy that restores the checkpoint after on_fit_start (as trainer=ddp
  and fsdp do): a resumed pass-rate filter trains on the restored kept prompts without
  re-estimating, and the starting weights are fingerprinted only when a curriculum reads them.
"""

import os

import lightning as L
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from posttrain.algorithms.experience import Experience

from conftest import EASY_TASK, FAST_RUN, compose_config, free_port, restores_after_fit_start, run_ranks
from test_fsdp import SMALL_MODEL, build_run

WORLD = 2
INIT_BETA, TARGET_KL, HORIZON = 0.05, 0.1, 10.0
ACCURACY_THRESHOLD = 0.8


def rank_accuracy(samples, source):
    """Every answer right on rank 0, every one wrong on rank 1 (one process: rank 0): the
    global accuracy, 0.5, is neither rank's."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return [1.0 if rank == 0 else 0.0] * len(samples)


def decisions_config(out_dir):
    cfg = compose_config([*FAST_RUN, *EASY_TASK, *SMALL_MODEL, "algorithm=grpo", "algorithm.warm_start.steps=0",
                          "algorithm.prompts_per_step=2", "algorithm.group_size=4", "advantage=reinforce_pp",
                          "rollout.max_new_tokens=8", f"paths.cache_dir={out_dir}/cache",
                          "kl_estimator.controller=adaptive", f"kl_estimator.coef={INIT_BETA}",
                          f"kl_estimator.target={TARGET_KL}", f"kl_estimator.horizon={HORIZON}",
                          "data_curriculum=difficulty_schedule",
                          f"data_curriculum.accuracy_threshold={ACCURACY_THRESHOLD}", "eval.at_start=false"], out_dir)
    # the reward: rank_accuracy as the accuracy (its score 1 marks a sample correct), alone
    cfg.reward.components = OmegaConf.create({"accuracy": {"weight": 1.0,
                                                           "_target_": "test_global_decisions.rank_accuracy"}})
    OmegaConf.resolve(cfg)
    return cfg


def one_training_step(module, collect=None) -> dict:
    """`training_step` of the first rollout batch outside a Trainer: its update stage runs the
    loss terms and backward (their stats: the KL), without an optimiser step."""
    module.setup("fit")
    module.manual_backward = lambda loss: loss.backward()
    module.learner.steppers.backward = module.manual_backward
    module.update = lambda exp, has_signal=True: module.learner.accumulate_gradients(exp)
    if collect is not None:
        module.collect = collect
    seen = {}
    compute_advantages = module.compute_advantages

    def recording(exp):
        seen["exp"], seen["metrics"] = compute_advantages(exp)
        return seen["exp"], seen["metrics"]

    module.compute_advantages = recording
    module.log_step_metrics = lambda metrics: seen.update(logged=metrics)
    module.training_step(None, 0)
    return {"exp": seen["exp"], "logged": seen["logged"], "beta": module.part("reference").controller.value,
            "level": module.curriculum.level}


def decisions_worker(rank, port, cfg_dict, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        _, _, module, _ = build_run(OmegaConf.create(cfg_dict))
        torch.save(one_training_step(module), f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_controllers_schedules_and_whitening_read_the_whole_batch(tmp_path):
    cfg = decisions_config(tmp_path)
    run_ranks(decisions_worker, free_port(), OmegaConf.to_container(cfg), str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]

    # the difficulty schedule: the pre-filter accuracy of every rank's first round (0.5), under
    # the threshold, where rank 0's own (1.0) is over it
    for rank in ranks:
        assert rank["logged"]["rollout/prefilter_accuracy"] == 0.5
        assert rank["level"] == 0

    # the 1-process run on the union of the ranks' batches (their groups kept apart)
    _, tokenizer, single, _ = build_run(cfg)
    parts = [rank["exp"] for rank in ranks]
    parts[1].group_index = parts[1].group_index + 10_000
    union = Experience.concat(parts, tokenizer.pad_token_id)
    one = one_training_step(single, collect=lambda step: (union, {}, True))

    # the adaptive KL controller: one beta, from the global KL over the global rows
    assert ranks[0]["beta"] == ranks[1]["beta"] == one["beta"] != INIT_BETA

    # whitening (reinforce_pp): the union batch's mean and std; each rank alone has one
    # score for all its rows, which its own statistics would whiten to 0
    start = 0
    for rank in ranks:
        rows, width = rank["exp"].advantages.shape
        torch.testing.assert_close(rank["exp"].advantages, one["exp"].advantages[start:start + rows, :width],
                                   rtol=1e-5, atol=1e-6)
        assert rank["exp"].advantages.abs().max() > 0.5
        start += rows


def pass_rate_config(out_dir):
    return compose_config([*FAST_RUN, *EASY_TASK, *SMALL_MODEL, "algorithm=grpo", "algorithm.warm_start.steps=0",
                           "algorithm.prompts_per_step=2", "algorithm.group_size=2", "rollout.max_new_tokens=8",
                           f"paths.cache_dir={out_dir}/cache",
                           "data_curriculum=pass_rate_filter", "data_curriculum.pool_size=8",
                           "data_curriculum.low=0.0", "data_curriculum.high=1.0", "eval.at_start=false"], out_dir)


def fit(module, datamodule, steps: int, ckpt_path=None, **options):
    trainer = L.Trainer(max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, limit_val_batches=0, accelerator="cpu", **options)
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    return trainer


def counting(module, method: str) -> list:
    """Replace `module.<method>` by itself, counting its calls."""
    calls, original = [], getattr(module, method)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    setattr(module, method, counted)
    return calls


def test_a_pass_rate_filter_resumed_after_fit_start_trains_on_the_restored_prompts(tmp_path):
    cfg = pass_rate_config(tmp_path)
    _, _, first, datamodule = build_run(cfg)
    fingerprints = counting(first, "weights_fingerprint")
    trainer = fit(first, datamodule, steps=1)
    assert len(first.curriculum.kept) == 8 and len(fingerprints) == 1  # scored its pool, once
    checkpoint = tmp_path / "step1.ckpt"
    trainer.save_checkpoint(checkpoint)
    # the checkpoint's curriculum keeps prompts 3 and 5 of the pool only
    state = torch.load(checkpoint, weights_only=False)
    for curriculum in (state["curriculum"], *state["curriculum_by_rank"]):
        curriculum["kept_indices"] = [3, 5]
    torch.save(state, checkpoint)

    _, _, resumed, datamodule = build_run(cfg)
    estimates, fingerprints = counting(resumed, "estimate_pass_rates"), counting(resumed, "weights_fingerprint")
    resumed.setup("fit")  # builds the curriculum (fit's own setup keeps it)
    drawn, next_prompts = [], resumed.curriculum.next_prompts

    def drawing(count):
        drawn.extend(next_prompts(count))
        return drawn[-count:]

    resumed.curriculum.next_prompts = drawing
    fit(resumed, datamodule, steps=2, ckpt_path=checkpoint, strategy=restores_after_fit_start())
    assert estimates == [] and fingerprints == []  # the checkpoint's pass rates: nothing to measure
    pool = resumed.curriculum.build_pool()
    assert resumed.curriculum.kept == [pool[3], pool[5]]
    assert drawn and all(example in (pool[3], pool[5]) for example in drawn)


def test_a_curriculum_that_reads_no_pass_rate_fingerprints_nothing(tmp_path):
    cfg = pass_rate_config(tmp_path)
    cfg.data_curriculum = OmegaConf.create({"name": "none"})
    _, _, module, _ = build_run(cfg)
    module.setup("fit")
    fingerprints = counting(module, "weights_fingerprint")
    module.on_fit_start()
    module.on_train_start()
    assert fingerprints == []
