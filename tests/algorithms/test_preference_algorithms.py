"""DPO, IPO, hinge and SimPO (algorithms/preference.py): the module's loss against the
formulas by hand, the reference log-probs cached once, SimPO without a reference, resume,
the config rules, and a short run of each through `posttrain.train.run`."""

import copy
import math

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from posttrain.config.check import check_config
from posttrain.data.preference import PreferencePair, PreferenceSource, collate_pairs
from posttrain.data.sources import build_source
from posttrain.errors import ConfigError
from posttrain.models.loading import load_tokenizer_and_model
from posttrain.train import build_module, run

from conftest import FAST_RUN, compose_config

EASY = ("data.min_digits=2", "data.max_digits=2")
LOSSES = ("dpo", "ipo", "hinge", "simpo")


def wrong_answer(response: str) -> str:
    """The response with its last digit changed: a rejected side the verifier marks wrong."""
    return response[:-1] + str((int(response[-1]) + 1) % 10)


def make_module(*overrides: str, train_pairs: int = 6, validation_pairs: int = 3):
    """The module `posttrain algorithm=... <overrides>` builds, on hand-made pairs of the
    embedded task (reference solution chosen, a wrong answer rejected)."""
    cfg = compose_config([*FAST_RUN, *EASY, *overrides])
    task = build_source(cfg.data)
    tokenizer, policy = load_tokenizer_and_model(cfg.model, task.alphabet)
    pairs = {split: [PreferencePair(e.prompt, e.response, wrong_answer(e.response), "perturbed", e.messages, e)
                     for e in (task.example(split, i) for i in range(count))]
             for split, count in (("train", train_pairs), ("validation", validation_pairs))}
    return build_module(cfg, policy, tokenizer, PreferenceSource(task, pairs, "hand-made pairs"))


