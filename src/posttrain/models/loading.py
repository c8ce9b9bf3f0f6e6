"""Policy and tokenizer construction from the `model` config group."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerFast

from posttrain.distributed.recompute import enable_activation_checkpointing
from posttrain.distributed.sharding import (
    is_distributed_checkpoint,
    policy_weights_from_distributed_checkpoint,
)
from posttrain.errors import CheckpointError, ConfigError
from posttrain.models.gguf import hf_directory, names_gguf
from posttrain.models.lora import ADAPTER_CONFIG, apply_lora, has_adapter, holds_adapter_weights
from posttrain.models.tiny import build_char_tokenizer, build_tiny_model

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# A local model directory needs one of these to hold a tokenizer (tokenizer_config.json alone
# only names the class: without a vocabulary AutoTokenizer builds an empty, useless one).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model")
# Config fields that hold a model's context length, by model family.
CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")

_PAD_WARNED: set[str] = set()  # models whose missing pad token was already reported


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or os.sep == "\\" and "\\" in name


def _resolve_pretrained(name: str, key: str) -> str:
    """A local directory as an absolute path, a GGUF (`gguf:<package>` or a `.gguf` file) as
    its cached Hugging Face directory (models/gguf.py), or a hub id left as is."""
    if names_gguf(name):
        return str(hf_directory(name, key))
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{key}={name!r} is a file; expected a Hugging Face model directory")
        return str(path.resolve())
    if _looks_like_path(name):
        raise CheckpointError(f"{key}={name!r}: no such directory")
    return name


def load_tokenizer_and_model(model_cfg, alphabet: str):
    """(tokenizer, policy) for the run: the embedded tiny model or a pretrained one, with its
    stop tokens recorded in its generation config (`stop_token_ids`) and, when
    `model.gradient_checkpointing` is set, Hugging Face gradient checkpointing on."""
    if model_cfg.dtype not in DTYPES:
        raise ConfigError(f"model.dtype={model_cfg.dtype!r} is not one of {sorted(DTYPES)}")
    dtype = DTYPES[model_cfg.dtype]
    if model_cfg.name_or_path is None:
        tokenizer = build_char_tokenizer(alphabet, model_max_length=model_cfg.max_position_embeddings)
        model = build_tiny_model(
            vocab_size=len(tokenizer),
            architecture=model_cfg.architecture,
            hidden_size=model_cfg.hidden_size,
            num_layers=model_cfg.num_layers,
            num_heads=model_cfg.num_heads,
            num_kv_heads=model_cfg.num_kv_heads,
            intermediate_size=model_cfg.intermediate_size,
            max_position_embeddings=model_cfg.max_position_embeddings,
            tie_word_embeddings=model_cfg.tie_word_embeddings,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        ).to(dtype)
    else:
        tokenizer, model = load_pretrained(model_cfg.name_or_path, "model.name_or_path", dtype)

    init_from = model_cfg.get("init_from")
    adapter_weights = bool(init_from) and holds_adapter_weights(init_from)  # they load onto the adapter, below
    if init_from and not adapter_weights:
        load_initial_weights(model, init_from)
    disable_dropout(model)
    # Computed once here and kept on the model: roles copied from the policy, the warm start's
    # export (save_pretrained writes generation_config.json) and engines reading the model's
    # generation config (transformers, vLLM) all stop on the same ids.
    model.generation_config.eos_token_id = stop_token_ids(tokenizer, model)
    checkpointing = model_cfg.get("gradient_checkpointing", False)  # .get: configs saved before the key existed
    if checkpointing:  # true: recompute each decoder layer in the backward; "selective": all but its matmuls
        enable_activation_checkpointing(model, checkpointing)
    model = apply_lora(model, model_cfg)  # model.lora: an adapter on the loaded, dropout-free base
    if adapter_weights:
        load_adapter_weights(model, init_from)
    return tokenizer, model


def stop_token_ids(tokenizer, model) -> list[int]:
    """Every token id that ends a response: the tokenizer's EOS, then each EOS id of the
    model's generation config (falling back to its config), without repeats.

    Chat models end a turn with a token other than the base model's end of text, and list
    both: Qwen2.5-Instruct [<|im_end|>, <|endoftext|>], Llama-3.2-Instruct [<|end_of_text|>,
    <|eom_id|>, <|eot_id|>]. Stopping only at the tokenizer's EOS would run past the others
    to the token budget and score (and train on) text after the end of the answer."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        declared = getattr(source, "eos_token_id", None)
        if declared is not None:
            ids += [declared] if isinstance(declared, int) else list(declared)
            break
    stops = list(dict.fromkeys(int(i) for i in ids))  # ordered, unique
    if not stops:
        raise CheckpointError(f"{getattr(model.config, 'name_or_path', 'the model')!r}: neither the tokenizer nor the "
                              f"model's generation config names an EOS token, so generation could never stop")
    return stops


def _is_dropout_name(name: str) -> bool:
    return "dropout" in name or name.endswith("pdrop")  # attention_dropout, resid_pdrop, ...


