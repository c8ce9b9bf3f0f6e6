"""Ranks whose data differ must still run the same collectives (under trainer=fsdp every
forward and backward is one, under trainer=ddp every optimiser step all-reduces). Two gloo
processes on CPU run `posttrain.train.run` as torchrun starts it, for every kind of module, with
deliberately uneven per-rank data: online RL (GRPO, PPO) where dynamic sampling leaves rank 1 a
third of rank 0's rows, with micro-batches (of rows, or packed by tokens so that the ranks plan
different numbers) and more minibatches than rank 1 has rows for; DPO,
the reward model, the PRM and SFT with an odd number of held-out items, so the ranks' shares
differ. Each case runs under a timeout (a hang is reported as one), and must: take exactly
ppo_epochs x num_minibatches optimiser steps per rollout batch; count every held-out item once;
export a model its Hugging Face class loads; and, for online RL, end with the weights of one
process replaying the union of the ranks' minibatches."""

import copy
import json
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hydra.utils import instantiate
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification

from posttrain.algorithms.base import PosttrainModule
from posttrain.algorithms.experience import PER_TOKEN, Experience
from posttrain.algorithms.online import OnlineRLModule
from posttrain.algorithms.online.learner import Learner
from posttrain.algorithms.online.micro_batches import plan_micro_batches
from posttrain.algorithms.online.sampler import PolicySampler
from posttrain.distributed import collectives
from posttrain.distributed.collectives import rank_and_world
from posttrain.distributed.sharding import full_state_dict
from posttrain.envs.guess_number import GuessNumber
from posttrain.train import run

from conftest import EASY_TASK, FAST_RUN, RANKS_START_METHOD, compose_config, free_port
from test_fsdp import SMALL_MODEL, build_run, digit_share, grpo_config
from test_preference_distributed import DDP, VALIDATION_PAIRS, preference_config, write_pairs
from test_prm_distributed import VALIDATION_PROMPTS, prm_config

WORLD = 2
# A case running longer than this is hung (2 busy cores: a case takes ~5-20 s).
CASE_TIMEOUT_S = 150
HELD_OUT_PROMPTS = 5  # odd: 3 on rank 0, 2 and a stand-in on rank 1
PROMPTS_PER_STEP, GROUP_SIZE = 3, 4
# what one rollout batch's update runs: rank 0 has 12 rows; in PPO rank 1 has 4 (one group kept,
# no extra round), so that 2 of its 6 minibatches are empty; in GRPO rank 1 alone needs an extra
# sampling round (which rank 0 must join: under FSDP each generate call is a collective) and
# keeps 8 rows, so in 2 minibatches the ranks have 3 and 2 micro-batches of 2 rows
ONLINE = {"grpo": {"ppo_epochs": 1, "num_minibatches": 2}, "ppo": {"ppo_epochs": 2, "num_minibatches": 6},
          "grpo_tokens": {"ppo_epochs": 1, "num_minibatches": 2}}
EXTRA_ROUNDS = {"grpo": 1, "ppo": 0, "grpo_tokens": 1}
# GRPO also samples in bf16 with both train-inference corrections on and a budget every batch
# exceeds: the corrected update, the mismatch metrics and the budget's verdict are those of the
# union of the ranks' tokens
MISMATCHED = {"grpo": ("rollout.dtype=bfloat16", "rollout.correction.tis=token", "rollout.correction.mis=sequence",
                       "rollout.correction.mis_low=0.9", "rollout.correction.mis_high=1.1",
                       "rollout.mismatch_budget.kl=1e-12"), "ppo": (), "grpo_tokens": ()}
MICRO_BATCH = 2
# grpo_tokens: GRPO whose micro-batches are packed by a token budget (algorithm.micro_batch_tokens)
# rather than by rows. The rows are a 6-token prompt and up to 8 response tokens: 2 of the
# longest fit, 3 only if short, so a minibatch of rank 0's 6 rows plans about 3 micro-batches
# and one of rank 1's 4 rows about 2, of different widths
MICRO_BATCH_TOKENS = 28
MICRO_BATCHES = {"grpo": f"algorithm.micro_batch_size={MICRO_BATCH}", "ppo": f"algorithm.micro_batch_size={MICRO_BATCH}",
                 "grpo_tokens": f"algorithm.micro_batch_tokens={MICRO_BATCH_TOKENS}"}
ALGORITHM = {"grpo_tokens": "grpo"}  # an online case's algorithm, where the case is not named after it


