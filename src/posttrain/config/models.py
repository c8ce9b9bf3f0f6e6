"""What the model keys accept: model.* (the policy: the embedded tiny model's shape or a
pretrained one, its dtype and LoRA) and teacher / teacher_recipe.* (the frozen teacher of the
distillation algorithms, and the recipe of the embedded ones); and the rules about them."""

from __future__ import annotations

from omegaconf import OmegaConf

from posttrain.algorithms import rules
from posttrain.conf import CONFIG_DIR
from posttrain.config.spec import (BELOW_ONE, POSITIVE, SEED, Spec, Values, anything, boolean, choice, either, integer,
                                   list_of, mapping, number, optional, rule, text)
from posttrain.config.run import is_sharded_strategy
from posttrain.models.loading import DTYPES


# --- model ------------------------------------------------------------------------------

ARCHITECTURES = ("qwen2", "llama")

MODEL_SPECS: dict[str, Spec] = {
    "model.name_or_path": optional(text()).about("a hub id or HF directory; null: the embedded tiny model"),
    "model.init_from": optional(text()).about("a Lightning checkpoint (trainer=fsdp: a directory) or an HF directory"),
    "model.architecture": choice(*ARCHITECTURES),
    "model.hidden_size": integer(1),
    "model.num_layers": integer(1),
    "model.num_heads": integer(1),
    "model.num_kv_heads": integer(1),
    "model.intermediate_size": integer(1),
    "model.max_position_embeddings": integer(1),
    "model.tie_word_embeddings": boolean(),
    "model.dtype": choice(*DTYPES),
    "model.gradient_checkpointing": either(boolean(), choice("selective"), expected="true, false or 'selective'").about(
        "the trainable policy's decoder layers, recomputed in the backward: true (all of each layer), 'selective' "
        "(all but its matmuls and attention, whose outputs are kept) or false"),
    "model.allow_low_precision_weights": boolean().about("true: let AdamW step bfloat16/float16 weights"),
    "model.lora.r": optional(integer(1)).about("LoRA rank; null: LoRA off"),
    "model.lora.alpha": POSITIVE.about("LoRA scale alpha / r"),
    "model.lora.dropout": BELOW_ONE.about("dropout on the adapter's input"),
    "model.lora.target_modules": either(text(), list_of(text()),
                                        expected="'all-linear' or a list of module names, e.g. [q_proj, v_proj]"),
    "model.lora.export_merged": boolean().about("true: hf_model/ is the merged full model"),
}


@rule
def a_pretrained_model_is_named(v: Values):
    # model=hf's name_or_path is null rather than `???`, so that this message, which names the
    # fix, is the one the user sees
    if v.choices.get("model") == "hf" and v.get("model.name_or_path") is None:
        yield ("model=hf needs model.name_or_path (a hub id or a local Hugging Face model directory), e.g. "
               "model.name_or_path=Qwen/Qwen2.5-0.5B-Instruct")


# Half of the spacing between neighbouring values, relative to the value: AdamW's updates
# smaller than this round away. Keyed by model.dtype and by the Lightning precisions that
# cast the module's weights themselves.
HALF_PRECISION_RESOLUTION = {"bfloat16": "0.4%", "float16": "0.05%", "bf16-true": "0.4%", "16-true": "0.05%"}


@rule
def trainable_weights_are_not_half_precision(v: Values):
    """AdamW on bf16 weights rounds away every update below half a bf16 ulp of the weight
    (~0.4% of it): at RL learning rates (1e-6 x an O(1) Adam step) most updates vanish and
    training silently stalls. fp32 master weights with bf16 autocast compute cost 2 extra
    bytes per parameter and keep every update; trainer=fsdp upcasts trainable roles itself."""
    if v.get("model.allow_low_precision_weights", False):
        return
    sharded = is_sharded_strategy(v)
    dtype = v.get("model.dtype", "float32")
    fix = ("keep model.dtype=float32 with trainer.precision=bf16-mixed (fp32 master weights, bf16 compute), or set "
           "model.allow_low_precision_weights=true to accept it")
    # a LoRA policy's half-precision base is frozen: AdamW steps only the adapter, which PEFT keeps in fp32
    if dtype in HALF_PRECISION_RESOLUTION and not sharded and v.get("model.lora.r") is None:
        yield (f"model.dtype={dtype!r} makes AdamW step {dtype} weights, which rounds away updates smaller than "
               f"~{HALF_PRECISION_RESOLUTION[dtype]} of a weight (most updates at RL learning rates): training "
               f"would silently stall; {fix}")
    precision = v.get("trainer.precision")
    if precision in HALF_PRECISION_RESOLUTION:
        yield (f"trainer.precision={precision!r} casts the trainable weights to half precision, so AdamW rounds "
               f"away updates smaller than ~{HALF_PRECISION_RESOLUTION[precision]} of a weight: training would "
               f"silently stall; {fix}")


# The embedded model's own settings (conf/model/tiny.yaml), which a pretrained model's
# config.json replaces; model=hf and its presets inherit them unused.
EMBEDDED_MODEL_KEYS = ("architecture", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                       "max_position_embeddings", "tie_word_embeddings")


