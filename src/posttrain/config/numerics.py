"""What `numerics.*` accepts (conf/numerics/: each peer's numeric conventions, read by the
components through interpolation)."""

from __future__ import annotations

from posttrain.config.spec import CLAMP, POSITIVE, Spec, boolean, choice, number, optional, text
from posttrain.core.advantages import SINGLETON_MODES

SPECS: dict[str, Spec] = {
    "numerics.name": text(),
    "numerics.advantage.std_eps": number(0),
    "numerics.advantage.singleton": choice(*SINGLETON_MODES),
    "numerics.advantage.keep_degenerate": boolean(),
    "numerics.kl.value_clamp": CLAMP,
    "numerics.kl.k3_log_ratio_clamp": CLAMP,
    "numerics.kl.k3_value_clamp": CLAMP,
    "numerics.kl.unbiased_gradient": boolean(),
    "numerics.kl.is_weight_cap": optional(POSITIVE),
    "numerics.policy.log_ratio_clamp": CLAMP,
    "numerics.policy.gspo_log_ratio_clamp": CLAMP,
    "numerics.policy.gspo_seq_log_ratio_clamp": CLAMP,
    "numerics.policy.dual_clip": optional(number(1, low_open=True)),
    "numerics.policy.count_empty_rows": boolean(),
    "numerics.preference.ipo_length_normalize": boolean(),
}