def disable_dropout(model: nn.Module) -> nn.Module:
    """Switch every dropout off for good, in train() mode too (as TRL and torchtune do).

    The sampler runs in eval mode, so a training forward with dropout scores the sampled
    tokens under a different (noisy) policy: the PPO ratio is not 1 at the first step and
    the KL/ref terms are noisy.  Three places hold a rate: ``nn.Dropout`` modules, float
    attributes copied from the config at construction (HF attention keeps
    ``self.attention_dropout`` and calls ``F.dropout`` with it), and the config itself
    (read by modules built later, and saved with the checkpoint).  Returns ``model``.
    """
    def zero_rates(obj) -> None:
        for name, value in list(vars(obj).items()):
            if _is_dropout_name(name) and isinstance(value, float):
                setattr(obj, name, 0.0)
            elif isinstance(value, PretrainedConfig):
                zero_rates(value)  # sub-configs (text_config, ...)

    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):  # Dropout, Dropout1d/2d/3d, AlphaDropout
            module.p = 0.0
        else:
            zero_rates(module)
    if isinstance(getattr(model, "config", None), PretrainedConfig):
        zero_rates(model.config)
    return model


# the tokenizer classes that mean "the tokenizer.json as it is" (an exported embedded tokenizer)
AS_SAVED_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(source: str):
    """The tokenizer of a model directory or hub name. A directory whose tokenizer_config.json
    names no tokenizer of its own (the embedded character tokenizer's export) loads its
    tokenizer.json as it is: AutoTokenizer would pick the model type's class (Qwen2's) and its
    pre-tokenizer, which drops the spaces and newlines a character vocabulary spells."""
    config = Path(source) / "tokenizer_config.json"
    if config.is_file() and (Path(source) / "tokenizer.json").is_file():
        if json.loads(config.read_text()).get("tokenizer_class") in AS_SAVED_TOKENIZERS:
            return PreTrainedTokenizerFast.from_pretrained(source)
    return AutoTokenizer.from_pretrained(source)


