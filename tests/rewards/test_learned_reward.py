"""Learned rewards in online RL (rewards/reward_model.py): a sequence-classification reward model
(or an ensemble) as a reward component, and the held-out proxy reward beside the accuracy.

Reward model directories are built here in the real on-disk format (what algorithm=reward_model
exports): a tiny Qwen2ForSequenceClassification with one label and a pad token, plus a tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import EASY_TASK, FAST_RUN, compose_config, make_reward_model_dir
from omegaconf import OmegaConf

from posttrain.core import ensemble_lower_bound
from posttrain.data.arithmetic import ALPHABET
from posttrain.data.examples import Example
from posttrain.data.sources import ArithmeticSource
from posttrain.errors import ConfigError
from posttrain.models.tiny import build_char_tokenizer
from posttrain.rewards import ScoredSample, build_reward
from posttrain.rewards.reward_model import RewardModelScorer
from posttrain.train import run

SOURCE = ArithmeticSource(style="concise", min_digits=2, max_digits=2)


@pytest.fixture(scope="module")
def char_tokenizer():
    return build_char_tokenizer(ALPHABET)


@pytest.fixture(scope="module")
def reward_dirs(tmp_path_factory, char_tokenizer) -> list[Path]:
    root = tmp_path_factory.mktemp("reward_models")
    return [make_reward_model_dir(root / f"rm{seed}", char_tokenizer, seed) for seed in range(3)]


def samples(count: int = 6) -> list[ScoredSample]:
    """Responses of several lengths, right and wrong: one truncated by the budget, one stopped as
    looping (rollout.repetition), one cut by the PRM early stop; none of these three produced
    an EOS."""
    out = []
    for i in range(count):
        example = SOURCE.example("validation", i)
        response = example.response if i % 2 == 0 else example.response + "7" * i
        out.append(ScoredSample(example, response, len(response) + 1, truncated=i == 3, group=i // 2,
                                repeated=i == 4, prm_stopped=i == 5))
    return out


def eos_unless_stopped(sample: ScoredSample, eos_token_id: int) -> list[int]:
    """The EOS a response generated: none when the budget, the loop check or the PRM stopped it."""
    return [] if sample.truncated or sample.repeated or sample.prm_stopped else [eos_token_id]


def own_forward(directory: Path, rows: list[list[int]]) -> torch.Tensor:
    """Each row alone through the model's own forward: no padding at all."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(directory).eval()
    with torch.no_grad():
        return torch.stack([model(input_ids=torch.tensor([row])).logits[0, 0] for row in rows])


def test_scores_are_the_models_own_forward_on_prompt_response_eos(reward_dirs, char_tokenizer):
    batch = samples()
    scorer = RewardModelScorer(path=str(reward_dirs[0]), batch_size=4)
    scores = scorer(batch, SOURCE)
    assert scorer.take_metrics() == {}  # one model: no spread, its mean is the component's own
    # the SFT layout: prompt tokens, response tokens, EOS unless the response was stopped without one
    rows = [char_tokenizer(s.example.prompt + s.response, add_special_tokens=False)["input_ids"]
            + eos_unless_stopped(s, char_tokenizer.eos_token_id) for s in batch]
    assert torch.allclose(scores, own_forward(reward_dirs[0], rows), atol=1e-5)
    assert scores.shape == (len(batch),) and scores.std() > 0.01  # distinct scores: the test can tell rows apart


def test_rows_longer_than_the_reward_models_context_keep_their_end_and_are_counted(tmp_path, char_tokenizer):
    """prompt + response past the model's positions: the prompt's start is dropped (the score is
    read at the last token, the response's end), never a crash; the share cut is logged."""
    context = 12
    directory = make_reward_model_dir(tmp_path / "short_rm", char_tokenizer, seed=0, context=context)
    batch = samples()
    rows = [char_tokenizer(s.example.prompt + s.response, add_special_tokens=False)["input_ids"]
            + eos_unless_stopped(s, char_tokenizer.eos_token_id) for s in batch]
    long_rows = [len(row) > context for row in rows]
    assert 0 < sum(long_rows) < len(rows)  # some rows fit, some do not
    scorer = RewardModelScorer(path=str(directory), batch_size=4)
    scores = scorer(batch, SOURCE)
    assert torch.allclose(scores, own_forward(directory, [row[-context:] for row in rows]), atol=1e-5)
    assert scorer.take_metrics() == {"rewards/reward_model/truncated_frac": sum(long_rows) / len(rows)}
    short = [s for s, long in zip(batch, long_rows) if not long]
    scorer(short, SOURCE)
    assert scorer.take_metrics() == {}  # nothing cut: nothing to report


