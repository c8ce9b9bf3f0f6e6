"""torch.autograd.gradcheck (float64) through every differentiable loss in core.

Inputs are chosen away from the kinks (clip boundaries, hinge corner) where a finite
difference is not a derivative.
"""

import pytest
import torch
from torch.autograd import gradcheck

from posttrain.core import (
    DISTILL_DIVERGENCES,
    KL_ESTIMATORS,
    bradley_terry_loss,
    distill_divergence,
    entropy_from_logits,
    kdrl_loss,
    logprobs_from_logits,
    preference_loss,
)
from posttrain.core.aggregation import AGGREGATION_MODES, aggregate_loss
from posttrain.core.policy_loss import POLICY_LOSSES
from posttrain.core.value import ptx_loss, value_loss

D = torch.float64
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
OLD = torch.tensor([[-1.0, -2.0, -0.5, -1.5], [-0.7, -1.2, -3.0, -3.0], [-2.0, -0.3, -1.1, -0.9]], dtype=D)
# log-ratios well inside or well outside [log 0.8, log 1.2]; each row's mean too (for GSPO)
DELTA = torch.tensor([[0.5, -0.5, 0.05, 0.4], [-0.6, -0.4, 0.0, 0.0], [0.02, -0.03, 0.04, 0.0]], dtype=D)
ADV_TOKEN = torch.tensor([[1.0, -1.0, 0.5, -2.0], [-1.5, 0.7, 0.0, 0.0], [0.3, -0.2, 1.0, 0.0]], dtype=D)
ADV_SEQ = torch.tensor([1.0, -1.5, 0.5], dtype=D).unsqueeze(1).expand(3, 4).clone()


def _logp():
    return (OLD + DELTA).clone().requires_grad_(True)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_policy_losses(name, mode):
    adv = ADV_SEQ if name == "gspo" else ADV_TOKEN
    kwargs = dict(agg_mode=mode)
    if name in ("ppo_clip", "gspo", "cispo"):
        kwargs.update(clip_low=0.2, clip_high=0.28)
    if name == "sapo":
        kwargs.update(tau_pos=1.3, tau_neg=0.9)
    if name == "ppo_clip":
        kwargs["dual_clip"] = 1.3  # token (0, 3): ratio e^0.4 = 1.49 > 1.3 with A = -2 hits the dual clip
    if name == "cispo":
        # CISPO's IS weight is detached by design, so gradcheck runs at fixed ratios: old_logp
        # moves with logp inside the function (the finite difference then sees the same weights).
        fn = lambda lp: POLICY_LOSSES[name](lp, lp.detach() - DELTA, adv, MASK, **kwargs)[0]  # noqa: E731
    else:
        fn = lambda lp: POLICY_LOSSES[name](lp, OLD, adv, MASK, **kwargs)[0]  # noqa: E731
    assert gradcheck(fn, (_logp(),))
    if name == "ppo_clip":  # every branch is exercised: clipped low/high, dual-clipped, unclipped
        stats = POLICY_LOSSES[name](_logp(), OLD, adv, MASK, **kwargs)[1]
        assert stats["dual_clip_frac"] > 0 and stats["clip_frac_low"] > 0 and stats["clip_frac_high"] > 0


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_aggregation(mode):
    x = torch.randn(3, 4, dtype=D, requires_grad=True)
    assert gradcheck(lambda t: aggregate_loss(t, MASK, mode, num_tokens=11, num_seqs=4, norm_constant=6), (x,))
    mask = MASK.clone()
    mask[1] = False  # an all-padding row, counted
    assert gradcheck(lambda t: aggregate_loss(t, mask, mode, dp_size=3, count_empty_rows=True), (x,))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_cispo_sequence_ratio(mode):
    """Sequence-level CISPO: weights sg[clip(s_i)] are fixed under the finite difference because
    old_logp moves with logp (s_i = 1.12, 0.61, 1.01: clipped above, below, and inside)."""
    kwargs = dict(agg_mode=mode, clip_low=0.2, clip_high=0.1, ratio_level="sequence", seq_log_ratio_clamp=0.5)
    fn = lambda lp: POLICY_LOSSES["cispo"](lp, lp.detach() - DELTA, ADV_TOKEN, MASK, **kwargs)[0]  # noqa: E731
    assert gradcheck(fn, (_logp(),))
    stats = POLICY_LOSSES["cispo"](_logp(), OLD, ADV_TOKEN, MASK, **kwargs)[1]
    assert stats["clip_frac_high"] > 0 and stats["clip_frac_low"] > 0


