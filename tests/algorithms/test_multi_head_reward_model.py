"""A reward model with several heads (algorithm.heads): each pair trains the head it names, the
export names the heads, the learned-reward scorer weights them (head_weights), embedded pairs
label `correct` and `concise`, and the mistakes a user can make are refused naming the key."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch
from conftest import compose_config, make_reward_model_dir
from transformers import AutoModelForSequenceClassification

from posttrain.algorithms.reward_model import RewardModelModule
from posttrain.config.check import check_config
from posttrain.data import arithmetic
from posttrain.data.examples import Example
from posttrain.data.preference import PreferencePair, PreferenceSource, check_pair_heads, collate_pairs
from posttrain.data.sources import ArithmeticSource
from posttrain.errors import ConfigError, DataError
from posttrain.files import save_pretrained_atomic
from posttrain.models.loading import load_tokenizer_and_model
from posttrain.models.tiny import build_char_tokenizer
from posttrain.prepare.preference_pairs import build_preference_source, shorter_right_pair
from posttrain.rewards import ScoredSample
from posttrain.rewards.reward_model import RewardModelScorer
from posttrain.rollout import RolloutBatch

SMALL_MODEL = ("model.hidden_size=32", "model.num_layers=1", "model.intermediate_size=64")
TWO_HEADS = ["correct", "concise"]
MIXED = ArithmeticSource(style="mixed")


def verbose_and_concise(example: Example) -> tuple[str, str]:
    problem = arithmetic.Problem(tuple(map(int, example.prompt.rstrip("=").split("+"))))
    return problem.solution("verbose"), problem.solution("concise")


def two_head_pairs(count: int = 6) -> list[PreferencePair]:
    """Alternately a `correct` pair (right over a wrong answer) and a `concise` pair (the sum alone
    over the written-out solution)."""
    pairs = []
    for i in range(count):
        example = MIXED.example("train", i)
        verbose, concise = verbose_and_concise(example)
        if i % 2 == 0:
            pairs.append(PreferencePair(example.prompt, concise, str(int(concise) + 1), "perturbed", example=example,
                                        head="correct"))
        else:
            pairs.append(PreferencePair(example.prompt, concise, verbose, "shorter_right", example=example,
                                        head="concise"))
    return pairs


def make_module(pairs, heads=TWO_HEADS, **options):
    torch.manual_seed(0)
    tokenizer, policy = load_tokenizer_and_model(compose_config(list(SMALL_MODEL)).model, MIXED.alphabet)
    cfg = compose_config(["algorithm=reward_model"])
    source = PreferenceSource(MIXED, {"train": pairs, "validation": pairs}, "test pairs")
    module = RewardModelModule(policy, tokenizer, source, cfg.algorithm.optim, cfg.rollout, 8, batch_size=len(pairs),
                               heads=heads, **options)
    torch.nn.init.normal_(module.policy.score.weight, std=1.0)  # heads that differ visibly
    return module


def capture_logs(module) -> dict:
    logged = {}
    module.log = lambda name, value, **kw: logged.__setitem__(name, float(value))
    module.log_dict = lambda values, **kw: logged.update({k: float(v) for k, v in values.items()})
    return logged


def all_head_logits(module, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, heads] scores of the chosen and of the rejected rows, each side through the model alone."""
    with torch.no_grad():
        return tuple(module.policy(input_ids=batch[f"{s}_input_ids"], attention_mask=batch[f"{s}_attention_mask"])
                     .logits for s in ("chosen", "rejected"))


# --- training: each pair on its own head -------------------------------------------------------

def test_each_pair_is_scored_and_trained_on_the_head_it_names():
    pairs = two_head_pairs()
    module = make_module(pairs, margin=0.25)
    batch = collate_pairs(pairs, module.tokenizer)
    chosen_all, rejected_all = all_head_logits(module, batch)
    assert chosen_all.shape == (len(pairs), 2)
    heads = torch.tensor([TWO_HEADS.index(p.head) for p in pairs])
    rows = torch.arange(len(pairs))
    chosen, rejected = module.pair_scores(batch)
    torch.testing.assert_close(chosen.detach(), chosen_all[rows, heads], atol=1e-5, rtol=0)
    torch.testing.assert_close(rejected.detach(), rejected_all[rows, heads], atol=1e-5, rtol=0)
    logged = capture_logs(module)
    loss = module.training_step(batch, 0)
    diff = chosen_all[rows, heads] - rejected_all[rows, heads] - 0.25
    assert loss.item() == pytest.approx(-torch.nn.functional.logsigmoid(diff).mean().item(), rel=1e-5)
    for name, index in (("correct", 0), ("concise", 1)):
        mine = heads == index
        right = (chosen_all[mine, index] > rejected_all[mine, index]).float().mean().item()
        assert logged[f"rewards/heads/{name}/accuracy"] == pytest.approx(right)