def by_hand_logp(model, tokenizer, pair: PreferencePair, side: str) -> float:
    """log pi(side | prompt): one unpadded row, log-softmax, the response tokens (and EOS) summed."""
    prompt = tokenizer(pair.prompt, add_special_tokens=False)["input_ids"]
    response = tokenizer(getattr(pair, side), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
    return sum(float(logp[len(prompt) + t - 1, token]) for t, token in enumerate(response))


def response_len(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 1  # and EOS


def nudge(model, seed: int = 0) -> None:
    """Move the policy away from its start (the reference), as training would."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))


def expected_loss(loss, beta, gamma, smoothing, c, r, rc, rr, len_c, len_r, length_normalize=False):
    """The papers' formulas, one pair at a time."""
    if loss == "simpo":
        h = beta * c / len_c - beta * r / len_r - gamma
        return -(1 - smoothing) * math.log(torch.sigmoid(torch.tensor(h))) - smoothing * math.log(
            torch.sigmoid(torch.tensor(-h)))
    if loss == "ipo":
        h = (c - rc) / len_c - (r - rr) / len_r if length_normalize else (c - rc) - (r - rr)
        return (h - 1 / (2 * beta)) ** 2
    h = beta * ((c - rc) / len_c - (r - rr) / len_r) if length_normalize else beta * ((c - rc) - (r - rr))
    if loss == "hinge":
        return max(0.0, 1 - h)
    return -(1 - smoothing) * math.log(torch.sigmoid(torch.tensor(h))) - smoothing * math.log(
        torch.sigmoid(torch.tensor(-h)))


@pytest.mark.parametrize("loss, overrides", [
    ("dpo", ()), ("dpo", ("algorithm.label_smoothing=0.2",)), ("dpo", ("algorithm.length_normalize=true",)),
    ("ipo", ()), ("ipo", ("numerics=trl",)),
    ("hinge", ("algorithm.beta=0.5",)), ("simpo", ()),
])
def test_training_loss_is_the_formula_by_hand(loss, overrides):
    module = make_module(f"algorithm={loss}", *overrides)
    start = copy.deepcopy(module.policy)
    module.ensure_reference_logps()  # before the first update: the reference is the policy's start
    nudge(module.policy)
    pairs = module.source.pairs("train")[:4]
    got = module.training_step(collate_pairs(pairs, module.tokenizer), 0)
    options = module.loss_options
    want = 0.0
    for pair in pairs:
        c, r = (by_hand_logp(module.policy, module.tokenizer, pair, side) for side in ("chosen", "rejected"))
        rc, rr = (by_hand_logp(start, module.tokenizer, pair, side) for side in ("chosen", "rejected"))
        want += expected_loss(loss, options["beta"], options["gamma"], options["label_smoothing"], c, r, rc, rr,
                              response_len(module.tokenizer, pair.chosen),
                              response_len(module.tokenizer, pair.rejected), options["length_normalize"]) / len(pairs)
    assert got.item() == pytest.approx(want, rel=1e-4, abs=1e-5)
    assert got.requires_grad
    if loss == "ipo" and "numerics=trl" in overrides:
        assert options["length_normalize"] is True  # TRL's convention reached the module


def fit(module, steps: int, ckpt_path=None, **trainer_options):
    """A few optimiser steps of `module` on its training pairs, in order, under a real Trainer."""
    loader = DataLoader(module.source.pairs("train"), batch_size=module.batch_size,
                        collate_fn=lambda b: collate_pairs(b, module.tokenizer))
    trainer = L.Trainer(max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, accelerator="cpu", **trainer_options)
    trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
    return trainer


def test_reference_logps_are_computed_once_and_equal_the_start_policys():
    module = make_module("algorithm=dpo", "algorithm.batch_size=2", train_pairs=6, validation_pairs=3)
    start = copy.deepcopy(module.policy)
    fit(module, steps=3, enable_checkpointing=False)
    # one pass over the pairs before training (3 + 2 batches of 2), none at the 3 steps
    assert module.reference_forwards == 5
    assert not torch.equal(next(start.parameters()), next(module.policy.parameters()))  # the policy trained
    # what a training step looks up is what the start policy gives for that batch, computed afresh
    batch = collate_pairs(module.source.pairs("train")[3:6], module.tokenizer)
    cached = torch.stack(module.cached_reference("train", batch["pairs"]), dim=1)
    with torch.no_grad():
        fresh = torch.stack(module.pair_logps(start, batch), dim=1)
    torch.testing.assert_close(cached, fresh, rtol=1e-5, atol=1e-5)
    for split in ("train", "validation"):
        for i, pair in enumerate(module.source.pairs(split)):
            by_hand = [by_hand_logp(start, module.tokenizer, pair, side) for side in ("chosen", "rejected")]
            torch.testing.assert_close(module.reference_logps[split][i].double(),
                                       torch.tensor(by_hand, dtype=torch.float64), rtol=1e-5, atol=1e-4)


def test_simpo_builds_no_reference():
    module = make_module("algorithm=simpo", "algorithm.batch_size=3")

    def no_reference():
        raise AssertionError("SimPO asked for a reference model")

    module.reference = no_reference
    fit(module, steps=2, enable_checkpointing=False)
    assert module.reference_forwards == 0 and module.reference_logps == {}
    assert module.cached_reference("train", module.source.pairs("train")) == (None, None)


def test_a_lora_policys_reference_is_its_base_with_the_adapter_off():
    """With LoRA the reference needs no start weights: the base, adapter off, gives the same
    log-probs after training as before it (so a cache could be refilled at any step)."""
    module = make_module("algorithm=dpo", "algorithm.batch_size=3", "model.lora.r=4", "model.lora.alpha=8")
    fit(module, steps=2, enable_checkpointing=False)
    before_training = module.reference_logps["train"].clone()
    batch = collate_pairs(module.source.pairs("train")[:3], module.tokenizer)
    with torch.no_grad():
        adapted = torch.stack(module.pair_logps(module.policy, batch), dim=1)
    assert not torch.allclose(adapted, before_training[:3], atol=1e-4)  # the adapter has trained
    module.reference_logps = {}
    module.ensure_reference_logps()  # at step 2: from the base, not the trained policy
    torch.testing.assert_close(module.reference_logps["train"], before_training, rtol=1e-5, atol=1e-5)


def test_resume_restores_the_reference_from_the_checkpoint(tmp_path):
    """The cache travels in the checkpoint: a resumed module does no reference pass (its policy
    is no longer the start) and trains on to the same weights as an uninterrupted run."""
    straight = make_module("algorithm=dpo", "algorithm.batch_size=2")
    fit(straight, steps=3, enable_checkpointing=False)
    first = make_module("algorithm=dpo", "algorithm.batch_size=2")
    trainer = fit(first, steps=2, enable_checkpointing=False)
    trainer.save_checkpoint(tmp_path / "step2.ckpt")
    stored = torch.load(tmp_path / "step2.ckpt", weights_only=False)["reference_logps"]
    torch.testing.assert_close(stored["train"], straight.reference_logps["train"])

    resumed = make_module("algorithm=dpo", "algorithm.batch_size=2")
    pairs = resumed.source.pairs("train")
    # the rest of the data stream (a plain DataLoader restarts on resume): the third batch first
    fit_rest = DataLoader(pairs[4:] + pairs[:4], batch_size=2, collate_fn=lambda b: collate_pairs(b, resumed.tokenizer))
    trainer = L.Trainer(max_steps=3, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, accelerator="cpu", enable_checkpointing=False)
    trainer.fit(resumed, train_dataloaders=fit_rest, ckpt_path=tmp_path / "step2.ckpt")
    assert resumed.reference_forwards == 0
    torch.testing.assert_close(resumed.reference_logps["train"], straight.reference_logps["train"])
    for (name, a), b in zip(straight.policy.named_parameters(), resumed.policy.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_a_checkpoint_of_other_pairs_is_refused(tmp_path):
    from posttrain.errors import CheckpointError

    module = make_module("algorithm=dpo", "algorithm.batch_size=3", train_pairs=6)
    fit(module, steps=1, enable_checkpointing=False).save_checkpoint(tmp_path / "a.ckpt")
    other = make_module("algorithm=dpo", train_pairs=4)
    with pytest.raises(CheckpointError, match="cover 6 train pairs, but this run has 4"):
        other.on_load_checkpoint(torch.load(tmp_path / "a.ckpt", weights_only=False))
    # without its cache, a trained policy cannot stand in for its own start
    module.reference_logps = {}
    with pytest.raises(CheckpointError, match="reference log-probs are missing after training began"):
        module.ensure_reference_logps()


@pytest.mark.parametrize("overrides, named", [
    (("algorithm=dpo", "advantage=gae"), ["algorithm=dpo", "advantage=gae"]),
    (("algorithm=simpo", "kl_estimator=k3"), ["algorithm=simpo", "kl_estimator=k3"]),
    (("algorithm=dpo", "algorithm.gamma=0.5"), ["algorithm.gamma=0.5", "algorithm.loss=dpo"]),
    (("algorithm=ipo", "algorithm.label_smoothing=0.1"), ["algorithm.label_smoothing=0.1", "algorithm.loss=ipo"]),
    (("algorithm=hinge", "+algorithm.length_normalize=true"), ["algorithm.length_normalize", "algorithm.loss=hinge"]),
    (("algorithm=simpo", "+algorithm.length_normalize=true"), ["algorithm.length_normalize", "algorithm.loss=simpo"]),
    (("algorithm=dpo", "algorithm.label_smoothing=0.5"), ["algorithm.label_smoothing=0.5", "[0, 0.5)"]),
    (("algorithm=hinge", "algorithm.beta=0"), ["algorithm.beta=0"]),
    (("algorithm=dpo", "algorithm.loss=orpo"), ["algorithm.loss='orpo'"]),
])
def test_config_rules_refuse_what_a_loss_does_not_use(overrides, named):
    cfg = compose_config(list(overrides))
    with pytest.raises(ConfigError) as err:
        check_config(cfg, {"algorithm": overrides[0].split("=")[1]})
    for text in named:
        assert text in str(err.value)


@pytest.mark.parametrize("loss", LOSSES)
def test_every_preset_passes_the_config_checks(loss):
    check_config(compose_config([f"algorithm={loss}"]), {"algorithm": loss})


def test_the_module_refuses_an_option_its_loss_does_not_use():
    """Past the config checks (a module built by hand): the core's own refusal, as a ConfigError."""
    with pytest.raises(ConfigError, match="algorithm.loss='hinge'.*does not use label_smoothing"):
        make_module("algorithm=hinge", "algorithm.label_smoothing=0.1")


def run_config(output_dir, *overrides: str):
    """A short run from a random-init policy (no warm start) on a few embedded pairs."""
    return compose_config([*FAST_RUN, *EASY, "algorithm.warm_start.steps=0", "preference.num_train_pairs=24",
                           "preference.num_validation_pairs=8", "preference.samples_per_prompt=2",
                           "algorithm.batch_size=4", "eval.num_prompts=16", "eval.batch_size=16",
                           f"paths.cache_dir={output_dir.parent / 'cache'}", *overrides], output_dir)


@pytest.mark.parametrize("loss", LOSSES)
def test_a_short_run_of_each_loss(loss, tmp_path):
    summary = run(run_config(tmp_path / loss, f"algorithm={loss}", "trainer.max_steps=4",
                             "trainer.val_check_interval=4", "callbacks.checkpoint.every_n_train_steps=4"))
    assert summary["global_step"] == 4
    for name in ("eval/accuracy", "eval/loss", "eval/rewards/accuracy", "eval/rewards/margins", "rewards/margins",
                 "train/loss"):
        assert math.isfinite(summary[name]), name
    # the implicit rewards start at 0 for the reference-based losses (the policy is its reference)
    if loss != "simpo":
        assert summary["eval/rewards/margins_start"] == 0.0
    stored = torch.load(tmp_path / loss / "checkpoints" / "last.ckpt", weights_only=False)["reference_logps"]
    assert sorted(stored) == ([] if loss == "simpo" else ["train", "validation"])
    assert all(logps.shape == (summary[f"pairs/{split}/count"], 2) for split, logps in stored.items())


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path):
    common = ("algorithm=dpo", "trainer.max_steps=6", "trainer.val_check_interval=100",
              "callbacks.checkpoint.every_n_train_steps=3", "eval.at_start=false")
    run(run_config(tmp_path / "straight", *common))
    run(run_config(tmp_path / "interrupted", *common, "callbacks.stop_at_step=3"))
    summary = run(run_config(tmp_path / "resumed", *common,
                             f"ckpt_path={tmp_path}/interrupted/checkpoints/last.ckpt"))
    assert summary["global_step"] == 6
    straight, resumed = (torch.load(tmp_path / name / "checkpoints" / "last.ckpt", weights_only=False)
                         for name in ("straight", "resumed"))
    for split in ("train", "validation"):
        assert torch.equal(straight["reference_logps"][split], resumed["reference_logps"][split])
    for name, tensor in straight["state_dict"].items():
        assert torch.equal(tensor, resumed["state_dict"][name]), name
