"""Curricula as plain objects: pass-rate cache keys, resume, dynamic-sampling filters, and
rank-disjoint prompt streams. A fake `estimate_pass_rates` stands in for the policy."""

import json
import zlib

import pytest
import torch
from omegaconf import OmegaConf

from posttrain.data import curriculum
from posttrain.data.curriculum import Curriculum, build_curriculum
from posttrain.data.datamodule import ExampleCursor
from posttrain.data.examples import Example
from posttrain.data.sources import build_source
from posttrain.errors import ConfigError

SETTINGS = {"samples_per_prompt": 8, "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8}}


def arithmetic(digits=3, seed=0):
    return build_source(OmegaConf.create({"source": "arithmetic", "min_digits": digits, "max_digits": digits,
                                          "num_operands": 2, "style": "concise", "seed": seed}))


class FakeEstimator:
    """Pass rates that are a fixed function of the prompt text, counting the calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, prompts):
        self.calls += 1
        return [(zlib.crc32(e.prompt.encode()) % 11) / 10 for e in prompts]


def must_not_estimate(prompts):
    raise AssertionError("estimate_pass_rates was called")


def must_not_fingerprint():
    raise AssertionError("the starting weights were fingerprinted")


def pass_rate_filter(source, rank=0, world_size=1, cache_dir=None, **options):
    cfg = OmegaConf.create({"name": "pass_rate_filter", "low": 0.1, "high": 0.9, "pool_size": 32, **options})
    ranks = {"rank": rank, "world_size": world_size} if world_size > 1 else {}
    return build_curriculum(cfg, ExampleCursor(source, "train", 0, **ranks), cache_dir)


def prompts(examples):
    return [e.prompt for e in examples]


# --- 1. the pass-rate cache key follows the prompt pool, the weights and the settings ------------

def test_cache_key_depends_on_prompts_weights_and_settings():
    pool = [Example("12+34=", "46", "46"), Example("5+6=", "11", "11")]
    key = curriculum.pass_rate_cache_key(pool, "weights-a", SETTINGS)
    assert key == curriculum.pass_rate_cache_key(list(pool), "weights-a", json.loads(json.dumps(SETTINGS)))
    assert key == curriculum.pass_rate_cache_key(pool, "weights-a", OmegaConf.create(SETTINGS))  # a DictConfig too
    assert key == curriculum.pass_rate_cache_key(pool, "weights-a", dict(reversed(list(SETTINGS.items()))))
    others = [
        curriculum.pass_rate_cache_key(pool[:1], "weights-a", SETTINGS),
        curriculum.pass_rate_cache_key([pool[0], Example("5+6=", "11", "12")], "weights-a", SETTINGS),
        curriculum.pass_rate_cache_key(pool, "weights-b", SETTINGS),
        curriculum.pass_rate_cache_key(pool, "weights-a", {**SETTINGS, "samples_per_prompt": 16}),
        curriculum.pass_rate_cache_key(pool, "weights-a", {**SETTINGS, "sampling": {**SETTINGS["sampling"],
                                                                                    "temperature": 0.7}}),
    ]
    assert len({key, *others}) == len(others) + 1


def test_pass_rates_are_cached_per_data_config(tmp_path):
    estimate = FakeEstimator()
    pass_rate_filter(arithmetic(3), cache_dir=str(tmp_path)).setup(estimate, lambda: "weights", SETTINGS)
    pass_rate_filter(arithmetic(5), cache_dir=str(tmp_path)).setup(estimate, lambda: "weights", SETTINGS)
    assert estimate.calls == 2  # the 5-digit pool is not served the 3-digit rates
    assert len(list(tmp_path.glob("pass_rates-*.json"))) == 2

    again = pass_rate_filter(arithmetic(5), cache_dir=str(tmp_path))
    again.setup(must_not_estimate, lambda: "weights", SETTINGS)  # same config: a cache hit
    fresh = pass_rate_filter(arithmetic(5))
    fresh.setup(FakeEstimator(), lambda: "weights", SETTINGS)
    assert again.rates == fresh.rates and prompts(again.kept) == prompts(fresh.kept)

    pass_rate_filter(arithmetic(5), cache_dir=str(tmp_path)).setup(estimate, lambda: "other weights", SETTINGS)
    assert estimate.calls == 3 and len(list(tmp_path.glob("pass_rates-*.json"))) == 3


# --- 2. pass_rate_filter resumes without re-scoring ---------------------------------------------

def test_pass_rate_filter_resumes_without_reestimating():
    original = pass_rate_filter(arithmetic())
    original.setup(FakeEstimator(), lambda: "weights", SETTINGS)
    original.next_prompts(40)  # past the first pass over the kept prompts
    state = json.loads(json.dumps(original.state_dict()))  # plain data, fit for any checkpoint
    expected = prompts(original.next_prompts(25))

    resumed = pass_rate_filter(arithmetic())
    resumed.load_state_dict(state)
    resumed.setup(must_not_estimate, must_not_fingerprint, SETTINGS)  # on_train_start after a resume
    assert prompts(resumed.next_prompts(25)) == expected
    assert resumed.rates == original.rates


def test_pass_rate_filter_resume_keeps_the_saved_kept_list_even_if_the_band_changes():
    original = pass_rate_filter(arithmetic())
    original.setup(FakeEstimator(), lambda: "weights", SETTINGS)
    resumed = pass_rate_filter(arithmetic(), low=0.5, high=0.6)
    resumed.load_state_dict(original.state_dict())
    resumed.setup(must_not_estimate, must_not_fingerprint, SETTINGS)
    assert prompts(resumed.kept) == prompts(original.kept)


def test_pass_rate_filter_resume_on_a_different_pool_is_refused():
    original = pass_rate_filter(arithmetic(3))
    original.setup(FakeEstimator(), lambda: "weights", SETTINGS)
    resumed = pass_rate_filter(arithmetic(4))
    resumed.load_state_dict(original.state_dict())
    with pytest.raises(ConfigError, match="pass_rate_filter"):
        resumed.setup(must_not_estimate, must_not_fingerprint, SETTINGS)


# --- 3. dynamic sampling filters on reward or on accuracy ----------------------------------------

GROUPS = torch.tensor([0, 0, 1, 1, 2, 2])
SCORES = torch.tensor([1.0, 1.2, 0.0, 0.0, 0.5, 0.5])  # group 0: spread from a shaping term only
CORRECT = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])  # group 1: mixed correctness, same total


def dynamic_sampling(**options):
    cfg = OmegaConf.create({"name": "dynamic_sampling", "max_extra_rounds": 3, **options})
    return build_curriculum(cfg, ExampleCursor(arithmetic(), "train", 0))


def test_dynamic_sampling_filters_on_reward_by_default(make_config):
    cfg = make_config("algorithm=grpo", "data_curriculum=dynamic_sampling")  # the dapo preset filters on accuracy
    assert cfg.data_curriculum.filter_on == "reward"
    module = build_curriculum(cfg.data_curriculum, ExampleCursor(arithmetic(), "train", 0))
    assert module.keep_groups(SCORES, CORRECT, GROUPS).tolist() == [True, True, False, False, False, False]


def test_dynamic_sampling_can_filter_on_accuracy():
    keep = dynamic_sampling(filter_on="accuracy").keep_groups(SCORES, CORRECT, GROUPS)
    assert keep.tolist() == [False, False, True, True, False, False]


def test_filter_on_accuracy_without_an_accuracy_reward_names_the_key():
    with pytest.raises(ConfigError, match="data_curriculum.filter_on"):
        dynamic_sampling(filter_on="accuracy").keep_groups(SCORES, torch.full((6,), float("nan")), GROUPS)
    with pytest.raises(ConfigError, match="data_curriculum.filter_on"):
        dynamic_sampling(filter_on="loss")


def test_every_curriculum_takes_correct_in_keep_groups():
    source = arithmetic()
    for cur in (Curriculum(ExampleCursor(source, "train", 0)), pass_rate_filter(source)):
        assert cur.keep_groups(SCORES, CORRECT, GROUPS).all()


# --- 4. ranks draw disjoint prompts ---------------------------------------------------------------

@pytest.mark.parametrize("world_size", [2, 3])
def test_cursor_ranks_split_the_single_process_stream(world_size):
    source, count = arithmetic(), 12
    single = ExampleCursor(source, "train", 0).take(world_size * count)
    assert prompts(single) == [source.example("train", i).prompt for i in range(world_size * count)]  # as before
    cursors = [ExampleCursor(source, "train", 0, rank=r, world_size=world_size) for r in range(world_size)]
    drawn = [c.take(count // 2) + c.take(count - count // 2) for c in cursors]
    for rank, examples in enumerate(drawn):
        assert prompts(examples) == prompts(single[rank::world_size])
    assert sorted(p for d in drawn for p in prompts(d)) == sorted(prompts(single))  # union, no overlap
    assert all(c.position == count for c in cursors)  # examples this rank has taken


def test_cursor_rank_resumes_from_its_own_position():
    source = arithmetic()
    straight = ExampleCursor(source, "train", 0, rank=1, world_size=2).take(10)
    resumed = ExampleCursor(source, "train", 0, position=4, rank=1, world_size=2).take(6)
    assert prompts(resumed) == prompts(straight[4:])
    with pytest.raises(ValueError, match="rank"):
        ExampleCursor(source, "train", 0, rank=2, world_size=2)


def test_pass_rate_filter_ranks_draw_disjoint_prompts():
    source, count = arithmetic(), 30  # more than the kept prompts: crosses reshuffles
    single = pass_rate_filter(source)
    single.setup(FakeEstimator(), lambda: "weights", SETTINGS)
    assert count < 2 * len(single.kept) < 2 * count
    expected = prompts(single.next_prompts(2 * count))
    drawn = []
    for rank in range(2):
        cur = pass_rate_filter(source, rank=rank, world_size=2)
        cur.setup(FakeEstimator(), lambda: "weights", SETTINGS)
        drawn.append(prompts(cur.next_prompts(count)))
    assert drawn[0] == expected[0::2] and drawn[1] == expected[1::2]
    first_pass = len(single.kept)  # within one pass over the kept list the ranks never share a prompt
    assert not set(expected[0:first_pass:2]) & set(expected[1:first_pass:2])
