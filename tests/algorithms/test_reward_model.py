"""algorithm=reward_model: Bradley–Terry scores at the last non-padding token, the loss and
pair accuracy, the sequence-classification export, a short run that resumes, the config rules."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from conftest import compose_config
from posttrain.algorithms.reward_model import RewardModelModule
from posttrain.config.check import check_config
from posttrain.core.preference import bradley_terry_loss
from posttrain.data.preference import PreferencePair, PreferenceSource, collate_pairs
from posttrain.data.sources import ArithmeticSource
from posttrain.errors import ConfigError
from posttrain.models.loading import load_tokenizer_and_model

SMALL_MODEL = ("model.hidden_size=32", "model.num_layers=1", "model.intermediate_size=64")
QUICK_RM = ("algorithm=reward_model", "algorithm.warm_start.steps=0", "logger=none", "callbacks.progress_bar=none",
            "preference.num_train_pairs=48", "preference.num_validation_pairs=16", "algorithm.batch_size=8",
            "eval.batch_size=16", *SMALL_MODEL)


def make_module(model_cfg, pairs, tokenizer=None, policy=None, **options):
    task = ArithmeticSource()
    if policy is None:
        tokenizer, policy = load_tokenizer_and_model(model_cfg, task.alphabet)
    cfg = compose_config(["algorithm=reward_model"])
    source = PreferenceSource(task, {"train": pairs, "validation": pairs}, "test pairs")
    return RewardModelModule(policy, tokenizer, source, cfg.algorithm.optim, cfg.rollout, 8, batch_size=len(pairs),
                             **options)


def arithmetic_pairs(count=4):
    task = ArithmeticSource()
    examples = [task.example("train", i) for i in range(count)]
    # rejected responses of different lengths: the rows of a batch are padded differently
    return [PreferencePair(e.prompt, e.response, e.response[:1 + i % 3], "perturbed", None, e) for i, e in enumerate(examples)]


def score_alone(model, ids: list[int]) -> float:
    """The score of one unpadded row, read off the head at its last token by hand."""
    hidden = model.base_model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
    return float(model.score(hidden))


def test_scores_are_the_head_at_each_rows_last_token_and_the_loss_is_bradley_terry():
    pairs = arithmetic_pairs()
    module = make_module(compose_config(list(SMALL_MODEL)).model, pairs, margin=0.5, center_coef=0.01)
    batch = collate_pairs(pairs, module.tokenizer)
    chosen, rejected = module.pair_scores(batch)
    for side, scores in (("chosen", chosen), ("rejected", rejected)):
        for row, mask, score in zip(batch[f"{side}_input_ids"], batch[f"{side}_attention_mask"], scores):
            assert score.item() == pytest.approx(score_alone(module.policy, row[mask.bool()].tolist()), abs=1e-5)
    logged = {}
    module.log = lambda name, value, **kw: logged.__setitem__(name, value)
    module.log_dict = lambda values, **kw: logged.update(values)
    loss = module.training_step(batch, 0)
    expected = bradley_terry_loss(chosen, rejected, margin=0.5, center_coef=0.01).loss
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    hand = (-torch.nn.functional.logsigmoid(chosen - rejected - 0.5).mean() + 0.01 * (chosen + rejected).pow(2).mean())
    assert loss.item() == pytest.approx(hand.item(), rel=1e-6)
    assert logged["rewards/accuracy"].item() == pytest.approx((chosen > rejected).float().mean().item())
    assert logged["rewards/margin"].item() == pytest.approx((chosen - rejected).mean().item(), rel=1e-5)
    assert module.train_batches_seen == 1


def test_a_few_steps_fit_a_tiny_batch_to_full_pair_accuracy():
    # the score head is initialised from the global RNG: seeded here, so the outcome does not
    # depend on which tests ran before in this process (in CI one order left a pair unseparated)
    torch.manual_seed(0)
    pairs = arithmetic_pairs(8)
    module = make_module(compose_config(list(SMALL_MODEL)).model, pairs)
    module.log = module.log_dict = lambda *a, **k: None
    batch = collate_pairs(pairs, module.tokenizer)
    optimizer = torch.optim.AdamW(module.policy.parameters(), lr=3e-3)
    for _ in range(40):
        optimizer.zero_grad()
        module.training_step(batch, 0).backward()
        optimizer.step()
    chosen, rejected = module.pair_scores(batch)
    assert bool((chosen > rejected).all())


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_the_classifier_of_a_pretrained_model_exports_in_the_standard_format(family, tiny_hf_model, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from posttrain.files import save_pretrained_atomic

    model_cfg = compose_config(["model=hf", f"model.name_or_path={tiny_hf_model(family)}"]).model
    tokenizer, policy = load_tokenizer_and_model(model_cfg, "")
    pairs = [PreferencePair("What is 2+2?", "4", "five", "dataset", [{"role": "user", "content": "What is 2+2?"}]),
             PreferencePair("Say hi", "hi there", "no", "dataset", [{"role": "user", "content": "Say hi"}])]
    module = make_module(model_cfg, pairs, tokenizer, policy)
    save_pretrained_atomic(module.policy, tokenizer, tmp_path / "hf_model")
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf_model")
    assert type(loaded).__name__ == type(policy).__name__.replace("ForCausalLM", "ForSequenceClassification")
    assert loaded.config.num_labels == 1 and loaded.config.pad_token_id == tokenizer.pad_token_id
    assert "score.weight" in dict(loaded.named_parameters())
    batch = collate_pairs(pairs, tokenizer)
    with torch.no_grad():
        mine = torch.cat(module.pair_scores(batch))
        theirs = torch.cat([loaded(input_ids=batch[f"{s}_input_ids"], attention_mask=batch[f"{s}_attention_mask"])
                            .logits.squeeze(-1) for s in ("chosen", "rejected")])
    torch.testing.assert_close(mine, theirs)
    # the body is the policy's
    torch.testing.assert_close(loaded.base_model.embed_tokens.weight, policy.base_model.embed_tokens.weight)


def test_a_lora_policy_is_refused():
    model_cfg = compose_config([*SMALL_MODEL, "model.lora.r=4"]).model
    with pytest.raises(ConfigError, match="model.lora.r=null"):
        make_module(model_cfg, arithmetic_pairs())


def test_a_short_run_evaluates_pair_accuracy_exports_and_resumes(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from posttrain.train import run

    run_dir = tmp_path / "run"
    common = [*QUICK_RM, f"paths.cache_dir={tmp_path}", "trainer.val_check_interval=3",
              "callbacks.checkpoint.every_n_train_steps=3"]
    first = run(compose_config([*common, "trainer.max_steps=6", "callbacks.stop_at_step=3"], run_dir))
    assert first["global_step"] == 3
    summary = run(compose_config([*common, "trainer.max_steps=6"], run_dir))  # ckpt_path=auto: resumes
    assert summary["global_step"] == 6
    for key in ("eval/pair_accuracy", "eval/pair_accuracy_start", "eval/rewards/margin", "rewards/accuracy",
                "pairs/train/on_policy_share", "pairs/validation/perturbed_share"):
        assert key in summary, key
    assert summary["pairs/train/count"] == 48
    assert json.loads((run_dir / "summary.json").read_text())["eval/pair_accuracy"] == summary["eval/pair_accuracy"]
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint["train_batches_seen"] == 6
    # hf_model/ scores the held-out pairs as the run did: its pair accuracy is the summary's
    model = AutoModelForSequenceClassification.from_pretrained(run_dir / "hf_model")
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "hf_model")
    (cached,) = (tmp_path / "preference_pairs").glob("*.json")
    task = ArithmeticSource()
    pairs = [PreferencePair(**{k: v for k, v in row.items() if k != "index"}, example=task.example("validation", row["index"]))
             for row in json.loads(cached.read_text())["validation"]]
    batch = collate_pairs(pairs, tokenizer)
    with torch.no_grad():
        chosen, rejected = (model(input_ids=batch[f"{s}_input_ids"], attention_mask=batch[f"{s}_attention_mask"])
                            .logits.squeeze(-1) for s in ("chosen", "rejected"))
    assert (chosen > rejected).float().mean().item() == pytest.approx(summary["eval/pair_accuracy"])


def test_online_only_components_are_refused():
    cfg = compose_config(["algorithm=reward_model", "advantage=gae"])
    with pytest.raises(ConfigError, match=r"algorithm=reward_model trains offline on fixed data, so advantage=gae"):
        check_config(cfg, {"algorithm": "reward_model", "advantage": "gae"})


def test_a_dataset_source_needs_a_path():
    cfg = compose_config(["algorithm=reward_model", "preference.source=dataset"])
    with pytest.raises(ConfigError, match=r"preference\.source=dataset needs preference\.path"):
        check_config(cfg, {"algorithm": "reward_model"})
    OmegaConf.update(cfg, "preference.samples_per_prompt", 1)
    with pytest.raises(ConfigError, match=r"preference\.samples_per_prompt=1"):
        check_config(cfg, {"algorithm": "reward_model"})