def uneven_digit_share(samples, source):
    """`digit_share` (a spread in every group of random samples), but rank 1 keeps only the first
    group of each sampling round informative: dynamic sampling drops its others, so rank 1
    trains on a third of rank 0's rows per round it samples."""
    rank = rank_and_world()[0]
    shares = digit_share(samples, source)
    return [0.0 if rank == 1 and sample.group % PROMPTS_PER_STEP != 0 else share
            for sample, share in zip(samples, shares)]


def env_rank_uneven_digit_share(samples, source):
    """`uneven_digit_share` for a rollout producer process, which has no process group: the rank
    is read from the environment it inherits from its trainer (RANK)."""
    rank = int(os.environ.get("RANK", "0"))
    shares = digit_share(samples, source)
    return [0.0 if rank == 1 and sample.group % PROMPTS_PER_STEP != 0 else share
            for sample, share in zip(samples, shares)]


# GRPO with a producer process per rank, one policy version ahead, for 3 rollout batches
ASYNC_BATCHES = 3


def async_config(out_dir, *trainer):
    cfg = online_config(out_dir, "grpo", *trainer)
    steps = ASYNC_BATCHES * ONLINE["grpo"]["ppo_epochs"] * ONLINE["grpo"]["num_minibatches"]
    cfg.rollout.max_staleness = 1
    cfg.reward.components.digits._target_ = "test_uneven_ranks.env_rank_uneven_digit_share"
    cfg.trainer.max_steps = cfg.callbacks.checkpoint.every_n_train_steps = steps
    return cfg


def online_config(out_dir, kind, *trainer):
    steps = ONLINE[kind]["ppo_epochs"] * ONLINE[kind]["num_minibatches"]  # one rollout batch
    cfg = grpo_config(out_dir, *trainer, f"algorithm={ALGORITHM.get(kind, kind)}", "reward.components.digits._target_="
                      "test_uneven_ranks.uneven_digit_share", "data_curriculum=dynamic_sampling",
                      f"data_curriculum.max_extra_rounds={EXTRA_ROUNDS[kind]}", f"algorithm.prompts_per_step={PROMPTS_PER_STEP}",
                      f"algorithm.group_size={GROUP_SIZE}", MICRO_BATCHES[kind],
                      *(f"algorithm.{key}={value}" for key, value in ONLINE[kind].items()), *MISMATCHED[kind],
                      f"trainer.max_steps={steps}", "trainer.val_check_interval=1",
                      f"callbacks.checkpoint.every_n_train_steps={steps}", f"eval.num_prompts={HELD_OUT_PROMPTS}",
                      "eval.batch_size=2", "num_threads=1", f"paths.cache_dir={out_dir}/cache")
    OmegaConf.resolve(cfg)
    return cfg


def sft_config(out_dir, *trainer):
    cfg = compose_config([*FAST_RUN, *EASY_TASK, *SMALL_MODEL, *trainer, "algorithm=sft", "algorithm.batch_size=2",
                          "trainer.max_steps=2", "trainer.val_check_interval=2",
                          "callbacks.checkpoint.every_n_train_steps=2", "eval.at_start=false",
                          f"eval.num_prompts={HELD_OUT_PROMPTS}", "eval.batch_size=2", "num_threads=1",
                          f"paths.cache_dir={out_dir}/cache"], out_dir)
    OmegaConf.resolve(cfg)
    return cfg


class TurnsByRank(GuessNumber):
    """Guess the number, but rank 1's episodes end after one turn: the ranks run different numbers
    of turns (and generate calls, and tokens) per rollout batch and per held-out evaluation."""

    def start(self, example):
        episode = super().start(example)
        episode.max_turns = 1 if int(os.environ.get("RANK", "0")) == 1 else self.max_turns
        return episode


def episodes_config(out_dir, *trainer):
    """Multi-turn GRPO from a random policy: its guesses are rarely numbers, so rank 0's episodes
    run to the budget or 3 turns, rank 1's end after one."""
    cfg = compose_config([*FAST_RUN, *SMALL_MODEL, *trainer, "experiment=guess_number", "algorithm.warm_start.steps=0",
                          "env._target_=test_uneven_ranks.TurnsByRank", f"algorithm.prompts_per_step={PROMPTS_PER_STEP}",
                          f"algorithm.group_size={GROUP_SIZE}", f"algorithm.micro_batch_size={MICRO_BATCH}",
                          "algorithm.num_minibatches=2", "trainer.max_steps=2", "trainer.val_check_interval=1",
                          "callbacks.checkpoint.every_n_train_steps=2", "eval.at_start=false",
                          f"eval.num_prompts={HELD_OUT_PROMPTS}", "eval.batch_size=2", "num_threads=1",
                          f"paths.cache_dir={out_dir}/cache"], out_dir)
    OmegaConf.resolve(cfg)
    return cfg


