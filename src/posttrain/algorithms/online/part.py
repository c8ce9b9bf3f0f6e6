"""The one interface a capability of the online learner plugs in through.

The learner itself is GRPO: collect -> advantages -> the clipped policy loss (and entropy).
Everything else — the KL against a frozen reference, a critic with GAE, distillation, PTX,
process rewards, the constraint's multiplier, the train-inference correction's budget — is a
`Part`, one file each under parts/, built only when its config turns it on (parts/__init__.py).
A part that is off is not in the list: it costs nothing and no stage sees it.

Each hook is called at one place of the step (module.py, learner.py), in the order of the
parts list, and does nothing by default. A part overrides the few it needs:

  options       its declared options (core.options.Option), read at start-up and by --help
  roles         the models it brings (the module registers them: Lightning moves and shards them)
  collect_options  settings of the collector (a process reward's step rule, the constraint's cost)
  scorers       annotate: Experience fields it fills before the update (ref_logp, values, ...)
  after_collect the batch as consumed, before annotate (the constraint's penalty)
  shape_rewards the per-token rewards before the advantage estimator (KL in the reward, step
                rewards) and the estimator's extra options (prm_step's step mask)
  after_advantages  the advantages once estimated (a distillation reward), with metrics
  policy_terms  loss terms added to the policy's loss (terms.py's interface)
  micro_batch   extra MicroBatch fields it computes per micro-batch (a teacher's logits)
  after_micro_batches  a loss of its own on the policy, after a minibatch's micro-batches (PTX)
  after_update  with the update's stats: controllers step, budgets are checked
  save / load   its state in the checkpoint (a plain dict entry per key)

A part that trains a role of its own (the critic) also gives `role_terms`, `role_parameters`,
`role_optim` and `role_max_grad_norm`; the learner steps it with its own optimiser.
"""

from __future__ import annotations

from posttrain.algorithms.experience import Experience


class Part:
    name = "part"
    options: tuple = ()
    # whether its stages read pi_old's log-probs of the batch (the old_logp scorer then runs
    # even when the update is on-policy)
    needs_old_logp = False

    def setup(self, rank: int, world: int) -> None:
        """When the process's rank is known (Lightning's setup)."""

    def roles(self) -> dict:
        return {}

    def collect_options(self) -> dict:
        return {}

    def scorers(self) -> list[tuple[str, object]]:
        return []

    def after_collect(self, exp: Experience) -> tuple[Experience, dict]:
        return exp, {}

    def shape_rewards(self, exp: Experience, token_rewards, options: dict) -> tuple[object, dict]:
        """(per-token rewards, metrics); may add the advantage estimator's keyword options to `options`."""
        return token_rewards, {}

    def after_advantages(self, exp: Experience) -> dict:
        return {}

    def policy_terms(self) -> list:
        return []

    def policy_may_train(self, batch_index: int) -> bool:
        """False while the part holds the policy back (the critic's warm-up)."""
        return True

    def micro_batch(self, exp: Experience, train_policy: bool) -> dict:
        return {}

    def after_micro_batches(self, train_policy: bool) -> dict:
        return {}

    def after_update(self, exp: Experience, metrics: dict, step: int) -> None:
        """`metrics` holds the batch's metrics so far; the part adds its own in place."""

    def save(self, checkpoint: dict) -> None:
        pass

    def load(self, checkpoint: dict) -> None:
        pass

    # --- a role with an optimiser of its own (the critic) -----------------------------------
    def role_terms(self) -> list:
        return []