def test_a_head_gets_no_gradient_from_the_pairs_of_another():
    pairs = [pair for pair in two_head_pairs() if pair.head == "correct"]
    module = make_module(pairs)
    capture_logs(module)
    module.training_step(collate_pairs(pairs, module.tokenizer), 0).backward()
    gradient = module.policy.score.weight.grad
    assert gradient[0].abs().sum() > 0 and gradient[1].abs().sum() == 0


def test_held_out_pair_accuracy_is_reported_per_head_and_overall():
    pairs = two_head_pairs(8)
    module = make_module(pairs)
    batch = collate_pairs(pairs, module.tokenizer)
    batch["counted"] = torch.tensor([True] * 7 + [False])  # the last is a stand-in that evens out ranks
    chosen_all, rejected_all = all_head_logits(module, batch)
    module._trainer = SimpleNamespace(global_step=0)
    logged = capture_logs(module)
    module.on_validation_epoch_start()
    module.validation_step(batch, 0)
    module.on_validation_epoch_end()
    rows = torch.arange(7)
    heads = torch.tensor([TWO_HEADS.index(p.head) for p in pairs[:7]])
    right = chosen_all[rows, heads] > rejected_all[rows, heads]
    assert logged["eval/pair_accuracy"] == pytest.approx(right.float().mean().item())
    for index, name in enumerate(TWO_HEADS):
        assert logged[f"eval/heads/{name}/pair_accuracy"] == pytest.approx(right[heads == index].float().mean().item())


def test_one_head_trains_on_every_pair_whatever_it_names():
    pairs = two_head_pairs()
    module = make_module(pairs, heads=["reward"])
    batch = collate_pairs(pairs, module.tokenizer)
    chosen_all, rejected_all = all_head_logits(module, batch)
    chosen, rejected = module.pair_scores(batch)
    torch.testing.assert_close(chosen.detach(), chosen_all[:, 0], atol=1e-5, rtol=0)
    torch.testing.assert_close(rejected.detach(), rejected_all[:, 0], atol=1e-5, rtol=0)
    logged = capture_logs(module)
    module.training_step(batch, 0)
    assert not any(key.startswith("rewards/heads/") for key in logged)


def test_a_pair_naming_another_head_is_refused():
    pairs = two_head_pairs()
    pairs[1].head = "helpful"
    module = make_module(pairs)
    with pytest.raises(DataError, match=r"heads \['helpful'\], not among algorithm\.heads=\['correct', 'concise'\]"):
        module.pair_scores(collate_pairs(pairs, module.tokenizer))
    with pytest.raises(DataError, match=r"names head 'helpful' \(column preference\.columns\.head\)"):
        check_pair_heads(PreferenceSource(MIXED, {"train": pairs}, "test"), TWO_HEADS)
    check_pair_heads(PreferenceSource(MIXED, {"train": pairs}, "test"), ["reward"])  # one head: every pair


# --- export and scoring: sum_h w_h r_h ------------------------------------------------------------

@pytest.fixture(scope="module")
def two_head_dir(tmp_path_factory):
    module = make_module(two_head_pairs())
    directory = tmp_path_factory.mktemp("rm") / "hf_model"
    save_pretrained_atomic(module.policy, module.tokenizer, directory)
    return directory


def scored_samples(count: int = 4) -> list[ScoredSample]:
    out = []
    for i in range(count):
        example = MIXED.example("validation", i)
        verbose, concise = verbose_and_concise(example)
        response = concise if i % 2 else verbose
        out.append(ScoredSample(example, response, len(response) + 1, truncated=False, group=i))
    return out