HEADS = ("correct", "concise")


def write_head_pairs(path):
    """write_pairs' pairs, each naming the reward-model head it trains, in turn."""
    rows = [json.loads(line) for line in write_pairs(path).read_text().splitlines()]
    path.write_text("".join(json.dumps({**row, "head": HEADS[i % len(HEADS)]}) + "\n" for i, row in enumerate(rows)))
    return path


def case_configs(kind: str, trainer: tuple[str, ...], out) -> list[dict]:
    """Each rank's config of a case (each rank its own output and cache directories)."""
    held_out = (f"eval.num_prompts={HELD_OUT_PROMPTS}", "eval.batch_size=2")
    cfgs = []
    for rank in range(WORLD):
        rank_dir = out / kind / f"rank{rank}"
        if kind in ONLINE:
            cfg = online_config(rank_dir, kind, *trainer)
        elif kind == "grpo_async":
            cfg = async_config(rank_dir, *trainer)
        elif kind == "sft":
            cfg = sft_config(rank_dir, *trainer)
        elif kind == "grpo_episodes":
            cfg = episodes_config(rank_dir, *trainer)
        elif kind == "prm":  # from a random policy (model.init_from=null): the rows' labels do not matter here
            cfg = prm_config(rank_dir, "null", 2, *trainer)
        elif kind == "reward_model_heads":  # two heads, the pairs alternating between them
            cfg = preference_config(rank_dir, write_head_pairs(out / "head_pairs.jsonl"), "reward_model", 2, *trainer,
                                    *held_out, f"algorithm.heads=[{','.join(HEADS)}]")
        else:  # dpo, reward_model: validation pairs in batches of 2
            cfg = preference_config(rank_dir, write_pairs(out / "pairs.jsonl"), kind, 2, *trainer, *held_out)
        cfgs.append(OmegaConf.to_container(cfg))
    return cfgs


# what each case counts once over the ranks, and the Hugging Face class its export loads with
HELD_OUT = {"grpo": HELD_OUT_PROMPTS, "grpo_tokens": HELD_OUT_PROMPTS, "grpo_async": HELD_OUT_PROMPTS, "grpo_episodes": HELD_OUT_PROMPTS, "ppo": HELD_OUT_PROMPTS, "sft": HELD_OUT_PROMPTS, "dpo": HELD_OUT_PROMPTS,
            "reward_model": VALIDATION_PAIRS, "reward_model_heads": VALIDATION_PAIRS, "prm": VALIDATION_PROMPTS}
EXPORT_CLASS = {"reward_model": AutoModelForSequenceClassification,
                "reward_model_heads": AutoModelForSequenceClassification, "prm": AutoModelForTokenClassification}
KINDS = ("grpo", "grpo_tokens", "grpo_async", "grpo_episodes", "ppo", "dpo", "reward_model", "reward_model_heads", "prm", "sft")
TRAINERS = {"ddp": DDP, "fsdp": ("trainer=fsdp",)}


# --- one 2-process job for all cases of a trainer ------------------------------------------------

