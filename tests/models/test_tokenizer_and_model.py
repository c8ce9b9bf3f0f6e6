import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.data.arithmetic import ALPHABET
from posttrain.models.tiny import build_char_tokenizer, build_tiny_model


def test_char_tokenizer_round_trip():
    tok = build_char_tokenizer(ALPHABET)
    text = "7+5=12,4+8+1=13,3+1+1=5>532"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == text
    assert len(tok) == len(ALPHABET) + 3
    assert tok.pad_token_id == 0 and tok.eos_token_id == 1
    assert tok.decode(tok("9x9", add_special_tokens=False)["input_ids"]) == "9<unk>9"


def test_save_pretrained_reloads_with_auto_classes(tmp_path):
    tok = build_char_tokenizer(ALPHABET)
    model = build_tiny_model(len(tok), num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=2)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    tok2 = AutoTokenizer.from_pretrained(tmp_path)
    model2 = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = tok2("12+34=", return_tensors="pt", add_special_tokens=False)
    assert ids["input_ids"].tolist() == tok("12+34=", return_tensors="pt", add_special_tokens=False)["input_ids"].tolist()
    with torch.no_grad():
        assert torch.allclose(model(**ids).logits, model2(**ids).logits)
        out = model2.generate(**ids, max_new_tokens=4, do_sample=False, pad_token_id=tok2.pad_token_id)
    assert out.shape[1] <= ids["input_ids"].shape[1] + 4
    assert isinstance(tok2.decode(out[0], skip_special_tokens=True), str)


def test_tiny_model_size_is_configurable():
    small = build_tiny_model(17, hidden_size=32, num_layers=1, intermediate_size=64, num_heads=2, num_kv_heads=2)
    big = build_tiny_model(17, hidden_size=64, num_layers=2, intermediate_size=128, num_heads=2, num_kv_heads=2)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(big) > 3 * count(small)
    llama = build_tiny_model(17, architecture="llama", hidden_size=32, num_layers=1, intermediate_size=64,
                             num_heads=2, num_kv_heads=1, tie_word_embeddings=False)
    assert llama.config.model_type == "llama" and llama.config.num_key_value_heads == 1


# ---------------------------------------------------------------- dropout is off in every forward


def _model_cfg(name_or_path=None, dtype="float32"):
    from omegaconf import OmegaConf

    return OmegaConf.create({
        "name_or_path": name_or_path, "init_from": None, "architecture": "qwen2", "hidden_size": 32,
        "num_layers": 1, "num_heads": 2, "num_kv_heads": 2, "intermediate_size": 64,
        "max_position_embeddings": 64, "tie_word_embeddings": True, "dtype": dtype,
    })


def _two_train_forwards(model, ids):
    model.train()
    try:
        return model(ids).logits, model(ids).logits
    finally:
        model.eval()


def test_loaded_model_with_attention_dropout_is_deterministic_in_train_mode(tmp_path):
    """The sampler runs in eval mode; training forwards must score the same policy, so the
    loader turns dropout off (HF attention applies config.attention_dropout in train())."""
    from posttrain.models.loading import load_tokenizer_and_model

    tok = build_char_tokenizer(ALPHABET)
    model = build_tiny_model(len(tok), num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=2)
    model.config.attention_dropout = 0.5
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    ids = tok("12+34=46", return_tensors="pt", add_special_tokens=False)["input_ids"]

    raw = AutoModelForCausalLM.from_pretrained(tmp_path)
    torch.manual_seed(0)
    first, second = _two_train_forwards(raw, ids)
    assert not torch.equal(first, second), "test needs dropout to be active without the fix"

    _, loaded = load_tokenizer_and_model(_model_cfg(str(tmp_path)), ALPHABET)
    first, second = _two_train_forwards(loaded, ids)
    assert torch.equal(first, second)
    assert loaded.config.attention_dropout == 0.0
    with torch.no_grad():
        torch.testing.assert_close(first, loaded(ids).logits)  # train() == eval()


def test_disable_dropout_covers_modules_attributes_and_config():
    from transformers import GPT2Config, GPT2LMHeadModel

    from posttrain.models.loading import disable_dropout

    config = GPT2Config(vocab_size=20, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                        resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3, summary_first_dropout=0.3)
    model = GPT2LMHeadModel(config)
    assert any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
    assert disable_dropout(model) is model
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    for field in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_first_dropout"):
        assert getattr(model.config, field) == 0.0, field
    ids = torch.randint(0, 20, (2, 8))
    first, second = _two_train_forwards(model, ids)
    assert torch.equal(first, second)


def test_tiny_model_from_the_loader_has_no_dropout():
    from posttrain.models.loading import load_tokenizer_and_model

    _, model = load_tokenizer_and_model(_model_cfg(), ALPHABET)
    assert model.config.attention_dropout == 0.0
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
