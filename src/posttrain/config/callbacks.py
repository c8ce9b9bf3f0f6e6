"""What `callbacks.*` accepts (conf/callbacks/: checkpoints, the progress bar, early stops, the
user's own callbacks)."""

from __future__ import annotations

from posttrain.config.spec import Spec, choice, integer, list_of, number, optional


def user_components(kind: str) -> Spec:
    """A list of a user's own `kind` objects, each `{_target_: package.module.Class, <options>}`;
    the class and its options are checked at start-up by run/user_components.py."""
    entry = Spec(lambda v: isinstance(v, dict) and isinstance(v.get("_target_"), str),
                 f"{{_target_: package.module.Class, <options>}} ({kind}; docs/extending.md)")
    return list_of(entry)


SPECS: dict[str, Spec] = {
    "callbacks.checkpoint.every_n_train_steps": integer(1),
    "callbacks.checkpoint.save_top_k": integer(-1).about("-1: keep every checkpoint"),
    "callbacks.progress_bar": choice("rich", "none"),
    "callbacks.stop_at_step": optional(integer(1)),
    "callbacks.stop_at_accuracy": optional(number(0, 1, low_open=True)),
    "callbacks.extra": user_components("a lightning.pytorch.callbacks.Callback subclass"),
}