def recording_modules() -> list:
    """Patch this process's modules to keep what the checks read: every module built, the rows
    of each rollout batch's update, each minibatch (for the replay) and the micro-batches its
    update ran, and the held-out prompts counted at the last evaluation."""
    built = []

    def init(self, *args, original=PosttrainModule.__init__, **kwargs):
        original(self, *args, **kwargs)
        self.update_rows, self.minibatches, self.counted_prompts, self.generate_calls = [], [], None, 0
        self.micro_batches_run = []  # per minibatch: the training forwards, stand-ins included
        self.turns = []  # per rollout batch, each row's policy turns (with an environment)
        built.append(self)

    def generate(self, *args, original=PosttrainModule.generate, **kwargs):
        self.generate_calls += 1  # each gathers the weights under FSDP: a collective
        return original(self, *args, **kwargs)

    def update(self, exp, *args, original=OnlineRLModule.update, **kwargs):
        self.update_rows.append(len(exp))
        if exp.turns is not None:
            self.turns.append(exp.turns.tolist())
        return original(self, exp, *args, **kwargs)

    def sample(self, *args, original=PolicySampler.generate, **kwargs):
        built[-1].generate_calls += 1  # the collect stage's, through the module's sampler
        return original(self, *args, **kwargs)

    def minibatch_step(self, exp, *args, original=Learner.minibatch_step, **kwargs):
        module = built[-1]  # the learner of the module this process built last
        module.minibatches.append((module.train_batches_seen, copy.deepcopy(exp)))
        module.micro_batches_run.append(0)
        return original(self, exp, *args, **kwargs)

    def training_forward(self, *args, original=Learner.training_forward, **kwargs):
        built[-1].micro_batches_run[-1] += 1
        return original(self, *args, **kwargs)

    def epoch_end(self, original=PosttrainModule.on_validation_epoch_end):
        self.counted_prompts = len(self._eval_correct)  # this rank's, before the sum over ranks
        return original(self)

    PosttrainModule.__init__, PosttrainModule.on_validation_epoch_end = init, epoch_end
    PosttrainModule.generate, PolicySampler.generate = generate, sample
    OnlineRLModule.update, Learner.minibatch_step, Learner.training_forward = update, minibatch_step, training_forward
    return built


def held_out_counted(module, kind: str) -> float:
    """The held-out items this rank counted at its last evaluation."""
    if kind == "prm":
        return module._eval_sums[3].item()  # responses
    if kind.startswith("reward_model"):
        return module._eval_sums[:, 0].sum().item()  # pairs, over the heads
    return module.counted_prompts


