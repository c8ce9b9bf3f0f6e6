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