def head_scores(directory, samples) -> torch.Tensor:
    """[B, heads] of each sample alone (prompt + response + EOS) through the exported model."""
    from transformers import AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(directory).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    with torch.no_grad():
        return torch.cat([model(input_ids=torch.tensor([tokenizer(s.example.prompt + s.response,
                                                                   add_special_tokens=False)["input_ids"]
                                                         + [tokenizer.eos_token_id]])).logits for s in samples])


def test_the_export_names_its_heads(two_head_dir):
    config = json.loads((two_head_dir / "config.json").read_text())
    assert config["reward_heads"] == TWO_HEADS
    assert config["id2label"] == {"0": "correct", "1": "concise"}
    assert AutoModelForSequenceClassification.from_pretrained(two_head_dir).config.num_labels == 2


def test_the_reward_is_the_weighted_sum_of_the_heads_and_each_head_is_logged(two_head_dir):
    samples = scored_samples()
    by_hand = head_scores(two_head_dir, samples)
    assert (by_hand[:, 0] - by_hand[:, 1]).abs().min() > 1e-3  # the heads differ: the weights show
    scorer = RewardModelScorer(path=str(two_head_dir), head_weights={"correct": 1.0, "concise": 0.3})
    reward = scorer(samples, MIXED)
    torch.testing.assert_close(reward, by_hand[:, 0] + 0.3 * by_hand[:, 1], atol=1e-5, rtol=0)
    metrics = scorer.take_metrics()
    assert metrics["rewards/reward_model/correct/mean"] == pytest.approx(by_hand[:, 0].mean().item(), abs=1e-5)
    assert metrics["rewards/reward_model/concise/mean"] == pytest.approx(by_hand[:, 1].mean().item(), abs=1e-5)
    # a head not named weighs 0; null: every head weighs 1
    only_concise = RewardModelScorer(path=str(two_head_dir), head_weights={"concise": 2.0})(samples, MIXED)
    torch.testing.assert_close(only_concise, 2.0 * by_hand[:, 1], atol=1e-5, rtol=0)
    every = RewardModelScorer(path=str(two_head_dir))(samples, MIXED)
    torch.testing.assert_close(every, by_hand.sum(1), atol=1e-5, rtol=0)


def test_a_weight_naming_an_unknown_head_is_refused_at_start_up(two_head_dir):
    with pytest.raises(ConfigError, match=r"reward\.components\.reward_model\.head_weights names \['helpful'\], not "
                                          r"heads of the reward model, whose heads are \['correct', 'concise'\]"):
        RewardModelScorer(path=str(two_head_dir), head_weights={"correct": 1.0, "helpful": 0.5})
    cfg = compose_config(["algorithm=grpo", "reward=reward_model", f"reward.path={two_head_dir}",
                          "reward.components.reward_model.head_weights={correct: 1.0, helpful: 0.5}"])
    with pytest.raises(ConfigError, match=r"head_weights names \['helpful'\].*\['correct', 'concise'\]"):
        check_config(cfg, {"algorithm": "grpo", "reward": "reward_model"})
    cfg = compose_config(["algorithm=grpo", "reward=reward_model", f"reward.path={two_head_dir}",
                          "reward.components.reward_model.head_weights={correct: 1.0, concise: high}"])
    with pytest.raises(ConfigError, match=r"head_weights=.* is not valid: expected null or a mapping head -> weight"):
        check_config(cfg, {"algorithm": "grpo", "reward": "reward_model"})


def test_a_model_without_head_names_has_the_one_head_reward(tmp_path):
    directory = make_reward_model_dir(tmp_path / "legacy", build_char_tokenizer(arithmetic.ALPHABET), seed=0)
    samples = scored_samples()
    plain = RewardModelScorer(path=str(directory))(samples, MIXED)
    doubled = RewardModelScorer(path=str(directory), head_weights={"reward": 2.0})(samples, MIXED)
    torch.testing.assert_close(doubled, 2.0 * plain)
    with pytest.raises(ConfigError, match=r"names \['correct'\].*whose heads are \['reward'\]"):
        RewardModelScorer(path=str(directory), head_weights={"correct": 1.0})


