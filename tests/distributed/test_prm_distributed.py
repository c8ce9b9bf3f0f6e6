"""The process reward model (algorithm=prm) under data parallelism: 2 processes on CPU (gloo),
through `posttrain.train.run` as torchrun starts it (the pattern of test_preference_distributed).
Every rank samples the same step rows from the starting policy (same seeds; only rank 0 writes
the cache), trains on a disjoint half of each global batch, and ends with the weights and the
held-out step metrics of a 1-process run at the same global batch; each held-out row is scored
by exactly one rank, also when their count is odd; only rank 0 writes files."""

import pytest
import torch
from omegaconf import OmegaConf

from conftest import FAST_RUN, compose_config, free_port, run_ranks
from test_preference_distributed import (DDP, LR, PAIRS_PER_RANK, SMALL_MODEL, STEPS, WORLD, run_as_rank,
                                         check_disjoint_halves_of_the_global_batches, check_only_rank_0_wrote,
                                         check_same_weights)

ROWS_PER_RANK = PAIRS_PER_RANK  # step rows (sampled responses) per rank and optimiser step
TRAIN_PROMPTS, VALIDATION_PROMPTS = 8, 5  # one response each: 5 held-out rows, split 3 + 2 over the ranks
# 1-digit sums in written columns ("7+5=12>12"): 150 SFT steps of the small model get some of them
# right, so the step rows hold both labels (a random policy's steps are all wrong: a PRM that
# scores every step bad would have a step accuracy of 1 on any share of the rows)
ONE_DIGIT_COLUMNS = ("data.min_digits=1", "data.max_digits=1", "data.style=verbose", "data.max_response_tokens=32")
SFT_STEPS = 150


def sft_start(out_dir) -> str:
    """The starting policy the step rows are sampled from: a short SFT run's hf_model/."""
    from posttrain.train import run

    steps = (f"trainer.max_steps={SFT_STEPS}", f"trainer.val_check_interval={SFT_STEPS}",
             f"callbacks.checkpoint.every_n_train_steps={SFT_STEPS}")
    cfg = compose_config([*FAST_RUN, *SMALL_MODEL, *ONE_DIGIT_COLUMNS, *steps, "eval.num_prompts=8",
                          "eval.batch_size=8", "eval.at_start=false", "num_threads=1"], out_dir)
    run(cfg, announce=False)
    return str(out_dir / "hf_model")


def prm_config(out_dir, start, rows_per_process, *overrides):
    cfg = compose_config([*FAST_RUN, *SMALL_MODEL, *ONE_DIGIT_COLUMNS, f"model.init_from={start}", "algorithm=prm",
                          "algorithm.warm_start.steps=0", "algorithm.labels=verifier",
                          f"algorithm.process_data.num_train_prompts={TRAIN_PROMPTS}",
                          f"algorithm.process_data.num_validation_prompts={VALIDATION_PROMPTS}",
                          "algorithm.process_data.samples_per_prompt=1", "algorithm.process_data.temperature=0.3",
                          f"algorithm.batch_size={rows_per_process}",
                          f"trainer.max_steps={STEPS}", f"trainer.val_check_interval={STEPS}",
                          f"callbacks.checkpoint.every_n_train_steps={STEPS}", "eval.num_prompts=8",
                          "eval.batch_size=2",  # held-out batches: 2 on rank 0 (3 rows), 1 on rank 1 (2 rows)
                          "eval.at_start=false", "num_threads=1", f"algorithm.optim.lr={LR}",
                          "algorithm.optim.warmup_steps=0", f"paths.cache_dir={out_dir}/cache", *overrides], out_dir)
    OmegaConf.resolve(cfg)
    return cfg


def row_tokens(batch) -> list[tuple[int, ...]]:
    """Each row of a collated batch as its token ids (padding dropped): what identifies a row."""
    return [tuple(ids[mask.bool()].tolist()) for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]


