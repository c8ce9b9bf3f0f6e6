"""data=mixture (data/mixture.py, rewards/mixture.py): draws by weight, a resumable stream that
continues every source's own, held-out prompts in turn, each example judged and rewarded by its
own source, the start-up checks, and the metrics per source."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from posttrain.algorithms.experience import Experience
from posttrain.algorithms.online.rollouts import source_metrics
from posttrain.config.check import check_config
from posttrain.data.datamodule import ExampleCursor
from posttrain.data.examples import Example
from posttrain.data.mixture import BLOCK, block_counts
from posttrain.data.sources import build_source
from posttrain.errors import ConfigError, DataError
from posttrain.rewards import build_reward
from posttrain.rewards.base import ScoredSample

from forked_cli import run_command
from conftest import compose_config, free_port, module_from_config, run_ranks


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def mixture_config(mixture: dict, seed: int = 0):
    return OmegaConf.create({"source": "mixture", "mixture": mixture, "seed": seed, "max_response_tokens": 8,
                             "max_prompt_tokens": None, "step_separators": None})


ADDITION = {"source": "arithmetic", "min_digits": 2, "max_digits": 2}


def sums_and_words(tmp_path, sums_weight=3.0, words_weight=1.0, seed=0):
    """A mixture of generated 2-digit additions and a JSON-lines file of 5 words (plus 3 held out)."""
    train = write_jsonl(tmp_path / "words.jsonl", [{"prompt": f"w{i}?", "response": f"w{i}", "answer": f"w{i}"}
                                                   for i in range(5)])
    held = write_jsonl(tmp_path / "held.jsonl", [{"prompt": f"h{i}?", "response": f"h{i}", "answer": f"h{i}"}
                                                 for i in range(3)])
    return mixture_config({
        "sums": {"weight": sums_weight, "data": ADDITION},
        "words": {"weight": words_weight, "data": {"source": "jsonl", "files": {"train": train, "validation": held}}},
    }, seed)


# --- the training stream ----------------------------------------------------------------------

def test_a_block_holds_each_sources_share_of_the_weight_by_largest_remainder():
    assert block_counts([3.0, 1.0]) == [750, 250]
    assert block_counts([1.0, 1.0, 1.0]) == [334, 333, 333]  # the one left over goes to the first
    assert block_counts([1.0, 2.0], block=10) == [3, 7]  # 3.33 and 6.67: the larger remainder is the second's


def test_draws_follow_the_weights(tmp_path):
    mixture = build_source(sums_and_words(tmp_path))
    sources = [mixture.example("train", i).source for i in range(2 * BLOCK)]
    assert Counter(sources) == {"sums": 1500, "words": 500}  # 3 : 1 exactly over whole blocks
    first = Counter(sources[:200])["sums"] / 200
    assert 0.65 < first < 0.85  # and about 3 : 1 in any stretch (a shuffled block)


def test_the_stream_is_a_pure_function_of_seed_and_position(tmp_path):
    def prompts(seed):
        mixture = build_source(sums_and_words(tmp_path, seed=seed))
        return [(e.source, e.prompt) for e in (mixture.example("train", i) for i in range(60))]

    assert prompts(0) == prompts(0)
    assert prompts(0) != prompts(1)


def test_each_source_streams_as_it_would_alone(tmp_path):
    """A source's k-th draw is the k-th example of its own seeded stream: the file's 5 words in a
    seeded order, then reshuffled, as data=jsonl would stream them."""
    cfg = sums_and_words(tmp_path)
    mixture = build_source(cfg)
    drawn = [e.prompt for e in (mixture.example("train", i) for i in range(200)) if e.source == "words"][:12]
    alone = build_source(OmegaConf.create({"source": "jsonl", "files": dict(cfg.mixture.words.data.files)}))
    assert drawn == [e.prompt for e in ExampleCursor(alone, "train", seed=0).take(12)]
    assert sorted(drawn[:5]) == [f"w{i}?" for i in range(5)]  # each word once per pass


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_resumed_stream_continues_every_source_without_loss_or_repeat(tmp_path, world_size):
    """Draw N, rebuild the source from its config, start at the saved position, draw M: the same as
    N + M draws without the stop. Across a block boundary (1000) and a pass over the file (5 words)."""
    n, m = 700, 600
    for rank in range(world_size):
        whole = ExampleCursor(build_source(sums_and_words(tmp_path)), "train", 0, rank=rank, world_size=world_size)
        expected = [(e.source, e.prompt) for e in whole.take(n + m)]
        first = ExampleCursor(build_source(sums_and_words(tmp_path)), "train", 0, rank=rank, world_size=world_size)
        before = [(e.source, e.prompt) for e in first.take(n)]
        resumed = ExampleCursor(build_source(sums_and_words(tmp_path)), "train", 0, position=first.position,
                                rank=rank, world_size=world_size)
        assert before + [(e.source, e.prompt) for e in resumed.take(m)] == expected


def test_the_online_modules_prompts_resume_from_its_checkpointed_state(make_config):
    """What a killed GRPO run keeps (the curriculum's state in the checkpoint) brings a new module
    back to the same place in the mixture's stream: 10 prompts, a restart, 14 more are the 24
    prompts of an uninterrupted run."""
    cfg = make_config("data=mixture", "algorithm=grpo", "algorithm.warm_start.steps=0")
    expected = [(e.source, e.prompt) for e in module_from_config(cfg).curriculum.next_prompts(24)]
    killed = module_from_config(cfg).curriculum
    before = [(e.source, e.prompt) for e in killed.next_prompts(10)]
    resumed = module_from_config(cfg).curriculum
    resumed.load_state_dict(killed.state_dict())
    assert before + [(e.source, e.prompt) for e in resumed.next_prompts(14)] == expected
    assert {source for source, _ in expected} == {"two_digit", "three_digit"}


def test_a_drawn_example_is_a_copy_tagged_with_its_source(tmp_path):
    mixture = build_source(sums_and_words(tmp_path))
    words = mixture.sources["words"]
    example = next(e for e in (mixture.example("train", i) for i in range(20)) if e.source == "words")
    assert example.source == "words"
    assert all(e.source is None for e in words.examples["train"])  # the file's own examples untouched


# --- held-out splits --------------------------------------------------------------------------

def test_held_out_prompts_take_the_sources_in_turn(tmp_path):
    """An endless source (sums) and a file of 3 held-out words: sums, words, sums, words, sums,
    words, then sums alone; endless, so the datamodule takes eval.num_prompts of them."""
    mixture = build_source(sums_and_words(tmp_path))
    assert mixture.size("validation") is None
    sources = [mixture.example("validation", i).source for i in range(8)]
    assert sources == ["sums", "words", "sums", "words", "sums", "words", "sums", "sums"]
    assert [mixture.example("validation", i).prompt for i in (1, 3, 5)] == ["h0?", "h1?", "h2?"]


def test_finite_held_out_splits_add_up(tmp_path):
    held = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}", "response": "x", "answer": "x"} for i in range(3)])
    one = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "b0", "response": "y", "answer": "y"}])
    mixture = build_source(mixture_config({
        "a": {"weight": 1, "data": {"source": "jsonl", "files": {"train": held, "validation": held}}},
        "b": {"weight": 1, "data": {"source": "jsonl", "files": {"train": one, "validation": one}}}}))
    assert mixture.size("validation") == 4
    assert [mixture.example("validation", i).prompt for i in range(4)] == ["a0", "b0", "a1", "a2"]
    with pytest.raises(IndexError):
        mixture.example("validation", 4)


def test_a_source_without_the_held_out_split_is_named(tmp_path):
    train = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "q", "response": "a", "answer": "a"}])
    mine = {"source": "jsonl", "files": {"train": train}}
    mixture = build_source(mixture_config({"sums": {"weight": 1, "data": ADDITION},
                                           "mine": {"weight": 1, "data": mine}}))
    with pytest.raises(ConfigError, match=r"data\.mixture\.mine\.data: data\.files\.validation is not set"):
        mixture.size("validation")


# --- judging: each example by its own source ---------------------------------------------------

def test_is_correct_routes_to_the_examples_source(tmp_path):
    mixture = build_source(sums_and_words(tmp_path))
    addition = Example("12+30=", "42", "42", source="sums")
    word = Example("w1?", "w1", "w1", source="words")
    assert mixture.is_correct(addition, "42") and not mixture.is_correct(addition, "43")
    assert mixture.is_correct(word, "w1") and not mixture.is_correct(word, "42")
    with pytest.raises(DataError, match=r"names source 'other', which is not one of data.mixture's \['sums', 'words'"):
        mixture.is_correct(Example("1+1=", "2", "2", source="other"), "2")


def test_answers_without_their_example_are_refused_with_the_way_to_ask():
    mixture = build_source(mixture_config({"a": {"weight": 1, "data": ADDITION}}))
    with pytest.raises(DataError, match=r"source_of\(example\)\.final_answer"):
        mixture.final_answer("42")


def test_the_alphabet_is_every_sources_symbols(tmp_path):
    mixture = build_source(sums_and_words(tmp_path))
    assert set("0123456789+=w?h") <= set(mixture.alphabet)
    assert list(mixture.alphabet) == sorted(mixture.alphabet)


def scored(example: Example, response: str, group: int) -> ScoredSample:
    return ScoredSample(example, response, len(response), truncated=False, group=group)


def test_each_sources_samples_get_its_own_reward(tmp_path):
    """The run's reward is accuracy alone; words' replaces it with accuracy + 0.5 x format. The
    format reward asks the JSON-lines source (a non-empty response has its shape): a wrong but
    non-empty word scores 0.5, the additions' only their accuracy."""
    cfg = sums_and_words(tmp_path)
    cfg.mixture.words.reward = {"components": {"accuracy": {"weight": 1.0}, "format": {"weight": 0.5}}}
    mixture = build_source(cfg)
    reward = build_reward(OmegaConf.create({"components": {"accuracy": {"weight": 1.0}}}), mixture, 8)
    samples = [scored(Example("12+30=", "42", "42", source="sums"), "42", 0),
               scored(Example("w1?", "w1", "w1", source="words"), "w1", 1),
               scored(Example("12+30=", "42", "42", source="sums"), "41", 0),
               scored(Example("w1?", "w1", "w1", source="words"), "nope", 1)]
    out = reward(samples, mixture)
    assert out.total.tolist() == [1.0, 1.5, 0.0, 0.5]
    assert out.correct.tolist() == [True, True, False, False]
    assert out.components["format"].tolist() == [0.0, 1.0, 0.0, 1.0]  # the sums' reward has none: 0
    assert out.metrics["rewards/accuracy/mean"] == 0.5  # over all 4
    assert out.metrics["rewards/format/mean"] == 1.0  # over the 2 it scored
    assert out.metrics["rewards/total/mean"] == 0.75


def test_a_source_reward_without_the_accuracy_the_others_have_is_refused(tmp_path):
    cfg = sums_and_words(tmp_path)
    cfg.mixture.words.reward = {"components": {"format": {"weight": 1.0}}}
    with pytest.raises(ConfigError, match=r"the reward of \['words'\] has no accuracy component"):
        build_reward(OmegaConf.create({"components": {"accuracy": {"weight": 1.0}}}), build_source(cfg), 8)


# --- start-up checks --------------------------------------------------------------------------

@pytest.mark.parametrize("override, message", [
    ("data.mixture.two_digit.weight=0", r"data\.mixture\.two_digit\.weight=0 must be a positive number"),
    ("data.mixture.two_digit.weight=-1.5", r"data\.mixture\.two_digit\.weight=-1\.5 must be a positive number"),
    ("data.mixture.two_digit.weight=0.0001", r"data\.mixture\.two_digit\.weight=0\.0001 is .* at least 1/1000"),
    ("+data.mixture.two_digit.share=1", r"data\.mixture\.two_digit: unknown key\(s\) \['share'\]"),
    ("data.mixture.two_digit.data.source=nope", r"data\.mixture\.two_digit\.data\.source='nope' is not a source kind"),
    ("data.mixture.two_digit.data.source=mixture", r"a mixture's sources cannot be mixtures"),
    ("+data.mixture.two_digit.data.digits=2", r"data\.mixture\.two_digit\.data: unknown key\(s\) \['digits'\]"),
    ("data.mixture.two_digit.data.min_digits=x", r"data\.mixture\.two_digit\.data\.min_digits='x' is not valid"),
    ("data.mixture.two_digit.data.min_digits=3", r"data\.mixture\.two_digit\.data\.min_digits=3 is larger than "
                                                 r"data\.mixture\.two_digit\.data\.max_digits=2"),
    ("data.mixture.two_digit.reward={components: {nope: {weight: 1}}}",
     r"data\.mixture\.two_digit\.reward: reward\.components\.nope: unknown reward component"),
    ("data.mixture.two_digit.reward={weights: 1}", r"data\.mixture\.two_digit\.reward: unknown key\(s\) \['weights'\]"),
    ("data_curriculum=difficulty_schedule", r"data_curriculum=difficulty_schedule raises the task's difficulty, .*"
                                            r"data\.source='mixture'"),
])
def test_bad_mixtures_are_refused_at_start_up_naming_the_key(override, message):
    cfg = compose_config(["data=mixture", "algorithm=grpo", override])
    with pytest.raises(ConfigError, match=message):
        check_config(cfg)


def test_the_yaml_composes_and_passes_the_check():
    cfg = compose_config(["data=mixture", "algorithm=grpo"])
    check_config(cfg)
    assert build_source(cfg.data).source_names == ("two_digit", "three_digit")


# --- metrics per source -----------------------------------------------------------------------

def batch_of(scores, correct, source_index) -> Experience:
    """A rollout batch of one-token prompts and two-token responses, two rows a group."""
    rows = len(scores)
    return Experience(prompt_ids=torch.zeros(rows, 1, dtype=torch.long), prompt_mask=torch.ones(rows, 1),
                      response_ids=torch.zeros(rows, 2, dtype=torch.long), response_mask=torch.ones(rows, 2),
                      rollout_logprobs=torch.zeros(rows, 2), truncated=torch.zeros(rows, dtype=torch.bool),
                      scores=torch.tensor(scores), correct=torch.tensor(correct),
                      group_index=torch.arange(rows) // 2, source_index=torch.tensor(source_index))


def test_metrics_per_source_name_every_source_of_the_config():
    """Rows of sources a and b (index 0, 1); c has none in this batch: only its count."""
    exp = batch_of([1.0, 0.0, 1.5, 0.5], [1.0, 0.0, 1.0, 0.0], [0, 0, 1, 1])
    assert source_metrics(exp, ("a", "b", "c")) == {
        "rollout/a/count": 2.0, "rollout/a/reward_mean": 0.5, "rollout/a/accuracy": 0.5,
        "rollout/b/count": 2.0, "rollout/b/reward_mean": 1.0, "rollout/b/accuracy": 0.5,
        "rollout/c/count": 0.0}
    exp.correct = torch.full((4,), float("nan"))  # a reward without an accuracy term
    assert "rollout/a/accuracy" not in source_metrics(exp, ("a", "b", "c"))


def source_metrics_worker(rank, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        # rank 0 holds only a's rows, rank 1 only b's: neither holds every source of the config
        exp = batch_of([1.0, 0.0], [1.0, 0.0], [0, 0]) if rank == 0 else batch_of([1.0, 1.0, 1.0, 0.0],
                                                                                   [1.0, 1.0, 1.0, 0.0], [1, 1, 1, 1])
        (out_dir / f"rank{rank}.json").write_text(json.dumps(source_metrics(exp, ("a", "b", "c"))))
    finally:
        dist.destroy_process_group()


def test_two_ranks_log_the_same_metrics_per_source_over_both_ranks_rows(tmp_path):
    run_ranks(source_metrics_worker, free_port(), tmp_path)
    expected = {"rollout/a/count": 2.0, "rollout/a/reward_mean": 0.5, "rollout/a/accuracy": 0.5,
                "rollout/b/count": 4.0, "rollout/b/reward_mean": 0.75, "rollout/b/accuracy": 0.75,
                "rollout/c/count": 0.0}
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == expected


QUICK = ("logger=none", "callbacks.progress_bar=none", "trainer.max_steps=2", "trainer.val_check_interval=2",
         "callbacks.checkpoint.every_n_train_steps=2", "eval.num_prompts=8", "eval.batch_size=8",
         "eval.at_start=false")


def test_two_grpo_steps_on_a_mixture_log_each_sources_accuracy(tmp_path):
    """`posttrain data=mixture` on the embedded model, with the 3-digit sums replaced by a JSON-lines
    file: each rollout batch logs rollout/<source>/accuracy for both sources."""
    rows = [{"prompt": f"{i}*2=", "response": str(2 * i), "answer": str(2 * i)} for i in range(10)]
    doubles = write_jsonl(tmp_path / "doubles.jsonl", rows)
    command = [sys.executable, "-m", "posttrain.train", "data=mixture", "algorithm=grpo",
               "algorithm.warm_start.steps=0", "algorithm.prompts_per_step=4", "algorithm.group_size=2",
               "~data.mixture.three_digit",
               f"+data.mixture.doubles={{weight: 1, data: {{source: jsonl, files: {{train: {doubles}, "
               f"validation: {doubles}}}}}}}", *QUICK, f"paths.output_dir={tmp_path / 'run'}"]
    ran = run_command(command, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "rollout/reward_mean" in line]
    assert len(steps) == 2
    for line in steps:
        assert line["rollout/two_digit/count"] + line["rollout/doubles/count"] == 8  # 4 prompts x 2 samples
        for name in ("two_digit", "doubles"):
            if line[f"rollout/{name}/count"]:
                assert 0.0 <= line[f"rollout/{name}/accuracy"] <= 1.0


def test_best_of_n_reads_each_answer_with_its_examples_own_source(tmp_path):
    """posttrain-eval's best-of-N on a mixture: the final answers (for majority votes) come from
    each example's own source, as its verdicts do (the mixture itself extracts none)."""
    from types import SimpleNamespace

    from posttrain.eval.best_of_n import Judges, judge

    mixture = build_source(sums_and_words(tmp_path))
    sums, words = mixture.example("validation", 0), mixture.example("validation", 1)
    assert (sums.source, words.source) == ("sums", "words")
    samples = [SimpleNamespace(example=sums, response=sums.response), SimpleNamespace(example=sums, response="0"),
               SimpleNamespace(example=words, response=words.response), SimpleNamespace(example=words, response="x")]
    judged = judge(samples, mixture, Judges(), num_prompts=2)
    assert judged.correct.tolist() == [[1.0, 0.0], [1.0, 0.0]]
    assert judged.answers[0][0] == sums.answer and judged.answers[1][0] == words.answer