def test_unnamed_labels_and_an_ensemble_of_different_heads_are_refused(tmp_path, two_head_dir):
    legacy = make_reward_model_dir(tmp_path / "legacy", build_char_tokenizer(arithmetic.ALPHABET), seed=0)
    with pytest.raises(ConfigError, match=r"reward_model\.paths\[1\]=.* has the heads \['correct', 'concise'\], "
                                          r"reward\.components\.reward_model\.paths\[0\]=.*legacy' has \['reward'\]"):
        RewardModelScorer(paths=[str(legacy), str(two_head_dir)])
    config = json.loads((two_head_dir / "config.json").read_text())
    unnamed = tmp_path / "unnamed"
    unnamed.mkdir()
    (unnamed / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "reward_heads"}))
    with pytest.raises(ConfigError, match=r"unnamed.* names no reward heads \(reward_heads\) but has num_labels=2"):
        RewardModelScorer(path=str(unnamed))


# --- the heads' pairs ------------------------------------------------------------------------------

def test_the_concise_pair_is_the_shortest_right_response_over_the_longest():
    example = MIXED.example("train", 0)
    verbose, concise = verbose_and_concise(example)
    wrong = str(int(concise) + 1)
    reference_verbose = Example(example.prompt, verbose, example.answer)
    pair = shorter_right_pair(reference_verbose, [wrong, concise, verbose], MIXED, random.Random(0))
    assert (pair.chosen, pair.rejected, pair.kind) == (concise, verbose, "shorter_right")
    # a right answer cut by the budget never finished: not a candidate
    assert shorter_right_pair(reference_verbose, [concise, wrong], MIXED, ended=[False, True]) is None
    # every right response of one length: no pair
    assert shorter_right_pair(reference_verbose, [verbose, wrong], MIXED) is None
    # a wrong short answer is never preferred for being short
    reference_concise = Example(example.prompt, concise, example.answer)
    assert shorter_right_pair(reference_concise, [wrong, verbose], MIXED).chosen == concise


