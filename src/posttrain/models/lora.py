"""LoRA (Hu et al. 2021) through PEFT, for every algorithm: the `model.lora` config node.

With `model.lora.r` set, the policy (after its `init_from` weights are loaded and its dropout
switched off) is wrapped by `peft.get_peft_model`: a low-rank update B·A (scaled by alpha / r)
on each targeted linear layer, B starting at zero so the adapted policy starts equal to its
base. Only A and B train; the optimisers collect parameters with `requires_grad`, so they
see only the adapter.

Three things follow from the policy carrying an adapter:

- the reference of a KL term is, by default, the base itself: the policy's forward with the
  adapter switched off (`reference_model`), not a second copy of the weights;
- a role that copies the policy (`roles.critic`, a reference with its own `init_from`) copies
  the base without the adapter (`copy_without_adapter`);
- the export (`export_model`) writes the adapter and the tokenizer (PEFT's layout), or with
  `export_merged` the merged full model, the adapter beside it in `adapter/`; the merged model
  (`merged_copy`, also what rollout=vllm samples from) has an untied LM head when an adapter
  sits on a head tied to the input embeddings.
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch import nn

from posttrain.errors import ConfigError
from posttrain.files import save_pretrained_atomic

# Where a merged export keeps the adapter it was merged from (beside the full model's files).
ADAPTER_SUBDIR = "adapter"


def lora_enabled(model_cfg) -> bool:
    """Whether `model.lora` is switched on (its rank `r` is set)."""
    lora = model_cfg.get("lora")
    return lora is not None and lora.get("r") is not None


def has_adapter(model: nn.Module) -> bool:
    # a run without LoRA never imports peft (seconds of start-up), and then no model is a PeftModel
    peft_model = sys.modules.get("peft.peft_model")
    return peft_model is not None and isinstance(model, peft_model.PeftModel)


def base_model_location(model_cfg) -> str | None:
    """The Hugging Face directory or hub id the adapter's base weights can be loaded from:
    init_from when it is a model directory, else name_or_path; None for a base that exists
    nowhere on disk (the embedded tiny model, or weights from a Lightning checkpoint)."""
    init_from = model_cfg.get("init_from")
    if init_from:
        return str(Path(init_from).expanduser().resolve()) if Path(init_from).expanduser().is_dir() else None
    return model_cfg.get("name_or_path")


def apply_lora(model: nn.Module, model_cfg) -> nn.Module:
    """``model`` wrapped with a fresh LoRA adapter as `model.lora` says, or unchanged when LoRA
    is off. The base's weights are frozen; the adapter's dropout is the configured one."""
    if not lora_enabled(model_cfg):
        return model
    # start-up: PEFT loads only for a LoRA run
    from peft import LoraConfig, get_peft_model

    lora = model_cfg.lora
    targets = lora.target_modules
    targets = OmegaConf.to_container(targets) if OmegaConf.is_config(targets) else targets
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                        task_type="CAUSAL_LM", base_model_name_or_path=base_model_location(model_cfg))
    try:
        wrapped = get_peft_model(model, config)
    except ValueError as err:  # PEFT's "Target modules ... not found in the base model"
        raise ConfigError(f"model.lora.target_modules={targets!r} does not fit the model: "
                          f"{str(err).strip().splitlines()[0]}") from None
    # PEFT replaces the recorded base by the model's own name_or_path, None for weights loaded
    # through init_from: keep ours, which the export records and posttrain-eval loads
    wrapped.peft_config["default"].base_model_name_or_path = base_model_location(model_cfg)
    return wrapped


ADAPTER_CONFIG = "adapter_config.json"


def holds_adapter_weights(path: str) -> bool:
    """Whether ``path`` (a `model.init_from`) holds a LoRA run's weights: an adapter export
    (PEFT's adapter_config.json), or a Lightning checkpoint of a policy that carried an
    adapter. Such weights load onto the wrapped policy, after `apply_lora`."""
    path = Path(path).expanduser()
    if path.is_dir():
        return (path / ADAPTER_CONFIG).is_file()
    if path.is_file() and path.suffix == ".ckpt":
        try:
            state = torch.load(path, map_location="cpu", weights_only=False, mmap=True).get("state_dict", {})
        except Exception:  # noqa: BLE001 - unreadable: load_initial_weights names the file
            return False
        return any(key.startswith("policy.") and ".lora_" in key for key in state)
    return False


def adapter_base(directory: str) -> str | None:
    """Where an adapter export's base weights are: the `base_model_name_or_path` PEFT recorded."""
    return json.loads((Path(directory) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")


def copy_without_adapter(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s weights for another role: for a policy with an adapter, its base
    alone (every weight trainable again, as a plain copy's), else a plain deep copy."""
    if not has_adapter(model):
        return copy.deepcopy(model)
    return copy.deepcopy(model).unload().requires_grad_(True)


def reference_is_the_base(policy: nn.Module, reference_cfg) -> bool:
    """Whether the reference is the policy's own base, computed with the adapter off instead of
    built as a copy: the policy carries an adapter and `roles.reference` asks for the policy's
    starting weights (init_from=policy) in no other model or dtype."""
    return (has_adapter(policy) and reference_cfg.get("init_from") == "policy"
            and not reference_cfg.get("name_or_path") and not reference_cfg.get("dtype"))


@contextlib.contextmanager
def reference_model(policy: nn.Module, reference: nn.Module | None):
    """The model whose forward gives the reference's log-probs: the frozen ``reference`` role
    when one was built, else (``reference`` None) the policy with its adapter switched off for
    the duration, i.e. the base weights it started from."""
    if reference is not None:
        yield reference
        return
    with policy.disable_adapter():
        yield policy


def merged_copy(model: nn.Module) -> nn.Module:
    """A plain Hugging Face model whose weights are ``model``'s base plus its adapter's update
    (a copy: the training module keeps its adapter), computing what ``model`` computes.

    With tied embeddings and an adapter on the LM head (or on the input embeddings) the policy's
    head is the shared matrix plus the head's update while its input embeddings are the shared
    matrix alone: merging into the shared matrix would change both. The copy is untied first
    (`untie_adapted_embeddings`), so each merges its own update and the copy's config says
    tie_word_embeddings=false: what the export writes and what vLLM is built from and synced with."""
    merged = copy.deepcopy(model)
    untie_adapted_embeddings(merged)
    return merged.merge_and_unload()


def untie_adapted_embeddings(model: nn.Module) -> bool:
    """Untie ``model``'s (a PEFT model's) input and output embeddings in place when they share
    one weight and either carries an adapter: the LM head gets its own copy of the weight and
    the config (and its text config) tie_word_embeddings=false. True when it untied them; the
    model computes the same either way (the adapter's forward reads the weight, not the tie)."""
    base = model.get_base_model()
    try:
        inputs, outputs = base.get_input_embeddings(), base.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return False
    if inputs is None or outputs is None:
        return False
    plain_inputs, plain_outputs = getattr(inputs, "base_layer", inputs), getattr(outputs, "base_layer", outputs)
    adapted = plain_inputs is not inputs or plain_outputs is not outputs
    if not adapted or plain_outputs.weight is not plain_inputs.weight:
        return False  # nothing merges into a shared weight: the merged copy stays tied, as the policy is
    shared = plain_outputs.weight
    plain_outputs.weight = nn.Parameter(shared.detach().clone(), requires_grad=shared.requires_grad)
    text_config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    for config in {id(c): c for c in (base.config, text_config)}.values():
        if getattr(config, "tie_word_embeddings", False):
            config.tie_word_embeddings = False
    if hasattr(base, "all_tied_weights_keys"):  # transformers >= 5 keeps the mapping computed at init
        base.all_tied_weights_keys = base.get_expanded_tied_weights_keys(all_submodels=True)
    return True


def export_model(model: nn.Module, tokenizer, directory: Path, model_cfg) -> None:
    """The run's Hugging Face export. Without an adapter: the model and tokenizer. With one:
    the adapter and tokenizer (adapter_config.json, adapter_model.safetensors), or with
    `model.lora.export_merged` the merged full model and tokenizer, the adapter in
    ``directory``/adapter. Written whole or not at all."""

    if has_adapter(model) and model_cfg.lora.export_merged:
        save_pretrained_atomic(merged_copy(model), tokenizer, directory, subdirectories={ADAPTER_SUBDIR: model})
    else:
        save_pretrained_atomic(model, tokenizer, directory)
