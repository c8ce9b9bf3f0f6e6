"""experiment=r1_zero: RL from the base model (no warm start) with the accuracy and format
rewards in the r1 template, composed and run for a few steps on the embedded task."""

from conftest import FAST_RUN

from posttrain.train import run


def test_r1_zero_trains_the_base_model_on_the_r1_form(make_config, tmp_path):
    cfg = make_config("experiment=r1_zero", *FAST_RUN, "algorithm.prompts_per_step=4", "algorithm.group_size=8",
                      "trainer.max_steps=3", "trainer.val_check_interval=3",
                      "callbacks.checkpoint.every_n_train_steps=3",
                      "eval.num_prompts=16", "eval.batch_size=16")
    assert cfg.algorithm.warm_start.steps == 0 and cfg.model.init_from is None  # the random "base" model
    assert cfg.data.template == "r1" and cfg.data.style == "verbose"
    assert dict(cfg.reward.components.format)["partial"] is True and cfg.reward.components.accuracy.weight == 1.0
    summary = run(cfg)
    assert summary["global_step"] == 3 and summary["choices"]["experiment"] == "r1_zero"
    for key in ("rewards/accuracy/mean", "rewards/format/mean", "eval/accuracy", "eval/accuracy_start"):
        assert key in summary, key
    # partial credit: a random model's responses already hold some of the tags (each one token)
    assert 0.0 < summary["rewards/format/mean"] < 1.0
