"""The sampler the collect stage draws from: a policy and the rollout engine that samples it.

The collector holds one and calls `generate`; it never calls back into the Lightning module.
In the synchronous pipeline it wraps the trainer's own policy and engine; a producer process
(producer.py) gets one over its own copy of the weights and its own engine.
"""

from __future__ import annotations


class PolicySampler:
    """`generate(prompt_ids, prompt_mask, params, generator) -> RolloutBatch` with `model`
    through `engine`, stopping at any of `eos_ids`. `engine` may be swapped after a sharding
    strategy wraps it (OnlineRLModule.configure_model)."""

    def __init__(self, engine, model, eos_ids: list[int], pad_token_id: int):
        self.engine, self.model, self.eos_ids, self.pad_token_id = engine, model, eos_ids, pad_token_id

    def generate(self, prompt_ids, prompt_mask, params, generator=None):
        return self.engine.generate(self.model, prompt_ids, prompt_mask, params, eos_token_id=self.eos_ids,
                                    pad_token_id=self.pad_token_id, generator=generator)

    def weights_loaded(self) -> None:
        """New weights are in the model: an engine with its own copy (vLLM) reloads it."""
        notify = getattr(self.engine, "policy_updated", None)
        if notify is not None:
            notify()