def test_gspo_seq_clamp_and_delta():
    """GSPO with the sequence log-ratio clamp (row 0's mean 0.1125 > 0.05: no gradient there) and
    PPO with delta (token (0, 3): r = e^0.4 = 1.49 > delta = 1.35 with A = -2)."""
    kwargs = dict(agg_mode="seq-mean-token-mean", clip_low=None, clip_high=None, seq_log_ratio_clamp=0.05)
    fn = lambda lp: POLICY_LOSSES["gspo"](lp, OLD, ADV_SEQ, MASK, **kwargs)[0]  # noqa: E731
    assert gradcheck(fn, (_logp(),))
    fn = lambda lp: POLICY_LOSSES["ppo_clip"](lp, OLD, ADV_TOKEN, MASK, clip_high=0.28, delta=1.35)[0]  # noqa: E731
    assert gradcheck(fn, (_logp(),))


@pytest.mark.parametrize("name", ["k1", "k2", "k3", "k3_unbiased"])
def test_kl_estimators(name):
    ref = OLD - 0.3
    fn = lambda lp: aggregate_loss(KL_ESTIMATORS[name](lp, ref, OLD), MASK, "token-mean")  # noqa: E731
    assert gradcheck(fn, (_logp(),))


def test_value_loss():
    values = torch.tensor([[1.5, 0.9, 0.1, 2.0], [0.0, 1.0, 0.0, 0.0], [0.3, 0.15, 0.1, 0.0]], dtype=D, requires_grad=True)
    old = torch.tensor([[1.0, 1.0, 0.0, 1.0], [0.5, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=D)
    returns = torch.tensor([[2.0, 0.5, 1.0, -1.0], [1.0, 0.0, 0.0, 0.0], [0.3, 1.0, -1.0, 0.0]], dtype=D)
    assert gradcheck(lambda v: value_loss(v, old, returns, MASK, clip_range=0.2)[0], (values,))


def test_ptx_entropy_logprobs():
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 5, dtype=D, requires_grad=True)
    labels = torch.randint(0, 5, (3, 4))
    assert gradcheck(lambda z: ptx_loss(z, MASK, labels), (logits,))
    assert gradcheck(lambda z: logprobs_from_logits(z, labels), (logits,))
    assert gradcheck(entropy_from_logits, (logits,))


@pytest.mark.parametrize("name", ["dpo", "ipo", "hinge", "simpo"])
def test_preference_losses(name):
    chosen = torch.tensor([-10.0, -5.0, -7.0], dtype=D, requires_grad=True)
    rejected = torch.tensor([-12.0, -4.0, -7.5], dtype=D, requires_grad=True)
    ref_c, ref_r = torch.tensor([-11.0, -5.0, -6.0], dtype=D), torch.tensor([-11.0, -5.0, -8.0], dtype=D)
    kw = {"beta": 0.1}
    if name == "dpo":
        kw["label_smoothing"] = 0.1
    if name == "simpo":
        kw.update(chosen_len=torch.tensor([5, 3, 4]), rejected_len=torch.tensor([4, 2, 5]), gamma=0.3, beta=2.0)
    if name == "simpo":  # reference-free: its reference log-probs must stay unset
        ref_c = ref_r = None
    fn = lambda c, r: preference_loss(name, c, r, ref_c, ref_r, **kw)[0]  # noqa: E731
    assert gradcheck(fn, (chosen, rejected))


def test_bradley_terry():
    c = torch.tensor([1.0, 0.0, 0.3], dtype=D, requires_grad=True)
    r = torch.tensor([0.0, 0.5, -0.2], dtype=D, requires_grad=True)
    fn = lambda a, b: bradley_terry_loss(a, b, margin=torch.tensor([0.5, 0.0, 0.1], dtype=D), center_coef=0.01)[0]  # noqa: E731
    assert gradcheck(fn, (c, r))


@pytest.mark.parametrize("name", sorted(DISTILL_DIVERGENCES))
def test_distill_divergences(name):
    torch.manual_seed(1)
    s = torch.randn(2, 3, 6, dtype=D, requires_grad=True)
    t = torch.randn(2, 3, 6, dtype=D)
    assert gradcheck(lambda x: distill_divergence(name, x, t, beta=0.3), (s,))


def test_kdrl_k2():
    teacher = OLD - 0.2
    fn = lambda lp: kdrl_loss(lp, teacher, MASK, reward_mask=torch.tensor([1.0, 0.0, 1.0]), estimator="k2")[0]  # noqa: E731
    assert gradcheck(fn, (_logp(),))