def test_batch_size_does_not_change_the_scores(reward_dirs):
    batch = samples()
    one_by_one = RewardModelScorer(path=str(reward_dirs[0]), batch_size=1)(batch, SOURCE)
    together = RewardModelScorer(path=str(reward_dirs[0]), batch_size=6)(batch, SOURCE)
    assert torch.allclose(one_by_one, together, atol=1e-5)


def test_chat_prompts_are_rendered_with_the_reward_models_chat_template(tmp_path, tiny_hf_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_hf_model("qwen2"))
    directory = make_reward_model_dir(tmp_path / "rm", tokenizer, seed=0)
    messages = [{"role": "user", "content": "What is 12+30?"}]
    example = Example(prompt="What is 12+30?", response="42", answer="42", messages=messages)
    score = RewardModelScorer(path=str(directory))([ScoredSample(example, "42", 2, False, 0)], SOURCE)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>user")
    row = tokenizer(rendered + "42", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert torch.allclose(score, own_forward(directory, [row]), atol=1e-5)


def test_an_ensemble_scores_mean_minus_k_std_and_logs_the_spread(reward_dirs):
    batch = samples()
    singles = torch.stack([RewardModelScorer(path=str(d))(batch, SOURCE) for d in reward_dirs])  # [3, B]
    scorer = RewardModelScorer(paths=[str(d) for d in reward_dirs], std_coef=0.5)
    scores = scorer(batch, SOURCE)
    for i in range(len(batch)):  # by hand: mean and unbiased std over the 3 models
        column = [float(singles[m, i]) for m in range(3)]
        mean = sum(column) / 3
        std = (sum((c - mean) ** 2 for c in column) / 2) ** 0.5
        assert abs(float(scores[i]) - (mean - 0.5 * std)) < 1e-5
    metrics = scorer.take_metrics()
    assert metrics["rewards/reward_model/std"] == pytest.approx(float(singles.std(dim=0).mean()), abs=1e-5)
    assert metrics["rewards/reward_model/model2/mean"] == pytest.approx(float(singles[2].mean()), abs=1e-5)
    assert scorer.take_metrics() == {}  # taken once: a later log never repeats stale stats


def test_one_model_has_no_spread():
    scores = torch.tensor([[1.0, -2.0]])
    lower, spread = ensemble_lower_bound(scores, std_coef=3.0)
    assert lower.tolist() == [1.0, -2.0] and spread.tolist() == [0.0, 0.0]


def test_inside_a_composite_with_accuracy(reward_dirs):
    cfg = OmegaConf.create({"name": "mix", "components": {
        "accuracy": {"weight": 1.0},
        "reward_model": {"weight": 0.5, "paths": [str(d) for d in reward_dirs[:2]], "std_coef": 1.0}}})
    batch = samples()
    out = build_reward(cfg, SOURCE, max_new_tokens=8)(batch, SOURCE)
    learned = RewardModelScorer(paths=[str(d) for d in reward_dirs[:2]])(batch, SOURCE)
    correct = torch.tensor([float(SOURCE.is_correct(s.example, s.response)) for s in batch])
    assert correct.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert torch.allclose(out.total, correct + 0.5 * learned, atol=1e-5)
    assert torch.allclose(out.components["reward_model"], learned, atol=1e-5)
    assert "rewards/reward_model/std" in out.metrics and "rewards/reward_model/mean" in out.metrics


def test_the_reward_model_preset_trains_on_the_model_and_logs_accuracy(reward_dirs):
    from posttrain.conf import CONFIG_DIR

    cfg = OmegaConf.load(Path(CONFIG_DIR) / "reward" / "reward_model.yaml")
    cfg.path = str(reward_dirs[1])  # reward.path=<dir>, read by the component through ${reward.path}
    resolved = OmegaConf.to_container(OmegaConf.create({"reward": cfg}), resolve=True)["reward"]
    reward = build_reward(OmegaConf.create(resolved), SOURCE, max_new_tokens=8)
    assert [fn.name for fn, _ in reward.components] == ["reward_model", "accuracy"]
    batch = samples()
    out = reward(batch, SOURCE)
    assert torch.allclose(out.total, RewardModelScorer(path=str(reward_dirs[1]))(batch, SOURCE), atol=1e-6)
    assert out.correct.tolist() == [True, False, True, False, True, False]  # accuracy: weight 0, still judged


# --- errors ---------------------------------------------------------------------------------------

def build(components: dict, tokenizer=None):
    return build_reward(OmegaConf.create({"name": "t", "components": components}), SOURCE, 8, tokenizer=tokenizer)


def test_a_missing_directory_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"reward\.components\.reward_model\.path='.*nowhere': no such directory"):
        build({"reward_model": {"path": str(tmp_path / "nowhere")}})


