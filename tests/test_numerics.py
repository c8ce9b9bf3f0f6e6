"""The `numerics` config group: each peer preset composes with every GRPO-family preset,
changes exactly the conventions it should (hand-written expectations below), yields to an
explicit override of a component key, reaches the module's loss/KL/advantage options, and
trains end to end."""

import pytest
from omegaconf import OmegaConf

from posttrain.data.sources import build_source
from posttrain.errors import ConfigError
from posttrain.models.loading import load_tokenizer_and_model
from posttrain.train import build_module, run

from conftest import compose_config
from test_grpo import rl_config

PEERS = ["posttrain", "trl", "verl", "openrlhf"]
ONLINE_PRESETS = ["grpo", "dr_grpo", "dapo", "gspo", "cispo", "sapo"]


def conventions(*overrides: str) -> dict:
    """The resolved values of every key a numerics preset can reach."""
    cfg = compose_config(list(overrides))
    resolved = OmegaConf.to_container(cfg, resolve=True)
    out = {}
    for group in ("algorithm", "advantage", "kl_estimator"):
        for key, value in resolved[group].items():
            if key not in ("name", "kind", "warm_start", "optim", "_target_"):
                out[f"{group}.{key}"] = value
    return out


def changed(*overrides: str, peer: str) -> dict:
    base = conventions(*overrides)
    other = conventions(*overrides, f"numerics={peer}")
    assert base.keys() == other.keys()
    return {k: other[k] for k in base if other[k] != base[k]}


@pytest.mark.parametrize("peer", PEERS)
@pytest.mark.parametrize("preset", ONLINE_PRESETS)
def test_every_peer_composes_with_every_online_preset(peer, preset):
    cfg = compose_config([f"algorithm={preset}", f"numerics={peer}"])
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    assert cfg.numerics.name == peer


# What each peer changes relative to posttrain, written out by hand from the peers' code.
GRPO_K3 = ("algorithm=grpo",)  # group_norm advantages, k3 as a loss, ppo_clip
EXPECTED = {
    ("verl", GRPO_K3): {"algorithm.dual_clip": 3.0, "advantage.singleton": "unit_std"},
    ("trl", GRPO_K3): {"algorithm.log_ratio_clamp": None, "algorithm.count_empty_rows": True,
                       "advantage.eps": 1e-4, "kl_estimator.log_ratio_clamp": None,
                       "kl_estimator.value_clamp": None},
    ("openrlhf", GRPO_K3): {"advantage.eps": 1e-9, "kl_estimator.log_ratio_clamp": None},
    ("verl", ("algorithm=gspo",)): {"algorithm.log_ratio_clamp": None, "algorithm.seq_log_ratio_clamp": 10.0,
                                    "advantage.singleton": "unit_std"},
    ("openrlhf", ("algorithm=gspo",)): {"algorithm.log_ratio_clamp": None, "advantage.eps": 1e-9},
    ("trl", ("algorithm=cispo",)): {"algorithm.log_ratio_clamp": None, "algorithm.count_empty_rows": True,
                                    "advantage.eps": 1e-4},
    ("verl", ("algorithm=grpo", "advantage=reinforce_pp_baseline", "kl_estimator=k1")): {
        "algorithm.dual_clip": 3.0, "advantage.singleton": "unit_std", "advantage.keep_degenerate": True},
    ("openrlhf", ("algorithm=grpo", "advantage=reinforce_pp_baseline", "kl_estimator=k1")): {
        "advantage.keep_degenerate": True, "kl_estimator.value_clamp": 10.0},
    ("openrlhf", ("algorithm=grpo", "kl_estimator=k2")): {"advantage.eps": 1e-9, "kl_estimator.value_clamp": 10.0},
    ("verl", ("algorithm=dr_grpo",)): {"algorithm.dual_clip": 3.0, "advantage.singleton": "unit_std"},
    ("posttrain", GRPO_K3): {},
}


@pytest.mark.parametrize("peer,overrides", list(EXPECTED))
def test_a_peer_preset_changes_exactly_its_conventions(peer, overrides):
    assert changed(*overrides, peer=peer) == EXPECTED[(peer, overrides)]


def test_an_explicit_component_override_beats_the_numerics_preset():
    values = conventions("algorithm=grpo", "numerics=verl", "advantage.eps=0.5", "algorithm.dual_clip=null")
    assert values["advantage.eps"] == 0.5 and values["algorithm.dual_clip"] is None
    assert values["advantage.singleton"] == "unit_std"  # the rest of the preset still applies


def test_ipo_normalisation_is_a_numerics_convention():
    assert compose_config(["numerics=trl"]).numerics.preference.ipo_length_normalize is True
    assert compose_config(["numerics=openrlhf"]).numerics.preference.ipo_length_normalize is False


def build(make_config, sft_start, *overrides):
    cfg = rl_config(make_config, sft_start, *overrides)
    OmegaConf.resolve(cfg)
    source = build_source(cfg.data)
    tokenizer, policy = load_tokenizer_and_model(cfg.model, source.alphabet)
    return build_module(cfg, policy, tokenizer, source)


def test_the_module_receives_the_peer_options(make_config, sft_start):
    module = build(make_config, sft_start, "algorithm=grpo", "numerics=verl")
    assert module.loss_options["dual_clip"] == 3.0 and module.loss_options["log_ratio_clamp"] == 20.0
    assert module.advantage_options == {"eps": 1e-6, "scale": "group", "singleton": "unit_std"}
    assert module.kl_options == {"log_ratio_clamp": 20.0, "value_clamp": 10.0, "unbiased_gradient": False,
                                 "is_weight_cap": 10.0}
    module = build(make_config, sft_start, "algorithm=grpo", "numerics=trl")
    assert module.loss_options["log_ratio_clamp"] is None and module.aggregation["count_empty_rows"] is True
    assert module.kl_options["value_clamp"] is None and module.kl_options["log_ratio_clamp"] is None


@pytest.mark.parametrize("overrides,culprit", [
    (("algorithm=gspo", "algorithm.dual_clip=3.0"), "dual_clip"),
    (("algorithm=grpo", "algorithm.ratio_level=sequence"), "ratio_level"),
    (("algorithm=grpo", "kl_estimator=k1", "+kl_estimator.log_ratio_clamp=5"), "log_ratio_clamp"),
    (("algorithm=grpo", "advantage.singleton=sometimes"), "singleton"),
    (("algorithm=grpo", "advantage.scale=prompt"), "scale"),
])
def test_an_option_the_formula_does_not_take_is_refused_at_start_up(make_config, sft_start, overrides, culprit):
    with pytest.raises(ConfigError, match=culprit):
        build(make_config, sft_start, *overrides)


@pytest.mark.parametrize("peer", ["trl", "verl", "openrlhf"])
def test_each_peer_preset_trains(peer, make_config, sft_start):
    summary = run(rl_config(make_config, sft_start, "algorithm=grpo", f"numerics={peer}",
                            "algorithm.mask_truncated=true"))
    assert summary["global_step"] == 2 and summary["choices"]["numerics"] == peer
    assert "policy/ppo_kl" in summary and "policy/kl" in summary