@rule
def a_pretrained_model_ignores_no_setting(v: Values):
    """`model.hidden_size=64` next to a name_or_path would be ignored in silence: refuse it."""
    if v.get("model.name_or_path") is None:
        return

    embedded = OmegaConf.load(f"{CONFIG_DIR}/model/tiny.yaml")
    changed = [f"model.{key}={v.get(f'model.{key}')!r}" for key in EMBEDDED_MODEL_KEYS
               if f"model.{key}" in v.values and v.get(f"model.{key}") != embedded.get(key)]
    if changed:
        yield (f"{', '.join(changed)} would be ignored: they shape the embedded model, and model.name_or_path="
               f"{v['model.name_or_path']!r} brings its own architecture and size (its config.json); drop them")


@rule
def tiny_model_heads_fit(v: Values):
    if v.get("model.name_or_path") is not None or "model.hidden_size" not in v.values:
        return
    hidden, heads, kv_heads = v["model.hidden_size"], v["model.num_heads"], v["model.num_kv_heads"]
    if hidden % heads:
        yield (f"model.hidden_size={hidden} is not a multiple of model.num_heads={heads} (each attention head "
               f"gets hidden_size / num_heads dimensions)")
    elif (hidden // heads) % 2:
        yield (f"model.hidden_size / model.num_heads = {hidden} / {heads} = {hidden // heads} is odd; expected an "
               f"even head size (rotary position embeddings rotate pairs of dimensions)")
    if heads % kv_heads:
        yield (f"model.num_heads={heads} is not a multiple of model.num_kv_heads={kv_heads} (each key/value head "
               f"serves num_heads / num_kv_heads query heads)")


@rule
def lora_export_and_start_are_loadable(v: Values):
    """An adapter alone is usable only beside its base on disk: a model directory (name_or_path,
    an init_from directory, or the SFT warm start's export, which an online run starts from)."""
    if v.get("model.lora.r") is None or v["model.lora.export_merged"]:
        return
    init_from, name_or_path = v.get("model.init_from"), v.get("model.name_or_path")
    warm_start = v.get("algorithm.warm_start.steps", 0) if v.online() and not init_from else 0
    if name_or_path is None and not warm_start and (init_from is None or str(init_from).endswith(".ckpt")):
        base = "the embedded tiny model" if init_from is None else f"model.init_from={init_from!r} (a checkpoint)"
        yield (f"model.lora.r={v['model.lora.r']} with model.lora.export_merged=false exports only the adapter, "
               f"but its base, {base}, is not a Hugging Face model on disk to apply it to: set "
               f"model.lora.export_merged=true, or start from an HF directory (model.init_from or model.name_or_path)")


@rule
def lora_is_not_sharded(v: Values):
    if is_sharded_strategy(v) and v.get("model.lora.r") is not None:
        yield (f"model.lora.r={v['model.lora.r']} is not supported with trainer=fsdp "
               f"(trainer.strategy._target_={v['trainer.strategy']['_target_']}): FSDP2 sharding of a "
               f"PEFT-wrapped policy is not built; use trainer=ddp or trainer=cpu with LoRA, or model.lora.r=null")


# --- teacher ----------------------------------------------------------------------------

TEACHER_SPECS: dict[str, Spec] = {
    "teacher": optional(text()).about("an HF directory, a checkpoint or run directory, or tiny_concise / tiny_verbose"),
    "teacher_recipe.model": mapping("{hidden_size: 256, num_layers: 4}").about("overrides of conf/model/tiny.yaml"),
    "teacher_recipe.model.hidden_size": integer(1),
    "teacher_recipe.model.num_layers": integer(1),
    "teacher_recipe.model.num_heads": integer(1),
    "teacher_recipe.model.intermediate_size": integer(1),
    # further keys of conf/model/tiny.yaml (+teacher_recipe.model.architecture=llama): checked
    # as model.<key> when the recipe's SFT run starts
    "teacher_recipe.model.*": anything(),
    "teacher_recipe.steps": integer(1).about("SFT steps, or their cap with until_accuracy"),
    "teacher_recipe.until_accuracy": optional(number(0, 1, low_open=True)).about("held-out greedy accuracy to "
                                                                                 "stop at; null: all steps"),
    "teacher_recipe.eval_every": integer(1).about("SFT steps between held-out evaluations"),
    "teacher_recipe.lr": POSITIVE.about("learning rate"),
    "teacher_recipe.batch_size": integer(1),
    "teacher_recipe.seed": SEED,
}


def teacher_keys(v: Values) -> list[str]:
    """The keys that configure a teacher, as `key=value`."""
    keys = ("teacher", "roles.teacher.name_or_path", "roles.teacher.init_from")
    return [f"{key}={v.get(key)}" for key in keys if v.get(key) is not None]


@rule
def distillation_reads_a_teacher(v: Values):
    """A distilling algorithm needs a teacher; a teacher no stage reads would be loaded (or
    trained) for nothing, and suggests the user meant another algorithm."""
    if not v.online():
        return

    algorithm = v.algorithm()
    distill = v.get("algorithm.distill")
    configured = teacher_keys(v)
    if problem := rules.teacher_problem(rules.distills(distill), bool(configured), f"algorithm={algorithm}"):
        yield problem
    elif configured and not rules.distills(distill):
        why = ("algorithm.distill.coef=0" if distill else "it has no algorithm.distill")
        yield (f"{' and '.join(configured)} is set, but algorithm={algorithm} does not read a teacher ({why}); drop "
               f"the teacher, or use algorithm=opd / kdrl, or set algorithm.distill.coef > 0")


SPECS: dict[str, Spec] = {**MODEL_SPECS, **TEACHER_SPECS}
