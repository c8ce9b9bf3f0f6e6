"""What a run will cost, from its config alone, before any weights are read.

`memory.py` is the memory check `posttrain` runs before it loads a model (and the sizes the
rest reads); the rest is `posttrain-estimate`: `architecture.py` the models and their sizes,
`batch.py` the rollout batch, `stages.py` memory and FLOPs by stage, `speed.py` the devices'
speeds, `estimator.py` the estimate of a composed config, `command.py` the command line. The
formulas are `posttrain.core.cost`'s; docs/estimate.md says what each term holds and how the
predictions compare with measured runs."""