def test_a_causal_lm_is_not_a_reward_model(reward_dirs, tiny_hf_model):
    with pytest.raises(ConfigError, match=r"reward_model\.paths\[1\]=.*not a reward model.*Qwen2ForCausalLM.*"
                                          r"num_labels=2"):
        build({"reward_model": {"paths": [str(reward_dirs[0]), str(tiny_hf_model("qwen2"))]}})


def test_a_reward_model_with_two_labels_is_refused(tmp_path, reward_dirs):
    import shutil

    directory = Path(shutil.copytree(reward_dirs[0], tmp_path / "two_labels"))
    config = json.loads((directory / "config.json").read_text())
    config["id2label"] = {"0": "LABEL_0", "1": "LABEL_1"}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"reward_model\.path=.*two_labels.*num_labels=2"):
        build({"reward_model": {"path": str(directory)}})


def test_path_and_paths_are_exclusive(reward_dirs):
    with pytest.raises(ConfigError, match="exactly one of path .* or paths"):
        build({"reward_model": {"path": str(reward_dirs[0]), "paths": [str(reward_dirs[1])]}})
    with pytest.raises(ConfigError, match="exactly one of path"):
        build({"reward_model": {}})


def test_a_shared_tokenizer_must_have_the_policys_vocabulary(reward_dirs, tiny_hf_model):
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(tiny_hf_model("qwen2"))  # a BPE vocabulary, not the characters
    with pytest.raises(ConfigError, match=r"reward_model\.path=.*rm0.*share_tokenizer=true.*differs from the policy"):
        build({"reward_model": {"path": str(reward_dirs[0]), "share_tokenizer": True}}, tokenizer=other)
    # the same vocabulary is accepted, and scores as the model's own tokenizer does
    same = build_char_tokenizer(ALPHABET)
    shared = build({"reward_model": {"path": str(reward_dirs[0]), "share_tokenizer": True}}, tokenizer=same)
    own = build({"reward_model": {"path": str(reward_dirs[0])}})
    batch = samples()
    assert torch.allclose(shared(batch, SOURCE).total, own(batch, SOURCE).total, atol=1e-6)


def test_the_config_refuses_a_path_without_the_component(tmp_path):
    from posttrain.config.check import check_config

    cfg = compose_config(["+reward.path=/somewhere"], tmp_path)
    OmegaConf.resolve(cfg)
    with pytest.raises(ConfigError, match=r"reward\.path is set, but the reward has no reward_model component"):
        check_config(cfg)


def test_the_config_check_names_a_missing_reward_model(tmp_path):
    from posttrain.config.check import check_config

    cfg = compose_config(["algorithm=grpo", "reward=reward_model", f"reward.path={tmp_path / 'absent'}"], tmp_path)
    OmegaConf.resolve(cfg)
    with pytest.raises(ConfigError, match=r"reward\.components\.reward_model\.path=.*absent': no such directory"):
        check_config(cfg)


# --- a GRPO run on a learned reward: eval/proxy_reward beside eval/accuracy -----------------------

def test_grpo_on_a_reward_model_logs_the_proxy_reward_at_each_eval(tmp_path, reward_dirs):
    from posttrain.eval.report.document import write_report
    from posttrain.run.history import HISTORY_FILE

    run_dir = tmp_path / "runs" / "0"
    cfg = compose_config([*FAST_RUN, *EASY_TASK, "algorithm=grpo", "algorithm.warm_start.steps=0",
                          "reward=reward_model", f"reward.path={reward_dirs[0]}", "algorithm.prompts_per_step=2",
                          "algorithm.group_size=4", "trainer.max_steps=4", "trainer.val_check_interval=2",
                          "callbacks.checkpoint.every_n_train_steps=4", "eval.num_prompts=8", "eval.batch_size=8",
                          "rollout.max_new_tokens=4", "eval.max_new_tokens=4"], run_dir)
    summary = run(cfg)
    lines = [json.loads(line) for line in (run_dir / HISTORY_FILE).read_text().splitlines()]
    evals = [line for line in lines if "eval/accuracy" in line]
    assert [line["batch"] for line in evals] == [0, 2, 4]  # the start eval, then every 2 rollout batches
    assert all("eval/proxy_reward" in line for line in evals)
    # the proxy is the reward model's score of the greedy responses: never 0 for a random model
    assert all(abs(line["eval/proxy_reward"]) > 1e-6 for line in evals)
    assert summary["eval/proxy_reward"] == evals[-1]["eval/proxy_reward"]
    train = [line for line in lines if "rewards/reward_model/mean" in line]
    assert train and all("rewards/accuracy/mean" in line for line in train)  # accuracy logged at weight 0

    report = write_report(tmp_path / "runs")
    assert (report.parent / "proxy_reward.png").is_file() and "(proxy_reward.png)" in report.read_text()