def cases_worker(rank, port, cases, out_dir):
    """Rank `rank` of a torchrun-like job (LOCAL_RANK set: Lightning does not spawn) running each
    case's `posttrain.train.run` in turn in one process group; a file marks each case's start
    (the parent's clock for the timeout) and one holds each finished case's record."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), RANK=str(rank),
                      NODE_RANK="0", WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    built = recording_modules()
    try:
        for kind, cfg_dicts in cases:
            (out_dir / f"{kind}.rank{rank}.started").touch()
            summary = run(OmegaConf.create(cfg_dicts[rank]), announce=False)
            module = built[-1]
            record = {"summary": summary, "held_out": held_out_counted(module, kind),
                      "weights": full_state_dict(module.policy, rank0_only=False),  # gathered under fsdp
                      "update_rows": module.update_rows, "minibatches": module.minibatches,
                      "micro_batches_run": module.micro_batches_run,
                      "generate_calls": module.generate_calls, "turns": module.turns,
                      "batches": module.train_batches_seen}
            torch.save(record, out_dir / f"{kind}.rank{rank}.pt")
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_cases(cases, out_dir) -> dict:
    """Each case's per-rank records, or a line saying why there are none (it hung, it failed,
    or an earlier case stopped the job). A case that outlives CASE_TIMEOUT_S ends the job."""
    context = mp.start_processes(cases_worker, args=(free_port(), cases, out_dir), nprocs=WORLD, join=False,
                                 start_method=RANKS_START_METHOD)
    started: dict[str, float] = {}
    outcome: dict = {}
    try:
        while not context.join(timeout=1.0):
            for kind, _ in cases:
                if kind not in started and (out_dir / f"{kind}.rank0.started").exists():
                    started[kind] = time.monotonic()
            running = [kind for kind in started if not (out_dir / f"{kind}.rank{WORLD - 1}.pt").exists()]
            if running and time.monotonic() - started[running[0]] > CASE_TIMEOUT_S:
                outcome[running[0]] = f"hung: no end after {CASE_TIMEOUT_S} s"
                for process in context.processes:
                    process.kill()
                break
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:  # a rank raised, or died
        failed = next((kind for kind, _ in cases if not (out_dir / f"{kind}.rank{WORLD - 1}.pt").exists()), None)
        outcome[failed] = f"failed: {str(err)[-3000:]}"
    for kind, _ in cases:
        if all((out_dir / f"{kind}.rank{rank}.pt").exists() for rank in range(WORLD)):
            outcome[kind] = [torch.load(out_dir / f"{kind}.rank{rank}.pt", weights_only=False) for rank in range(WORLD)]
        outcome.setdefault(kind, "not reached: an earlier case stopped the job")
    return outcome


@pytest.fixture(scope="module", params=list(TRAINERS))
def uneven_job(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"uneven_{request.param}")
    cases = [(kind, case_configs(kind, TRAINERS[request.param], out)) for kind in KINDS]
    return request.param, run_cases(cases, out), out


def finished(job, kind) -> list[dict]:
    trainer, outcome, _ = job
    records = outcome[kind]
    if isinstance(records, str):
        pytest.fail(f"trainer={trainer} algorithm={kind}: {records}")
    return records


# --- the checks ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_of_module_finishes_counts_each_held_out_item_once_and_exports(kind, uneven_job):
    ranks = finished(uneven_job, kind)
    _, _, out = uneven_job
    assert ranks[0]["summary"]["global_step"] == ranks[1]["summary"]["global_step"] > 0
    # each held-out item scored by one rank: the odd count splits 3 + 2, none counted twice
    assert sorted(rank["held_out"] for rank in ranks) == [HELD_OUT[kind] // 2, HELD_OUT[kind] - HELD_OUT[kind] // 2]
    heads = [k for k in ranks[0]["summary"] if k.startswith("eval/heads/")]  # a multi-head reward model's
    if kind == "reward_model_heads":
        assert sorted(heads) == sorted(f"eval/heads/{head}/pair_accuracy" for head in HEADS)
    for name in heads:  # each head's held-out figures, reduced over the ranks
        assert ranks[0]["summary"][name] == ranks[1]["summary"][name], name
    if "eval/accuracy" in ranks[0]["summary"]:  # greedy held-out eval: its calibration is reduced over the ranks
        for name in ("eval/ece", "eval/confidence", "eval/reliability/bin00/share"):
            assert ranks[0]["summary"][name] == ranks[1]["summary"][name], name
    exported = EXPORT_CLASS.get(kind, AutoModelForCausalLM).from_pretrained(out / kind / "rank0" / "hf_model").state_dict()
    assert exported.keys() == ranks[0]["weights"].keys()
    for name, value in ranks[0]["weights"].items():
        torch.testing.assert_close(exported[name], value, rtol=0, atol=0, msg=name)


def widened(exp: Experience, width: int) -> Experience:
    """`exp` with its response columns right-padded to `width` (padding: masked out)."""
    return Experience(**{name: value if value is None or name not in PER_TOKEN else
                         torch.nn.functional.pad(value, (0, width - value.shape[1]))
                         for name, value in vars(exp).items()})


@pytest.mark.parametrize("kind", list(ONLINE))
def test_online_rl_on_uneven_ranks_takes_the_configured_steps_and_equals_one_process(kind, uneven_job, tmp_path):
    ranks = finished(uneven_job, kind)
    settings = ONLINE[kind]
    steps = settings["ppo_epochs"] * settings["num_minibatches"]
    uneven = [[PROMPTS_PER_STEP * GROUP_SIZE], [GROUP_SIZE * (1 + EXTRA_ROUNDS[kind])]]
    assert [rank["update_rows"] for rank in ranks] == uneven
    # the ranks sampled as many times, though only rank 1 needed an extra round
    assert ranks[0]["generate_calls"] == ranks[1]["generate_calls"]
    for rank in ranks:  # exactly ppo_epochs x num_minibatches optimiser steps for the rollout batch
        assert rank["batches"] == 1 and rank["summary"]["global_step"] == steps
        assert len(rank["minibatches"]) == steps
    # the mismatch of the whole batch, the same on every rank (reduced over the ranks' tokens)
    mismatch = [{k: v for k, v in rank["summary"].items() if k.startswith("rollout/mismatch/")} for rank in ranks]
    assert mismatch[0] == mismatch[1] and "rollout/mismatch/kl" in mismatch[0]
    if MISMATCHED[kind]:
        assert mismatch[0]["rollout/mismatch/over_budget_batches"] == 1.0
        assert mismatch[0]["rollout/mismatch/kl"] > 0 and "rollout/mismatch/masked_frac" in mismatch[0]

    assert_one_process_steps_to_the_same_weights(online_config(tmp_path, kind, "+trainer.limit_val_batches=0"), ranks,
                                                 steps)


def test_ranks_planning_different_numbers_of_micro_batches_by_tokens_run_as_many(uneven_job):
    """grpo_tokens: in a minibatch the ranks' token plans differ in length (rank 1 has fewer
    rows); each rank runs the longer plan's number of micro-batches, the shorter padded with
    stand-ins. That the weights are one process's is test_online_rl_on_uneven_ranks_...'s check."""
    ranks = finished(uneven_job, "grpo_tokens")
    planned = [[len(plan_micro_batches(*(lengths.tolist() for lengths in exp.row_widths()),
                                       max_tokens=MICRO_BATCH_TOKENS)) for _, exp in rank["minibatches"]]
               for rank in ranks]
    assert planned[0] != planned[1]
    assert ranks[0]["micro_batches_run"] == ranks[1]["micro_batches_run"] == [max(n) for n in zip(*planned)]


def test_multi_turn_episodes_of_uneven_ranks_agree_and_equal_one_process(uneven_job, tmp_path):
    ranks = finished(uneven_job, "grpo_episodes")
    turns = [sorted({t for batch in rank["turns"] for t in batch}) for rank in ranks]
    assert turns[1] == [1] and max(turns[0]) > 1  # the ranks ran different numbers of turns
    assert ranks[0]["summary"]["global_step"] == ranks[1]["summary"]["global_step"] == 2
    for name in ("eval/accuracy", "eval/response_len"):  # reduced over the ranks
        if name in ranks[0]["summary"]:
            assert ranks[0]["summary"][name] == ranks[1]["summary"][name], name
    cfg = episodes_config(tmp_path, "+trainer.limit_val_batches=0")
    assert_one_process_steps_to_the_same_weights(cfg, ranks, 2)


def assert_one_process_steps_to_the_same_weights(cfg, ranks, steps):
    """One process stepping on the union of the ranks' minibatches, in order, ends at the weights
    the ranks ended at."""
    _, _, single, datamodule = build_run(cfg)
    unions = []
    for (_, mine), (_, theirs) in zip(ranks[0]["minibatches"], ranks[1]["minibatches"]):
        width = max(mine.response_ids.shape[1], theirs.response_ids.shape[1])
        unions.append(Experience.concat([widened(mine, width), widened(theirs, width)], single.tokenizer.pad_token_id))
    single.collect = lambda step: (copy.deepcopy(unions[0]), {}, True)

    def replay(exp, has_signal=True):
        stats = {}
        for union in unions:
            stats = single.learner.minibatch_step(union, True)
        return stats

    single.update = replay
    trainer = instantiate(cfg.trainer, logger=False, enable_progress_bar=False, enable_checkpointing=False)
    trainer.fit(single, datamodule=datamodule)
    assert trainer.global_step == steps
    expected = single.policy.state_dict()
    for name, value in ranks[0]["weights"].items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-5, msg=name)


def test_producers_of_uneven_ranks_feed_one_agreed_batch_per_step(uneven_job):
    """rollout.max_staleness=1: each rank's producer process samples its own prompts ahead of its
    trainer; the ranks consume one batch per step together, agree on the staleness and the
    mismatch (all-reduced) and end with one set of weights."""
    ranks = finished(uneven_job, "grpo_async")
    steps = ASYNC_BATCHES * ONLINE["grpo"]["num_minibatches"]
    for rank in ranks:
        assert rank["batches"] == ASYNC_BATCHES and rank["summary"]["global_step"] == steps
    # uneven data: rank 1 keeps fewer rows every batch
    assert all(mine > theirs for mine, theirs in zip(ranks[0]["update_rows"], ranks[1]["update_rows"]))
    agreed = [{k: v for k, v in rank["summary"].items() if k.startswith(("rollout/staleness", "rollout/mismatch/"))}
              for rank in ranks]
    assert agreed[0] == agreed[1] and 0 <= agreed[0]["rollout/staleness_max"] <= 1
    for name, value in ranks[0]["weights"].items():
        torch.testing.assert_close(ranks[1]["weights"][name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("num_items", range(8))
def test_rank_shares_are_disjoint_cover_every_item_once_and_have_one_length(num_items, monkeypatch):
    for world in (1, 2, 3):
        shares = []
        for rank in range(world):
            monkeypatch.setattr(collectives, "rank_and_world", lambda rank=rank: (rank, world))
            shares.append(collectives.rank_share(num_items))
        assert {len(indices) for indices, _ in shares} == {-(-num_items // world)}
        counted = [i for indices, flags in shares for i, flag in zip(indices, flags) if flag]
        assert sorted(counted) == list(range(num_items))
        for indices, flags in shares:  # stand-ins only at the end of a share
            assert flags == sorted(flags, reverse=True)
