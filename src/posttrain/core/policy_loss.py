"""Policy-gradient losses on per-token log-probs.

One signature for the whole family::

    fn(logp, old_logp, advantages, mask, *, clip_low=0.2, clip_high=0.2, dual_clip=None,
       delta=None, log_ratio_clamp=20.0, seq_log_ratio_clamp=None, ratio_level="token",
       tau_pos=1.0, tau_neg=1.05, kimi_tau=1.0, agg_mode="token-mean", num_tokens=None, num_seqs=None,
       norm_constant=None, dp_size=1, count_empty_rows=False, seq_mask=None, is_weights=None)
       -> (loss scalar, stats dict of detached scalars)

All tensors are [B, T] except ``seq_mask`` [B]. The loss is a quantity to *minimise*
(the negated surrogate objective). r = pi_theta / pi_old, A = advantages, sg = stop-gradient.

Each loss reads only some of the options; a non-default value for one it does not read
raises ``ValueError`` naming the loss and the option (dual_clip on gspo is a config error,
not a silent no-op):

  option               read by               meaning
  clip_low, clip_high  ppo_clip gspo cispo   clip(r, 1 - clip_low, 1 + clip_high); None removes that side
  dual_clip            ppo_clip              c > 1: the loss of A < 0 tokens is capped at -c A
  delta                ppo_clip gspo         the unclipped ratio inside the min is capped at delta
                                             (> 1 + clip_high): -min(min(r, delta) A, clip(r) A)
  log_ratio_clamp      all                   token log-ratio clamped to +-c before exp; None: no clamp
                                             (reinforce: feeds only the stats)
  seq_log_ratio_clamp  gspo, cispo with       sequence log-ratio clamped from above (<= c) after the
                       ratio_level=sequence  length-normalised mean; clamped tokens get no gradient
  ratio_level          cispo                 "token" (r_it) | "sequence" (GSPO's s_i for every token)
  tau_pos, tau_neg     sapo                  gate temperature where A > 0 / A <= 0
  kimi_tau             kimi                  tau > 0, weight of the mirror-descent pull towards pi_old
  agg_mode, num_tokens, num_seqs, norm_constant, dp_size, count_empty_rows
                       all                   ``aggregate_loss`` (aggregation.py)

``seq_mask`` (e.g. from ``offpolicy_sequence_mask``) zeroes whole sequences' terms while
leaving the normalising counts unchanged, as in DeepSeek-V3.2's masked objective.
``is_weights`` [B, T] (the train-inference correction, ``mismatch.correction_weights``)
multiplies each token's term, detached; a weight of 0 drops the token from the loss and
from the stats, again with the counts unchanged.

Stats (over the valid, unmasked tokens of this call; peers' names in brackets):
  clip_frac_low       tokens whose gradient is cut by the lower clip (A < 0, r < 1 - eps_low)
                      [TRL clip_ratio/low_mean]
  clip_frac_high      tokens whose gradient is cut by the upper clip (A > 0, r > 1 + eps_high)
                      (for CISPO: tokens whose IS weight is clipped from above, whatever the sign
                      of A) [TRL clip_ratio/high_mean]
  clip_frac           their sum. ppo_clip, gspo: mean of [-A clip(r) > -A r] [verl pg_clipfrac,
                      OpenRLHF clip_ratio, TRL clip_ratio/region_mean]; cispo: mean of
                      [r != clip(r)] [verl pg_clipfrac]; 0 for sapo and reinforce
  clip_frac_high_pos  cispo: tokens with A > 0 whose weight is clipped from above, over all
                      tokens [TRL cispo_clip_ratio, there per sequence at sequence level]
  dual_clip_frac      ppo_clip with dual_clip: tokens with A < 0 whose loss is capped at -c A,
                      mean of [max(-rA, -clip(r)A) > -cA and A < 0] [verl pg_clipfrac_lower]
  ppo_kl              mean of -log r = mean(log pi_old - log pi_theta), the k1 estimate of
                      KL(pi_old || pi_theta) from the token log-ratio after log_ratio_clamp
                      [verl ppo_kl; OpenRLHF ppo_kl, which takes the unclamped log-ratio]
  approx_kl           mean of k3 for KL(pi_old || pi_theta): r - 1 - log r (>= 0, low variance)
  seq_log_ratio_mean  kimi: mean over sequences of the sequence log-ratio sum_t log r_t
  ratio_mean          mean token ratio (gspo, sequence-level cispo: mean sequence ratio over
                      sequences)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from types import SimpleNamespace

import torch

from .aggregation import aggregate_loss
from .checks import check_finite, check_shape, lookup, valid_mask
from .kl import clamped_log_ratio
from .masked import _safe_div, masked_count, masked_mean, masked_sum, zero_padding
from .options import BELOW_ONE, POSITIVE, Option, choice, declared, merged, number, optional, register

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]

RATIO_LEVELS = ("token", "sequence")
# The options the losses share, declared once (the config's `algorithm.<name>` keys, their
# checks and --help read this table); a loss names those it reads (`uses=`) and may declare
# options of its own (`options=`).
SHARED_OPTIONS: dict[str, Option] = declared((
    Option("clip_low", 0.2, optional(BELOW_ONE), "the ratio's lower bound is 1 - clip_low; null: none"),
    Option("clip_high", 0.2, optional(number(0)), "the ratio's upper bound is 1 + clip_high; null: none"),
    Option("dual_clip", None, optional(number(1, low_open=True)), "the dual-clip constant c > 1"),
    Option("delta", None, optional(number(1, low_open=True)), "cap on the unclipped ratio, > 1 + clip_high"),
    Option("log_ratio_clamp", 20.0, optional(POSITIVE), "token log-ratio clamp before exp; null: no clamp"),
    Option("seq_log_ratio_clamp", None, optional(POSITIVE), "upper clamp on the sequence log-ratio; null: none"),
    Option("ratio_level", "token", choice(*RATIO_LEVELS), "cispo: the token's ratio or GSPO's sequence ratio"),
    Option("tau_pos", 1.0, POSITIVE, "sapo: gate temperature where A > 0"),
    Option("tau_neg", 1.05, POSITIVE, "sapo: gate temperature where A <= 0"),
    Option("kimi_tau", 1.0, POSITIVE, "kimi: weight of the pull towards pi_old"),
))
# What every loss passes to ``aggregate_loss`` (aggregation.py), with its defaults.
AGGREGATION_DEFAULTS = {"agg_mode": "token-mean", "num_tokens": None, "num_seqs": None, "norm_constant": None,
                        "dp_size": 1, "count_empty_rows": False}

POLICY_LOSSES: dict[str, PolicyLossFn] = {}  # filled by @policy_loss


def _signature(options: Iterable[Option]) -> inspect.Signature:
    p = inspect.Parameter
    args = [p(name, p.POSITIONAL_OR_KEYWORD) for name in ("logp", "old_logp", "advantages", "mask")]
    keywords = {**{o.name: o.default for o in options}, **AGGREGATION_DEFAULTS}
    options = [p(name, p.KEYWORD_ONLY, default=default) for name, default in keywords.items()]
    masks = [p(name, p.KEYWORD_ONLY, default=None) for name in ("seq_mask", "is_weights")]
    return inspect.Signature([*args, *options, *masks])


def _reject_options(loss: str, o, names, context: str = "") -> None:
    """ValueError for the first option in ``names`` that is set to a non-default value."""
    for name in names:
        value, default = getattr(o, name), SHARED_OPTIONS[name].default
        if value is not default and value != default:
            raise ValueError(
                f"policy loss {loss!r}{context} does not use {name} (got {value!r}); leave it at {default!r}"
            )


def _check_values(loss: str, table: dict[str, Option], o) -> None:
    """Each value against its declaration; then the one rule across keys (delta above the clip)."""
    for name, option in table.items():
        value = getattr(o, name)
        if not option.spec.accepts(value):
            raise ValueError(f"{name}={value!r} is not valid for policy loss {loss!r}: expected {option.expected}")
    if o.delta is not None:
        bound = 1.0 + (o.clip_high or 0.0)
        if not o.delta > bound:
            raise ValueError(f"delta must be > 1 + clip_high = {bound!r} (or None), got {o.delta!r}")


def _validate(logp, old_logp, advantages, mask, seq_mask, is_weights=None):
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    check_shape("mask", mask, logp.shape, "logp")
    check_shape("advantages", advantages, logp.shape, "logp")
    check_finite("logp", logp, mask)
    check_finite("advantages", advantages, mask)
    if old_logp is not None:
        check_shape("old_logp", old_logp, logp.shape, "logp")
        check_finite("old_logp", old_logp, mask)
    valid = valid_mask(mask)
    # Padding may hold garbage (NaN/inf): zero it on the inputs so no NaN reaches logp.grad.
    logp, advantages = zero_padding(logp, valid), zero_padding(advantages, valid)
    if old_logp is not None:
        old_logp = zero_padding(old_logp, valid)
    used = valid
    if seq_mask is not None:
        check_shape("seq_mask", seq_mask, logp.shape[:1], "logp[:, 0]")
        used = valid & valid_mask(seq_mask).unsqueeze(-1)
    if is_weights is not None:
        check_shape("is_weights", is_weights, logp.shape, "logp")
        check_finite("is_weights", is_weights, mask)
        used = used & (is_weights > 0)
    return logp, old_logp, advantages, used


def policy_loss(name: str, *, uses: Iterable[str] = (), options: Iterable[Option] = (), needs_old: bool = True):
    """Declare and register the policy loss ``name``: ``@policy_loss("ppo_clip", uses=("clip_low", ...))``
    over ``terms(logp, old_logp, a, mask, used, o) -> (loss_mat, stats)`` gives the loss with the
    shared signature, in ``POLICY_LOSSES``. ``uses``: the shared options (SHARED_OPTIONS) it reads;
    ``options``: options of its own (``Option(name, default, spec, doc)``). ``o`` holds every
    option's value by attribute (``o.clip_high``, ``o.<own>``).

    The wrapper does what every loss shares: it refuses unknown options, shared options outside
    ``uses`` that are set, and values their declaration refuses; checks the tensors (zeroing
    padding); and masks, aggregates and detaches. ``terms`` gets the padded inputs with
    ``a`` = sg[advantages] and returns the per-token loss and its stats. The loss carries its
    declaration: ``.loss_name``, ``.uses`` and ``.own_options``."""
    uses, own = tuple(uses), declared(options)
    if not set(uses) <= set(SHARED_OPTIONS) or own.keys() & SHARED_OPTIONS.keys():
        raise ValueError(f"policy loss {name!r}: uses= names shared options ({', '.join(SHARED_OPTIONS)}); "
                         f"options= declares new ones, got uses={uses}, options={list(own)}")
    table = {**SHARED_OPTIONS, **own}
    defaults = {**{key: option.default for key, option in table.items()}, **AGGREGATION_DEFAULTS}
    unused = tuple(option for option in SHARED_OPTIONS if option not in uses)

    def wrap(terms):
        def loss_fn(logp, old_logp, advantages, mask, *, seq_mask=None, is_weights=None, **given):
            unknown = sorted(set(given) - set(defaults))
            if unknown:
                raise TypeError(f"policy loss {name!r} got unknown option(s) {unknown}; options: {sorted(defaults)}")
            o = SimpleNamespace(**{**defaults, **given})
            _reject_options(name, o, unused)
            _check_values(name, table, o)
            if needs_old and old_logp is None:
                raise ValueError(f"policy loss {name!r} needs old_logp (log-probs of the sampling policy)")
            logp, old_logp, advantages, used = _validate(logp, old_logp, advantages, mask, seq_mask, is_weights)
            loss_mat, stats = terms(logp, old_logp, advantages.detach(), mask, used, o)
            if is_weights is not None:
                loss_mat = loss_mat * torch.where(used, is_weights.detach(), torch.zeros_like(is_weights))
            # Terms of masked-out sequences are zeroed, but the counts come from the full ``mask``.
            loss_mat = torch.where(used, loss_mat, torch.zeros_like(loss_mat))
            aggregation = {k: getattr(o, k) for k in AGGREGATION_DEFAULTS if k != "agg_mode"}
            loss = aggregate_loss(loss_mat, mask, o.agg_mode, **aggregation)
            return loss, {k: v.detach() for k, v in stats.items()}

        loss_fn.__name__ = loss_fn.__qualname__ = terms.__name__
        loss_fn.__doc__ = terms.__doc__
        loss_fn.__module__ = terms.__module__
        loss_fn.__signature__ = _signature(table.values())
        loss_fn.loss_name, loss_fn.uses, loss_fn.own_options = name, uses, tuple(own.values())
        register(POLICY_LOSSES, "policy loss", name, loss_fn)
        return loss_fn

    return wrap


def loss_options() -> dict[str, Option]:
    """Every option of the registered losses by name: the shared ones, then each loss's own
    (the keys an `algorithm` node may set beside `policy_loss`)."""
    return merged([SHARED_OPTIONS.values(), *(fn.own_options for fn in POLICY_LOSSES.values())])


def _log_ratio(logp, old_logp, clamp):
    """log r = logp - sg[old_logp], clamped to +-clamp before any exp; None: unclamped (TRL)."""
    if clamp is None:
        return logp - old_logp.detach()
    return clamped_log_ratio(logp, old_logp, clamp)


def _upper_clamp(x, c):
    return x if c is None else torch.clamp(x, max=c)


def _clip_bounds(o):
    lo = None if o.clip_low is None else 1.0 - o.clip_low
    hi = None if o.clip_high is None else 1.0 + o.clip_high
    return lo, hi


def _clip(x, lo, hi):
    return x if lo is None and hi is None else torch.clamp(x, min=lo, max=hi)


def _clipped_surrogate(ratio, a, lo, hi, delta):
    """max(-min(r, delta) A, -clip(r) A) = -min(min(r, delta) A, clip(r) A); delta None: r."""
    unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)
    return torch.maximum(-a * unclipped, -a * _clip(ratio, lo, hi))


def _clip_cuts(r, a, lo, hi, used):
    """Tokens whose gradient the lower / upper clip cuts: (A < 0, r < lo), (A > 0, r > hi)."""
    none = torch.zeros_like(used)
    low = (a < 0) & (r < lo) if lo is not None else none
    high = (a > 0) & (r > hi) if hi is not None else none
    return low, high


def _ratio_stats(log_ratio, used, low_cut, high_cut):
    ratio = torch.exp(log_ratio)
    f = lambda b: masked_mean(b.to(log_ratio.dtype), used)  # noqa: E731
    low, high = f(low_cut), f(high_cut)
    return {
        "clip_frac": low + high,
        "clip_frac_low": low,
        "clip_frac_high": high,
        "ppo_kl": masked_mean(-log_ratio, used),
        "approx_kl": masked_mean(ratio - 1.0 - log_ratio, used),
        "ratio_mean": masked_mean(ratio, used),
    }


@policy_loss("ppo_clip", uses=("clip_low", "clip_high", "dual_clip", "delta", "log_ratio_clamp"))
def ppo_clip_loss(logp, old_logp, a, mask, used, o):
    """PPO-clip (Schulman et al. 2017) with clip-higher (DAPO) and dual clip (Ye et al. 2020):
    l_t = max(-r A, -clip(r, 1-eps_low, 1+eps_high) A)  (= -min(r A, clip(r) A));
    dual clip (c > 1), A < 0 only: l_t = min(max(-r A, -clip(r) A), -c A), i.e. the objective
    is max(min(r A, clip(r) A), c A). Tokens with A >= 0 are unaffected by c.
    ``delta`` (TRL's two-sided clipping, INTELLECT-2) caps the unclipped ratio:
    l_t = -min(min(r, delta) A, clip(r) A)."""
    lo, hi = _clip_bounds(o)
    log_ratio = _log_ratio(logp, old_logp, o.log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    loss_mat = _clipped_surrogate(ratio, a, lo, hi, o.delta)
    stats = _ratio_stats(log_ratio.detach(), used, *_clip_cuts(ratio.detach(), a, lo, hi, used))
    if o.dual_clip is not None:
        # For A < 0 a huge ratio makes -rA unbounded; cap the loss at -c A (c > 1).
        capped = torch.minimum(loss_mat, -a * o.dual_clip)
        dual_cut = (a < 0) & (loss_mat.detach() > (-a * o.dual_clip))
        loss_mat = torch.where(a < 0, capped, loss_mat)
        stats["dual_clip_frac"] = masked_mean(dual_cut.to(logp.dtype), used)
    return loss_mat, stats


def gspo_sequence_log_ratio(logp, old_logp, mask, log_ratio_clamp=20.0, seq_log_ratio_clamp=None):
    """log s_i = (1/|y_i|) sum_t log(pi_theta / pi_old)_it -> [B] (GSPO's length-normalised ratio;
    s_i is the geometric mean of the token ratios). Token log-ratios are clamped to
    +-``log_ratio_clamp`` before the mean, the mean to <= ``seq_log_ratio_clamp`` after it
    (None: no clamp). Empty rows give 0 (s = 1)."""
    seq = masked_mean(_log_ratio(logp, old_logp, log_ratio_clamp), mask, dim=-1)
    return _upper_clamp(seq, seq_log_ratio_clamp)


@policy_loss("gspo", uses=("clip_low", "clip_high", "delta", "log_ratio_clamp", "seq_log_ratio_clamp"))
def gspo_loss(logp, old_logp, a, mask, used, o):
    """GSPO-token (Zheng et al. 2025): s_it = sg[s_i] * pi_it / sg[pi_it],
    l_t = -min(s_it A_it, clip(s_it, 1-eps_low, 1+eps_high) A_it).

    s_it has the value of the sequence ratio s_i and the gradient s_i grad log pi_it; with
    one advantage per sequence this equals GSPO's sequence-level gradient. The paper
    aggregates with "seq-mean-token-mean" and uses tiny clip ranges (3e-4 / 4e-4); both are
    set by the caller. ``seq_log_ratio_clamp`` c clamps log s_it = log pi_it - sg[log pi_it]
    + sg[log s_i] to <= c before exp (verl: c = 10), so a clamped token has no gradient;
    ``delta`` caps the unclipped s_it as in ``ppo_clip_loss`` (TRL).
    """
    lo, hi = _clip_bounds(o)
    token_log_ratio = _log_ratio(logp, old_logp, o.log_ratio_clamp)
    seq_log_ratio = masked_mean(token_log_ratio, mask, dim=-1)
    log_s = _upper_clamp(seq_log_ratio.detach().unsqueeze(-1) + (logp - logp.detach()), o.seq_log_ratio_clamp)
    ratio = torch.exp(log_s)
    loss_mat = _clipped_surrogate(ratio, a, lo, hi, o.delta)
    stats = _ratio_stats(token_log_ratio.detach(), used, *_clip_cuts(ratio.detach(), a, lo, hi, used))
    seq_ratio = _upper_clamp(seq_log_ratio.detach(), o.seq_log_ratio_clamp).exp()
    stats["ratio_mean"] = masked_mean(seq_ratio, used.any(-1))
    return loss_mat, stats


@policy_loss("cispo", uses=("clip_low", "clip_high", "log_ratio_clamp", "ratio_level", "seq_log_ratio_clamp"))
def cispo_loss(logp, old_logp, a, mask, used, o):
    """CISPO (MiniMax-M1, 2025): l_t = -sg[clip(r_t, 1-eps_low, 1+eps_high)] A_t log pi_theta(y_t).

    REINFORCE with a clipped, detached IS weight: every token keeps a gradient. MiniMax-M1
    bounds only the upper side (its eps_low is effectively infinite): pass ``clip_low=None``
    for that; a number clips both sides. The paper aggregates with "token-mean".
    ``ratio_level="sequence"`` weighs every token of sequence i with GSPO's ratio
    s_i = exp(mean_t log r_it) (clamped to <= ``seq_log_ratio_clamp`` in log space if given):
    l_t = -sg[clip(s_i)] A_t log pi_theta(y_t) (TRL's cispo with importance_sampling_level
    "sequence").
    """
    if o.ratio_level == "token":
        _reject_options("cispo", o, ("seq_log_ratio_clamp",), " with ratio_level='token'")
    lo, hi = _clip_bounds(o)
    log_ratio = _log_ratio(logp, old_logp, o.log_ratio_clamp).detach()
    if o.ratio_level == "sequence":
        seq_ratio = torch.exp(_upper_clamp(masked_mean(log_ratio, mask, dim=-1), o.seq_log_ratio_clamp))
        ratio = seq_ratio.unsqueeze(-1).expand_as(log_ratio)
    else:
        ratio = torch.exp(log_ratio)
    weight = _clip(ratio, lo, hi)
    loss_mat = -weight * a * logp
    none = torch.zeros_like(used)
    low_cut = ratio < lo if lo is not None else none
    high_cut = ratio > hi if hi is not None else none
    stats = _ratio_stats(log_ratio, used, low_cut, high_cut)
    stats["clip_frac_high_pos"] = masked_mean((high_cut & (a > 0)).to(logp.dtype), used)
    if o.ratio_level == "sequence":
        stats["ratio_mean"] = masked_mean(seq_ratio, used.any(-1))
    return loss_mat, stats


@policy_loss("sapo", uses=("log_ratio_clamp", "tau_pos", "tau_neg"))
def sapo_loss(logp, old_logp, a, mask, used, o):
    """SAPO (soft adaptive policy optimisation, Qwen 2025): a sigmoid gate on the token ratio
    instead of a hard clip, l_t = -f(r_t) A_t with f(r) = sigmoid(tau (r - 1)) * 4 / tau,
    tau = tau_pos where A > 0, else tau_neg (verl and TRL: 1.0 and 1.05).

    The gradient flows through r: d l_t / d log pi_t = -A_t * 4 sigmoid'(tau (r_t - 1)) * r_t,
    which is -A_t (the policy gradient) at r = 1 and fades smoothly off-policy. The gate's value
    at r = 1 is 2 / tau, not 1 (the 4 / tau makes the *gradient* there 1); kept as published.
    No clipping: the clip stats are 0. verl aggregates with "seq-mean-token-mean".
    """
    log_ratio = _log_ratio(logp, old_logp, o.log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    tau = torch.where(a > 0, torch.full_like(a, o.tau_pos), torch.full_like(a, o.tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss_mat = -gate * a
    none = torch.zeros_like(used)
    return loss_mat, _ratio_stats(log_ratio.detach(), used, none, none)


@policy_loss("reinforce", uses=("log_ratio_clamp",), needs_old=False)
def reinforce_loss(logp, old_logp, a, mask, used, o):
    """REINFORCE (Williams 1992): l_t = -A_t log pi_theta(y_t); no ratio, no clipping.

    ``old_logp`` may be None; when given it only feeds the ratio statistics.
    """
    loss_mat = -a * logp
    if old_logp is not None:
        log_ratio = _log_ratio(logp, old_logp, o.log_ratio_clamp).detach()
    else:
        log_ratio = torch.zeros_like(logp)
    none = torch.zeros_like(used)
    return loss_mat, _ratio_stats(log_ratio, used, none, none)


@policy_loss("kimi", uses=("log_ratio_clamp", "kimi_tau"))
def kimi_loss(logp, old_logp, a, mask, used, o):
    """Kimi k1.5 (Kimi Team 2025, section 2.3): per sequence, with the sequence log-ratio
    l = log pi_theta(y|x) - log pi_old(y|x) (a sum over its tokens) and A = r - mean_group(r)
    (use it with advantage=group_mean: A is the sequence's advantage, its mean over the valid
    tokens), the squared surrogate

        L = (A - tau * l)^2 / (2 tau),   dL/dtheta = -(A - tau l) grad l = -[A grad l - tau/2 grad l^2]:

    the group-baselined policy gradient minus the gradient of a tau/2 l^2 pull towards the
    sampling policy (mirror descent). The paper's (r - mean r - tau l)^2 is tau^2 / 2 times this
    loss: the 1 / (2 tau) makes the step size independent of tau at pi_theta = pi_old, where
    the gradient is REINFORCE's, -A grad log pi(y|x).

    Each valid token carries L / |y|, so the per-sequence sum is L: with "seq-mean-token-sum"
    the loss is the mean of L over sequences (the paper's), and under every aggregation mode
    the gradient at pi_theta = pi_old equals ``reinforce_loss``'s with the same mode. With one
    update per batch (pi_old = pi_theta) the tau term is 0: it acts from the second update on a
    batch (ppo_epochs or num_minibatches > 1). No ratio is exponentiated and nothing is clipped:
    the clip stats are 0.
    """
    log_ratio = _log_ratio(logp, old_logp, o.log_ratio_clamp)
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1)
    seq_adv = masked_mean(a, mask, dim=-1)
    seq_loss = (seq_adv - o.kimi_tau * seq_log_ratio) ** 2 / (2.0 * o.kimi_tau)
    length = masked_count(mask, dim=-1, keepdim=True, dtype=logp.dtype)
    loss_mat = _safe_div(seq_loss.unsqueeze(-1), length).expand_as(logp)
    none = torch.zeros_like(used)
    stats = _ratio_stats(log_ratio.detach(), used, none, none)
    stats["seq_log_ratio_mean"] = masked_mean(seq_log_ratio.detach(), used.any(-1))
    return loss_mat, stats


def compute_policy_loss(name: str, logp, old_logp, advantages, mask, **kwargs):
    """``POLICY_LOSSES[name](logp, old_logp, advantages, mask, **kwargs)``."""
    return lookup(POLICY_LOSSES, name, "policy loss")(logp, old_logp, advantages, mask, **kwargs)


@torch.no_grad()
def offpolicy_sequence_mask(logp, old_logp, advantages, mask, delta: float) -> torch.Tensor:
    """DeepSeek-V3.2 off-policy sequence masking -> [B] float:
    M_i = 0 if A_i < 0 and (1/|y_i|) sum_t (log pi_old - log pi_theta) > delta, else 1.

    ``old_logp`` is the sampling (inference) policy. A_i is the mean advantage over the
    sequence's valid tokens (``advantages`` may be [B] or [B, T]). Empty rows keep 1.
    """
    check_shape("old_logp", old_logp, logp.shape, "logp")
    check_shape("mask", mask, logp.shape, "logp")
    check_finite("logp", logp, mask)
    check_finite("old_logp", old_logp, mask)
    if advantages.dim() == 2:
        check_shape("advantages", advantages, logp.shape, "logp")
        seq_adv = masked_mean(advantages, mask, dim=-1)
    else:
        check_shape("advantages", advantages, logp.shape[:1], "logp[:, 0]")
        seq_adv = advantages
    divergence = masked_mean(old_logp - logp, mask, dim=-1)
    drop = (seq_adv < 0) & (divergence > delta)
    return (~drop).to(logp.dtype)