class MixedEngine:
    """A stand-in sampler: per prompt the concise right answer, the verbose right one, a wrong one
    (in the embedded tiny model's tokens: its character tokenizer over the task's alphabet)."""

    def __init__(self):
        self.tokenizer = build_char_tokenizer(MIXED.alphabet)

    def generate(self, model, prompt_ids, prompt_mask, params, eos_token_id, pad_token_id, generator=None):
        prompts = self.tokenizer.batch_decode([ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)])
        texts = []
        for row, prompt in enumerate(prompts):
            verbose, concise = verbose_and_concise(Example(prompt, "", None))
            texts.append((concise, verbose, str(int(concise) + 1))[row % 3])
        rows = [self.tokenizer(t, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id] for t in texts]
        ids = torch.full((len(rows), max(map(len, rows))), pad_token_id)
        mask = torch.zeros(ids.shape, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
        return RolloutBatch(prompt_ids, prompt_mask, ids, mask, torch.zeros(ids.shape),
                            torch.zeros(len(rows), dtype=torch.bool))


TWO_HEAD_RUN = ("algorithm=reward_model", "algorithm.warm_start.steps=0", "algorithm.heads=[correct,concise]",
                "data.style=mixed", "preference.samples_per_prompt=3", "preference.num_train_pairs=24",
                "preference.num_validation_pairs=8", *SMALL_MODEL)


def use_mixed_engine(monkeypatch):
    import posttrain.prepare.sampling

    monkeypatch.setattr(posttrain.prepare.sampling, "build_rollout", lambda name, **options: MixedEngine())


def test_embedded_pairs_give_each_prompt_a_pair_per_head(tmp_path, monkeypatch):
    cfg = compose_config([*TWO_HEAD_RUN, f"paths.cache_dir={tmp_path}"], tmp_path / "run")
    task = ArithmeticSource(style="mixed", seed=cfg.data.seed)
    tokenizer, policy = load_tokenizer_and_model(cfg.model, task.alphabet)
    use_mixed_engine(monkeypatch)
    source = build_preference_source(cfg, task, tokenizer, policy)
    for split, prompts in (("train", 24), ("validation", 8)):
        pairs = source.pairs(split)
        assert len(pairs) == 2 * prompts  # every prompt has a right/wrong and a short/long right pair
        for pair in pairs:
            assert task.is_correct(pair.example, pair.chosen)
            if pair.head == "correct":
                assert not task.is_correct(pair.example, pair.rejected) and pair.kind == "on_policy"
            else:
                assert pair.head == "concise" and pair.kind == "shorter_right"
                assert task.is_correct(pair.example, pair.rejected) and len(pair.chosen) < len(pair.rejected)
    # the cache keeps each pair's head; a one-head run's pairs are another entry
    again = build_preference_source(cfg, task, tokenizer, policy)
    assert [p.head for p in again.pairs("train")] == [p.head for p in source.pairs("train")]
    assert len(list((tmp_path / "preference_pairs").glob("*.json"))) == 1


def test_heads_the_embedded_pairs_cannot_label_are_refused_before_the_warm_start():
    cfg = compose_config(["algorithm=reward_model", "algorithm.heads=[correct,helpful]"])
    with pytest.raises(ConfigError, match=r"algorithm\.heads=\['correct', 'helpful'\]: the embedded preference pairs "
                                          r"label only the heads \['correct', 'concise'\].*not \['helpful'\]"):
        check_config(cfg, {"algorithm": "reward_model"})
    cfg = compose_config(["algorithm=reward_model", "algorithm.heads=[correct,correct]"])
    with pytest.raises(ConfigError, match=r"algorithm\.heads=\['correct', 'correct'\] is not valid: expected a "
                                          r"non-empty list of distinct names"):
        check_config(cfg, {"algorithm": "reward_model"})


def test_dataset_pairs_name_their_head_in_a_column(tmp_path):
    rows = [{"prompt": f"q{i}", "chosen": "a", "rejected": "b", "aspect": ("helpful", "harmless")[i % 2]}
            for i in range(6)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["algorithm=reward_model", "algorithm.heads=[helpful,harmless]", "preference.source=dataset",
              f"preference.path={path}", "preference.validation_size=2"]
    source = build_preference_source(compose_config([*common, "preference.columns.head=aspect"]),
                                     ArithmeticSource(), None, None)
    assert sorted(p.head for split in ("train", "validation") for p in source.pairs(split)) == \
        sorted(r["aspect"] for r in rows)
    with pytest.raises(DataError, match=r"pairs\.jsonl split 'train' row \d+ names no head \(column "
                                        r"preference\.columns\.head\), but algorithm\.heads=\['helpful', 'harmless'\]"):
        build_preference_source(compose_config(common), ArithmeticSource(), None, None)


def test_a_short_two_head_run_reports_each_head_and_its_export_scores(tmp_path, monkeypatch):
    from posttrain.train import run

    use_mixed_engine(monkeypatch)
    run_dir = tmp_path / "run"
    summary = run(compose_config([*TWO_HEAD_RUN, f"paths.cache_dir={tmp_path}", "logger=none",
                                  "callbacks.progress_bar=none", "algorithm.batch_size=8", "eval.batch_size=16",
                                  "trainer.max_steps=3", "trainer.val_check_interval=3"], run_dir))
    for key in ("eval/heads/correct/pair_accuracy", "eval/heads/concise/pair_accuracy", "eval/pair_accuracy",
                "rewards/heads/correct/accuracy", "pairs/train/shorter_right_share"):
        assert key in summary, key
    assert summary["pairs/train/shorter_right_share"] == pytest.approx(0.5)
    scorer = RewardModelScorer(path=str(run_dir / "hf_model"), head_weights={"concise": 1.0})
    assert scorer.heads == TWO_HEADS
    assert scorer(scored_samples(), MIXED).shape == (4,)


def test_the_head_benchmark_asks_each_head_about_right_and_wrong_answers_of_both_forms(two_head_dir, capsys,
                                                                                       monkeypatch):
    from conftest import load_benchmark

    reward_heads = load_benchmark("reward_heads")
    example = MIXED.example("validation", 0)
    problem = arithmetic.Problem(tuple(map(int, example.prompt.rstrip("=").split("+"))))
    answers = reward_heads.answers(problem)
    for kind, answer in answers.items():
        assert MIXED.is_correct(example, answer) == kind.startswith("right"), (kind, answer)
        assert MIXED.has_style(answer)
    assert len(answers["right concise"]) < len(answers["right verbose"])
    monkeypatch.setattr("sys.argv", ["reward_heads.py", str(two_head_dir), "--prompts", "4", "--digits", "3"])
    reward_heads.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["answer", *TWO_HEADS]
    assert [line.rsplit(maxsplit=2)[0].strip() for line in lines[1:]] == list(answers)