def recording_prm_modules(setattr=setattr):
    """Every PRM module built in this process (with its starting weights), and the rows each
    training step saw."""
    from posttrain.algorithms.prm import PRMModule

    built, seen = [], []

    def recording_init(self, *args, init=PRMModule.__init__, **kwargs):
        init(self, *args, **kwargs)
        self.start_weights = {k: v.detach().clone() for k, v in self.policy.state_dict().items()}
        built.append(self)

    def recording_step(self, batch, batch_idx, step=PRMModule.training_step):
        seen.append(row_tokens(batch))
        return step(self, batch, batch_idx)

    setattr(PRMModule, "__init__", recording_init)
    setattr(PRMModule, "training_step", recording_step)
    return built, seen


def held_out_counts(module) -> dict[str, float]:
    """What this process's last evaluation scored by itself (before the sum over ranks)."""
    steps, _, _, rows, _, _ = module._eval_sums.tolist()
    return {"steps": steps, "rows": rows}


def run_worker(rank, world, port, cfg_dicts, out_dir):
    """One rank of `posttrain` under torchrun, with its own paths.output_dir and paths.cache_dir."""
    from posttrain.distributed.sharding import full_state_dict

    built, seen = recording_prm_modules()

    def record(summary):
        module = built[-1]
        return {"summary": summary, "seen": seen, "held_out": held_out_counts(module),
                "weights": full_state_dict(module.policy, rank0_only=False), "start_weights": module.start_weights}

    run_as_rank(rank, world, port, cfg_dicts[rank], out_dir, record)


@pytest.fixture(scope="module")
def prm_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("prm")
    start = sft_start(tmp_path_factory.mktemp("sft"))
    cfgs = [OmegaConf.to_container(prm_config(out / f"rank{r}", start, ROWS_PER_RANK, *DDP)) for r in range(WORLD)]
    run_ranks(run_worker, WORLD, free_port(), cfgs, str(out))
    ranks = [torch.load(out / f"record{r}.pt", weights_only=False) for r in range(WORLD)]

    from posttrain.train import run

    (out / "single").mkdir()
    with pytest.MonkeyPatch.context() as patch:
        built, seen = recording_prm_modules(patch.setattr)
        summary = run(prm_config(out / "single", start, WORLD * ROWS_PER_RANK), announce=False)
    single = {"summary": summary, "seen": seen, "module": built[-1], "held_out": held_out_counts(built[-1])}
    return ranks, single, out


def test_two_process_prm_trains_on_disjoint_halves_and_ends_with_the_one_process_weights(prm_runs):
    ranks, single, out = prm_runs
    # the ranks sampled the same rows from the starting policy: together their batches are the
    # 1-process run's global batches, each rank's half disjoint from the other's
    check_disjoint_halves_of_the_global_batches(ranks, single)
    check_same_weights(ranks, single)
    for name in ("train/loss", "train/step_accuracy"):  # logged as the mean over both ranks' steps
        assert ranks[0]["summary"][name] == pytest.approx(single["summary"][name], abs=1e-4), name
    check_only_rank_0_wrote(out)  # also the step rows' cache: rank 1 made the same rows and wrote none
    assert len(list((out / "rank0" / "cache" / "process_rows").glob("*.json"))) == 1


def test_two_process_prm_scores_each_held_out_row_once_and_reports_the_one_process_metrics(prm_runs):
    ranks, single, _ = prm_runs
    assert single["summary"]["process/validation/rows"] == VALIDATION_PROMPTS  # odd: the ranks' shares differ
    assert 0 < single["summary"]["process/validation/good_share"] < 1  # right and wrong steps: accuracy can differ
    # each rank scored its own rows (3 and 2), together every held-out row and step once
    assert sorted(rank["held_out"]["rows"] for rank in ranks) == [2, 3]
    for count in ("rows", "steps"):
        assert sum(rank["held_out"][count] for rank in ranks) == single["held_out"][count], count
    for name in ("eval/step_accuracy", "eval/loss", "eval/first_error_accuracy", "eval/outcome_accuracy"):
        for rank in ranks:
            assert rank["summary"][name] == pytest.approx(single["summary"][name], abs=1e-5), name
