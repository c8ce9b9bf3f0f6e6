"""What `roles.*` accepts (the models beside the policy: reference, critic, teacher;
conf/train.yaml), and the rules about where a role's weights come from."""

from __future__ import annotations

from posttrain.config.spec import Spec, Values, boolean, choice, optional, rule, text
from posttrain.config.trainer import is_sharded_strategy
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
