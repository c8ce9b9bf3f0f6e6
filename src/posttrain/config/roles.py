"""What `roles.*` accepts (the models beside the policy: reference, critic, teacher;
conf/train.yaml), and the rules about where a role's weights come from."""

from __future__ import annotations

from posttrain.algorithms import rules
from posttrain.config.spec import Spec, Values, boolean, choice, optional, rule, text
from posttrain.config.run import is_sharded_strategy
from posttrain.models.loading import DTYPES

SPECS: dict[str, Spec] = {
    "roles.*.name_or_path": optional(text()).about("a hub id or HF directory; null: a copy of the policy"),
    "roles.*.init_from": optional(text()).about("'policy', a checkpoint or an HF directory"),
    "roles.*.dtype": optional(choice(*DTYPES)).about("null: the policy's"),
    "roles.*.trainable": boolean(),
    "roles.critic.shared_backbone": boolean(),
}


@rule
def a_role_with_its_own_model_does_not_copy_the_policy(v: Values):
    for role in ("reference", "critic"):
        if v.get(f"roles.{role}.name_or_path") and v.get(f"roles.{role}.init_from") == "policy":
            yield (f"roles.{role}.init_from=policy copies the policy's weights into another model "
                   f"(roles.{role}.name_or_path={v[f'roles.{role}.name_or_path']!r}); set roles.{role}.init_from=null "
                   f"to keep its own weights, or to a checkpoint or HF directory")


@rule
def a_sharded_policy_has_no_shared_critic(v: Values):
    """The shared critic runs the policy's decoder and LM head outside the policy's forward,
    where FSDP2 never gathers the policy's own (root) weights: see sharding.shard_module."""
    if is_sharded_strategy(v) and v.get("algorithm.critic") is not None and v.get("roles.critic.shared_backbone"):
        yield ("roles.critic.shared_backbone=true is not supported with trainer=fsdp (the value head reads the "
               "policy's decoder outside the policy's forward, where FSDP2 gathers the embeddings, final norm and "
               "LM head); use roles.critic.shared_backbone=false (the critic's own backbone), or trainer=ddp")


def roles_in_use(v: Values) -> list[tuple[str, str]]:
    """The roles an online run builds from `roles.<role>`, each with the keys that make it read
    them, in words: the reference of a KL term, the critic of algorithm.critic, the teacher of
    a distillation weight. (A preference algorithm reads roles.reference too, but null is its
    policy's starting weights there: algorithms/preference.py.)"""
    if not v.online():
        return []
    used = []
    name, coef = v.get("kl_estimator.name", "none"), v.get("kl_estimator.coef", 0.0)
    if rules.uses_kl(name, coef):
        used.append(("reference", f"the KL term of kl_estimator={name} (kl_estimator.coef={coef}) reads the frozen "
                                  f"reference's log-probs"))
    if v.get("algorithm.critic") is not None:
        used.append(("critic", f"algorithm={v.algorithm()} trains a critic (algorithm.critic is set)"))
    if rules.distills(v.get("algorithm.distill")):
        used.append(("teacher", f"algorithm={v.algorithm()} distils from a teacher (algorithm.distill), which is "
                                f"loaded as roles.teacher"))
    return used


# What a role's node is for, when the fix is to give it back (conf/train.yaml's defaults).
ROLE_DEFAULTS = {
    "reference": ("{init_from: policy}: the policy's starting weights (with model.lora, the policy's own base "
                  "with the adapter off)"),
    "critic": "{init_from: policy, trainable: true}: a copy of the policy's backbone with a value head",
    "teacher": "{name_or_path: null}, which `teacher=` fills with the teacher's HF directory",
}


@rule
def a_role_in_use_is_configured(v: Values):
    """A role the run reads (roles_in_use) is a mapping: `roles.reference=null` would pass here
    and fail only when the online module builds its reference, after the SFT warm start has
    trained. The remedies: give the role back (drop the override), or turn off what reads it."""
    for role, reader in roles_in_use(v):
        node = v.get(f"roles.{role}")
        if isinstance(node, dict):
            continue
        off = {"reference": "or set kl_estimator=none (or kl_estimator.coef=0) to train without a KL term",
               "critic": "or use an algorithm without a critic (grpo, dr_grpo, ...)",
               "teacher": "or use an algorithm that does not distil"}[role]
        shown = "null" if node is None else repr(node)
        yield (f"roles.{role}={shown}, but {reader}: roles.{role} must be a mapping; drop the override to get the "
               f"default {ROLE_DEFAULTS[role]}, {off}")
