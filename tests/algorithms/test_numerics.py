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
from conftest import rl_config

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
    assert module.part("reference").kl_options == {"log_ratio_clamp": 20.0, "value_clamp": 10.0, "unbiased_gradient": False,
                                 "is_weight_cap": 10.0}
    module = build(make_config, sft_start, "algorithm=grpo", "numerics=trl")
    assert module.loss_options["log_ratio_clamp"] is None and module.aggregation["count_empty_rows"] is True
    assert module.part("reference").kl_options["value_clamp"] is None and module.part("reference").kl_options["log_ratio_clamp"] is None


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


def test_mask_truncated_takes_truncated_responses_out_of_the_loss(make_config, sft_start):
    import torch

    from posttrain.algorithms.experience import Experience

    module = build(make_config, sft_start, "algorithm=grpo", "algorithm.mask_truncated=true")
    mask = torch.ones(2, 3)
    exp = Experience(prompt_ids=torch.zeros(2, 1, dtype=torch.long), prompt_mask=torch.ones(2, 1),
                     response_ids=torch.zeros(2, 3, dtype=torch.long), response_mask=mask,
                     rollout_logprobs=torch.zeros(2, 3), truncated=torch.tensor([True, False]),
                     scores=torch.zeros(2), correct=torch.zeros(2), group_index=torch.tensor([0, 0]))
    assert torch.equal(module.learner.loss_mask(exp), torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]))
    assert torch.equal(build(make_config, sft_start, "algorithm=grpo").learner.loss_mask(exp), mask)


# --- the presets reproduce each peer's numbers --------------------------------------------
# Our own float64 transcriptions of each peer's formulas (read off their code; see
# core/README.md, "Numerics"), fed by the options the module builds from `numerics=<peer>`.

def _peer_advantages(peer, scores, groups):
    import torch

    eps = {"trl": 1e-4, "verl": 1e-6, "openrlhf": 1e-9}[peer]
    out = torch.empty_like(scores)
    for g in groups.unique():
        rows = groups == g
        s = scores[rows]
        mean, std = (s.mean(), s.std()) if len(s) > 1 else (torch.tensor(0.0, dtype=s.dtype), torch.tensor(1.0, dtype=s.dtype))
        out[rows] = (s - mean) / (std + eps)
    return out


def _peer_k3(peer, logp, ref):
    import torch

    if peer == "trl":
        return torch.exp(ref - logp) - (ref - logp) - 1
    if peer == "verl":
        d = torch.clamp(ref - logp, -20, 20)
        return torch.clamp(torch.exp(d) - d - 1, -10, 10)
    log_ratio = logp - ref  # openrlhf
    return ((-log_ratio).exp() - 1 + log_ratio).clamp(-10, 10)


def _peer_policy_loss(peer, logp, old, adv, mask):
    import torch

    log_ratio = logp - old
    if peer in ("verl", "openrlhf"):
        log_ratio = torch.clamp(log_ratio, -20, 20)
    ratio = torch.exp(log_ratio)
    loss = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.2))
    if peer == "verl":  # dual clip, c = 3
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * 3.0), loss)
    per_row = (loss * mask).sum(-1)
    if peer == "trl":  # every row counts, lengths clamped at 1
        return (per_row / mask.sum(-1).clamp(min=1)).mean()
    counts = mask.sum(-1)
    nonempty = (counts > 0).float()
    return ((per_row / (counts + 1e-8)) * nonempty).sum() / nonempty.sum()


@pytest.mark.parametrize("peer", ["trl", "verl", "openrlhf"])
def test_numerics_preset_reproduces_the_peer(peer, make_config, sft_start):
    import torch

    from posttrain import core

    module = build(make_config, sft_start, "algorithm=grpo", f"numerics={peer}")
    assert module.advantage_name == "group_norm" and module.part("reference").kl_name == "k3" and module.policy_loss == "ppo_clip"
    g = torch.Generator().manual_seed(0)
    B, T = 7, 5
    mask = (torch.arange(T) < torch.tensor([5, 3, 1, 4, 2, 5, 0]).unsqueeze(-1)).double()
    mask[6] = 0.0  # an all-padding row (e.g. a response dropped by overlong filtering)

    # advantages: sequence scores of groups {0: 3 samples, 1: 3 samples} (+ a singleton for verl)
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2]) if peer == "verl" else torch.tensor([0, 0, 0, 1, 1, 1, 1])
    scores = torch.rand(6, generator=g, dtype=torch.float64)
    rows = slice(0, 6 if peer != "verl" else 7)
    scores_all = torch.cat([scores, torch.tensor([0.7], dtype=torch.float64)])
    token_rewards = torch.zeros(B, T, dtype=torch.float64)
    token_rewards[:, 0] = scores_all
    adv_mask = torch.ones(B, T, dtype=torch.float64)  # every row scored for the advantage check
    ours, _ = core.compute_advantages(module.advantage_name, token_rewards[rows], adv_mask[rows], groups[rows],
                                      **module.advantage_options)
    theirs = _peer_advantages(peer, scores_all[rows], groups[rows])
    torch.testing.assert_close(ours[:, 0], theirs, rtol=1e-12, atol=1e-12)

    # KL (k3) with log-ratios beyond every clamp, values and gradients
    logp = (torch.randn(B, T, generator=g, dtype=torch.float64) * 3).requires_grad_()
    ref = logp.detach() + torch.randn(B, T, generator=g, dtype=torch.float64) * 3
    ref[0, :2] = logp[0, :2].detach() + torch.tensor([25.0, -25.0], dtype=torch.float64)
    ours = core.kl_penalty(module.part("reference").kl_name, logp, ref, logp.detach(), **module.part("reference").kl_options)
    theirs = _peer_k3(peer, logp, ref)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=0)
    grads = [torch.autograd.grad(x.sum(), logp)[0] for x in (ours, theirs)]
    torch.testing.assert_close(*grads, rtol=1e-12, atol=0)

    # the policy loss with the preset's clamps, dual clip and row counting
    old = logp.detach() + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    old[1, 0] = logp[1, 0].detach() - 30.0  # a log-ratio past the +-20 clamp
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    ours, _ = core.compute_policy_loss(module.policy_loss, logp, old, adv, mask, **module.loss_options,
                                       **module.aggregation)
    theirs = _peer_policy_loss(peer, logp, old, adv, mask)
    torch.testing.assert_close(ours, theirs, rtol=1e-7, atol=0)
    grads = [torch.autograd.grad(x, logp)[0] for x in (ours, theirs)]
    torch.testing.assert_close(*grads, rtol=1e-7, atol=1e-12)