def load_pretrained(name: str, key: str, dtype=torch.float32):
    source = _resolve_pretrained(name, key)
    if Path(source).is_dir():
        check_tokenizer_files(source, key, name)
    try:
        tokenizer = load_tokenizer(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    except (OSError, ValueError) as err:
        first_line = first_line_of(err)
        raise CheckpointError(
            f"{key}={name!r} could not be loaded as a Hugging Face causal LM "
            f"(not a local model directory, and the hub is unreachable or has no such model): {first_line}"
        ) from None
    check_vocabulary_fits(tokenizer, model, f"{key}={name!r}")
    context = declared_context(model.config)
    if context is not None:
        # the datamodule checks prompt lengths against it, and the export records it
        tokenizer.model_max_length = context
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise CheckpointError(f"{key}={name!r}: the tokenizer has neither a pad nor an EOS token, so batches "
                                  f"cannot be padded and generation cannot stop; add them to its tokenizer_config.json")
        tokenizer.pad_token = tokenizer.eos_token  # generation needs a pad id; EOS is the usual choice
        if name not in _PAD_WARNED:  # said once per model, not at every load (warm start, roles)
            _PAD_WARNED.add(name)
            log.warning(f"{key}={name!r}: the tokenizer has no pad token; padding with its EOS token "
                        f"{tokenizer.eos_token!r} (id {tokenizer.eos_token_id})")
    tokenizer.padding_side = "left"
    return tokenizer, model


def declared_context(config) -> int | None:
    """The context length (positions) a model's config declares, or None if it names none."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()  # multimodal configs keep it on the text model
    for field in CONTEXT_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_tokenizer_files(directory: str, key: str, name: str) -> None:
    found = [f for f in TOKENIZER_FILES if (Path(directory) / f).is_file()]
    if not found:
        raise CheckpointError(
            f"{key}={name!r}: the model directory {directory} holds no tokenizer (looked for "
            f"{', '.join(TOKENIZER_FILES)}); save the model's tokenizer there (tokenizer.save_pretrained(dir)) "
            f"or copy its tokenizer files in")


def check_vocabulary_fits(tokenizer, model, where: str) -> None:
    """Every token id the tokenizer can produce must have a row in the input embeddings."""
    rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > rows:
        extra = tokenizer.convert_ids_to_tokens(list(range(rows, min(len(tokenizer), rows + 5))))
        raise CheckpointError(
            f"{where}: the tokenizer has {len(tokenizer)} tokens but the model's input embeddings have {rows} rows, "
            f"so token ids {rows}..{len(tokenizer) - 1} (e.g. {extra}) have no embedding; the tokenizer belongs to "
            f"another model, or tokens were added to it without model.resize_token_embeddings: use the model's own "
            f"tokenizer")


def first_line_of(err: Exception) -> str:
    """The gist of a library's (often many-line) error, for a one-paragraph message."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def load_initial_weights(model, init_from: str, key: str = "model.init_from") -> None:
    """Start weights from a Lightning checkpoint (its `policy.*` tensors) or an HF directory;
    errors name the config ``key`` that pointed here."""
    path = Path(init_from).expanduser()
    if not path.exists():
        raise CheckpointError(f"{key}={init_from!r}: no such file or directory")

    if is_distributed_checkpoint(path):  # a trainer=fsdp checkpoint: a directory of shards
        state = policy_weights_from_distributed_checkpoint(path, key)
    elif path.is_dir():
        check_same_family(model, path, key, init_from)

        try:
            state = AutoModelForCausalLM.from_pretrained(str(path), dtype=next(model.parameters()).dtype).state_dict()
        except (OSError, ValueError) as err:
            first_line = first_line_of(err)
            raise CheckpointError(f"{key}={init_from!r} is not a loadable Hugging Face model directory: "
                                  f"{first_line}") from None
    else:
        try:
            checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as err:  # noqa: BLE001 - any unreadable file is the user's culprit
            raise CheckpointError(f"{key}={init_from!r} is not a readable checkpoint: {err}") from None
        state = {k[len("policy."):]: v for k, v in checkpoint.get("state_dict", {}).items() if k.startswith("policy.")}
        if not state:
            raise CheckpointError(f"{key}={init_from!r} holds no 'policy.*' weights")
    check_shapes(model, state, key, init_from)
    check_tied_head(model, state, key, init_from)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight")]  # tied heads are not stored twice
    if missing or unexpected:
        raise CheckpointError(
            f"{key}={init_from!r} does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )


def check_tied_head(model, state: dict, key: str, init_from: str) -> None:
    """Weights with an LM head of their own (a LoRA export merged into a tied head is untied:
    models/lora.py) cannot go into a model whose head is its input embedding: one parameter
    would take both tensors, the last one loaded silently winning."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    head, embedding = state.get("lm_head.weight"), state.get("model.embed_tokens.weight")
    if head is not None and embedding is not None and not torch.equal(head, embedding):
        raise CheckpointError(f"{key}={init_from!r} has an LM head apart from its input embeddings (an untied "
                              f"model, e.g. a merged LoRA export of a tied head), but this model ties them: set "
                              f"model.tie_word_embeddings=false (or load the directory by model.name_or_path)")


def check_same_family(model, directory: Path, key: str, init_from: str) -> None:
    """An HF directory of another model family (llama weights into a qwen2 model) is refused by name."""
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{key}={init_from!r} is a directory without config.json: not a Hugging Face model "
                              f"directory (give a directory written by save_pretrained, or a Lightning .ckpt)")
    try:
        theirs = json.loads(config_file.read_text()).get("model_type")
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{key}={init_from!r}: {config_file} is not readable JSON: {err}") from None
    ours = getattr(getattr(model, "config", None), "model_type", None)
    if theirs and ours and theirs != ours:
        raise CheckpointError(f"{key}={init_from!r} holds a {theirs} model ({config_file}), but the model being "
                              f"trained is a {ours} model; start from weights of the same architecture")


def check_shapes(model, state: dict, key: str, init_from: str) -> None:
    """Weights of another size are a clear error naming the first tensor that differs, instead
    of torch's size-mismatch traceback."""
    own = model.state_dict()
    mismatched = [name for name, tensor in state.items() if name in own and own[name].shape != tensor.shape]
    if mismatched:
        first = mismatched[0]
        more = f" ({len(mismatched)} tensors differ)" if len(mismatched) > 1 else ""
        raise CheckpointError(
            f"{key}={init_from!r} holds weights of another shape: {first} is "
            f"{list(state[first].shape)} there but {list(own[first].shape)} in the model{more}; start from "
            f"weights of the same architecture and size (model.* settings such as hidden_size, num_layers, "
            f"and the tokenizer's vocabulary must match those the weights were trained with)")


def load_adapter_weights(model: nn.Module, init_from: str, key: str = "model.init_from") -> None:
    """A LoRA run's weights onto ``model`` (already wrapped by `apply_lora`): an adapter
    export's adapter, or a checkpoint's whole policy (base and adapter)."""
    if not has_adapter(model):
        raise ConfigError(f"{key}={init_from!r} holds LoRA adapter weights, but model.lora.r is not set: set it "
                          f"(and the other model.lora keys) to the values the adapter was trained with")
    path = Path(init_from).expanduser()
    if not path.is_dir():
        load_initial_weights(model, str(path), key)  # the checkpoint's keys are the wrapped policy's
        return
    from peft import set_peft_model_state_dict  # start-up: PEFT loads only for a LoRA run

    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        raise CheckpointError(f"{key}={init_from!r}: {weights.name} is missing beside {ADAPTER_CONFIG}")
    result = set_peft_model_state_dict(model, load_file(str(weights)))
    if result.unexpected_keys:
        raise CheckpointError(f"{key}={init_from!r}: the adapter does not fit the model (model.lora.r, "
                              f"target_modules): unexpected {result.unexpected_keys[:3]}")
