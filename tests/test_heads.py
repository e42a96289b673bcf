"""Drafter kinds (heads/): build, forward, save/load safety, target checks, export formats, drafting trees, and
end-to-end greedy equivalence through the engine, over tiny targets of every architecture."""

from __future__ import annotations

import ast
import copy
import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import ARCHITECTURES, greedy_reference, left_padded_prompts, tiny_model
from foreign_checkpoints import FORMATS as FOREIGN_FORMATS
from foreign_checkpoints import WRITERS
from foreign_checkpoints import target_model as foreign_target
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

import heads
from heads.eagle3 import build_vocab_map
from heads.export import (
    export_dflash,
    export_medusa_vllm,
    export_speculators,
    import_dflash,
    import_medusa_vllm,
    import_speculators,
)
from infer import SelfSpecModel
from infer.drafting import TargetStep
from infer.sampling import SamplingParams

KINDS = ["medusa", "eagle", "eagle3", "dflash"]
ARCHS = list(ARCHITECTURES)
CASES = [(kind, arch) for kind in KINDS for arch in ARCHS]
WIDEN_ARCHS = ["llama", "qwen2", "qwen3", "mistral"]  # Llama-layout layers: EAGLE-3's paper layout
SPECULATORS_ARCHS = ["llama", "qwen2", "mistral"]  # ... of which export to speculators' Llama layer


_TARGETS: dict = {}


def target_for(arch: str):
    if arch not in _TARGETS:
        _TARGETS[arch] = tiny_model(arch)
    return _TARGETS[arch]


def perturb(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Move every float weight off its initial value (zero-initialised blocks, unit norms), so round trips
    compare something."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def features(target, drafter, ids, mask=None):
    out = target(ids, attention_mask=mask, output_hidden_states=True)
    return out, tuple(out.hidden_states[i] for i in drafter.feature_layers)


def run(drafter, target, ids):
    """The drafter's outputs on a prompt (logits for Medusa; (hidden, logits) for EAGLE kinds and for DFlash,
    whose block is anchored at the prompt's last token)."""
    _, feats = features(target, drafter, ids)
    if drafter.kind == "medusa":
        return drafter(feats[0])
    if drafter.kind == "dflash":
        return drafter(drafter.fuse_features(feats)[:, :-1], ids[:, -1:])
    return drafter(ids, drafter.fuse_features(feats))


def assert_same(a, b):
    for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,), strict=True):
        assert torch.equal(x, y)


# ---- registry and build -------------------------------------------------------------------------------------


def test_registry_lists_the_kinds():
    assert list(heads.REGISTRY) == ["medusa", "eagle", "eagle3", "dflash"]
    for name, kind in heads.REGISTRY.items():
        assert kind.name == name == kind.model_cls.kind and kind.model_cls.config_class is kind.config_cls
    assert heads.get_kind("eagle3") is heads.REGISTRY["eagle3"]


def test_register_refuses_duplicates_and_mismatches():
    medusa = heads.REGISTRY["medusa"]
    with pytest.raises(ValueError, match="drafter kind 'medusa' is already registered"):
        heads.register(dataclasses.replace(medusa))
    with pytest.raises(ValueError, match="model_type 'selfspec_medusa' is already registered"):
        heads.register(dataclasses.replace(medusa, name="medusa_again"))

    class OtherConfig(heads.MedusaConfig):
        model_type = "selfspec_other"

    with pytest.raises(ValueError, match="must agree"):
        heads.register(dataclasses.replace(medusa, name="other", config_cls=OtherConfig))
    with pytest.raises(TypeError, match="heads.Kind"):
        heads.register(("medusa", heads.MedusaConfig, heads.MedusaModel))
    assert list(heads.REGISTRY) == ["medusa", "eagle", "eagle3", "dflash"]


def _kind_literals(path) -> list[str]:
    """Places in a Python file where a registered kind's name is a string literal in code: docstrings and
    defaults (a dataclass field's or an argparse `default=`) choose a kind rather than branch on one."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    allowed = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant):
            allowed.add(id(body[0].value))  # docstring
        if isinstance(node, ast.ClassDef):
            allowed.update(id(s.value) for s in node.body if isinstance(s, ast.AnnAssign) and s.value is not None)
        if isinstance(node, ast.keyword) and node.arg == "default":
            allowed.add(id(node.value))
    return [f"{path}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in heads.REGISTRY and id(node) not in allowed]


def test_train_infer_and_scripts_never_name_a_kind():
    """Kinds are registered whole (heads/kinds.py): code outside heads/ looks them up, never branches on one."""
    root = Path(__file__).resolve().parent.parent
    files = [p for folder in ("train", "infer", "scripts") for p in sorted((root / folder).rglob("*.py"))]
    assert len(files) > 10
    assert _kind_literals(root / "tests" / "test_heads.py")  # the check sees literals where there are some
    assert [hit for p in files for hit in _kind_literals(p)] == []


def test_build_rejects_unknown_kind_and_options():
    config = target_for("llama").config
    with pytest.raises(ValueError, match="unknown drafter kind 'hydra'"):
        heads.build("hydra", config)
    with pytest.raises(ValueError, match=r"unknown medusa options \['num_hedas'\]"):
        heads.build("medusa", config, num_hedas=3)
    with pytest.raises(ValueError, match="unknown tree settings"):
        heads.build("eagle", config, tree={"depht": 3})
    with pytest.raises(ValueError, match="lookup_first must be true, false or null"):
        heads.build("eagle3", config, lookup_first="yes")
    with pytest.raises(ValueError, match="deeper than num_heads"):
        heads.build("medusa", config, num_heads=2, tree={"paths": [[0], [0, 0], [0, 0, 0]]})
    with pytest.raises(ValueError, match="feature_layers"):
        heads.build("eagle3", config, feature_layers=[1, 9])
    with pytest.raises(ValueError, match="input_mode='widen' needs a Llama-layout layer"):
        heads.build("eagle3", target_for("gpt2").config, input_mode="widen", layer_style="target")


@pytest.mark.parametrize(("kind", "arch"), CASES)
def test_forward_shapes(kind, arch):
    target = target_for(arch)
    drafter = heads.build(kind, target)
    ids = torch.randint(3, 96, (2, 5))
    out = run(drafter, target, ids)
    L, V, D = target.config.num_hidden_layers, target.config.vocab_size, target.config.hidden_size
    if kind == "medusa":
        assert drafter.feature_layers == (L,)
        assert out.shape == (4, 2, 5, V)
    elif kind == "dflash":  # 4 context slots (keys and values only), then one block of 16: the last token and 15 drafts
        context, logits = out
        assert context.shape == (2, 4, D) and logits.shape == (2, 1, 15, V)
        assert drafter.feature_layers == (1, 2, 3)
    else:
        hidden, logits = out
        assert hidden.shape == (2, 5, D)
        assert logits.shape == (2, 5, V if kind == "eagle" else drafter.config.draft_vocab_size)
        assert drafter.feature_layers == ((L,) if kind == "eagle" else (2, L // 2, L - 3))
    if kind == "eagle3":  # the default Llama layer is always widened; the target's own only where it is Llama-like
        assert drafter.config.input_mode == "widen"
        own = heads.build(kind, target.config, layer_style="target")
        assert own.config.input_mode == ("widen" if arch in WIDEN_ARCHS else "project")


def test_fresh_medusa_head_is_the_lm_head():
    target = target_for("llama")
    for share in (False, True):
        drafter = heads.build("medusa", target, share_lm_head=share)
        hidden = torch.randn(1, 3, 32)
        for logits in drafter(hidden):
            assert torch.allclose(logits, target.lm_head(hidden))


@pytest.mark.parametrize(("kind", "arch"), [(k, a) for k in ("eagle", "eagle3") for a in ARCHS])
def test_cached_forward_matches_one_block(kind, arch):
    """The decoder layer of the target's class, called with our masks, positions and cache, is causal and
    consistent: a prefix then the rest through the cache equals the whole sequence at once."""
    target = target_for(arch)
    drafter = perturb(heads.build(kind, target))
    ids = torch.randint(3, 96, (1, 6))
    _, feats = features(target, drafter, ids)
    h = drafter.fuse_features(feats)
    full_hidden, full_logits = drafter(ids, h)
    cache = DynamicCache()
    drafter(ids[:, :4], h[:, :4], past_key_values=cache)
    tail_hidden, tail_logits = drafter(ids[:, 4:], h[:, 4:], past_key_values=cache)
    torch.testing.assert_close(tail_hidden, full_hidden[:, 4:], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(tail_logits, full_logits[:, 4:], rtol=1e-4, atol=1e-5)


def test_eagle3_training_time_test_unrolls_with_gradients():
    target = target_for("llama")
    drafter = heads.build("eagle3", target).train()
    ids = torch.randint(3, 96, (1, 5))
    _, feats = features(target, drafter, ids)
    cache = DynamicCache()
    hidden, logits = drafter(ids, drafter.fuse_features(feats).detach(), past_key_values=cache)
    # Step 2: feed own outputs; each position sees step 1's prefix and its own step-1 entry.
    t = ids.shape[1]
    allowed = torch.cat([torch.ones(t, t).tril(), torch.eye(t)], dim=1).bool()
    mask = torch.zeros(1, 1, t, 2 * t).masked_fill(~allowed, torch.finfo(torch.float32).min)
    next_ids = drafter.draft_to_target(logits.argmax(-1))
    hidden2, logits2 = drafter(next_ids, hidden, attention_mask=mask, past_key_values=cache,
                               position_ids=torch.arange(1, t + 1)[None])
    assert logits2.shape == logits.shape
    (logits.logsumexp(-1).mean() + logits2.logsumexp(-1).mean()).backward()
    assert drafter.fc.weight.grad is not None and drafter.fc.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match=r"\[B, T, 96\].*\[B, T, 32\]"):
        drafter(ids, torch.zeros(1, 5, 64))


def test_build_vocab_map():
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    d2t, t2d = build_vocab_map(counts, 3)
    assert (torch.arange(3) + d2t).tolist() == [2, 3, 5]  # top-3 by count, ties to the lower id, id order
    assert t2d.tolist() == [False, False, True, True, False, True]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_vocab_map(counts, 7)

    counts = torch.zeros(96, dtype=torch.long)
    counts[[7, 50, 90]] = torch.tensor([3, 2, 1])
    d2t, t2d = build_vocab_map(counts, 3)
    drafter = heads.build("eagle3", target_for("llama"), draft_vocab_size=3)
    drafter.set_vocab_map(d2t, t2d)
    assert drafter.draft_to_target(torch.tensor([0, 1, 2])).tolist() == [7, 50, 90]
    with pytest.raises(ValueError, match="disagree"):
        drafter.set_vocab_map(d2t + 1, t2d)
    with pytest.raises(ValueError, match="shapes"):
        drafter.set_vocab_map(d2t, t2d[:6])


# ---- saving and loading ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "arch"), CASES)
def test_save_load_round_trip_holds_only_drafter_weights(kind, arch, tmp_path):
    target = target_for(arch)
    drafter = perturb(heads.build(kind, target.config)).attach(target)
    drafter.save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["README.md", "config.json", "model.safetensors"]
    saved = load_file(tmp_path / "model.safetensors")
    assert set(saved) == set(drafter.state_dict())
    assert not any(name.endswith(("embed_tokens.weight", "wte.weight", "embed_in.weight")) for name in saved)
    target_tensors = list(target.state_dict().values())
    for name, _ in drafter.named_parameters():  # no target weight (embeddings, lm_head, layers) was written
        tensor = saved[name]
        assert not any(t.shape == tensor.shape and torch.equal(t, tensor) for t in target_tensors), name
    loaded = heads.load(tmp_path).attach(target)
    assert type(loaded) is type(drafter)
    ids = torch.randint(3, 96, (2, 5))
    assert_same(run(loaded, target, ids), run(drafter, target, ids))


def _fake_hub_cache(cache, repo_id: str, folder) -> None:
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    revision = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(folder, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)


@pytest.mark.parametrize("kind", KINDS)
def test_load_from_hub_cache_offline(kind, tmp_path, monkeypatch):
    import huggingface_hub.constants

    target = target_for("llama")
    drafter = perturb(heads.build(kind, target))
    drafter.save_pretrained(tmp_path / "saved")
    _fake_hub_cache(tmp_path / "hub", "someone/tiny-drafter", tmp_path / "saved")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    loaded = heads.load("someone/tiny-drafter", cache_dir=tmp_path / "hub").attach(target)
    ids = torch.randint(3, 96, (1, 4))
    assert_same(run(loaded, target, ids), run(drafter, target, ids))


def test_shipped_drafter_loads_by_name_and_a_local_folder_of_that_name_wins(tmp_path, monkeypatch):
    target = target_for("llama")
    drafter = perturb(heads.build("eagle", target))
    with torch.no_grad():  # the values half precision holds, in fp32
        for p in drafter.parameters():
            p.copy_(p.half().float())
    copy.deepcopy(drafter).half().save_pretrained(tmp_path / "shipped" / "tiny-eagle")  # shipped in half precision
    monkeypatch.setattr(heads, "SHIPPED_DIR", tmp_path / "shipped")
    monkeypatch.chdir(tmp_path)
    assert heads.shipped_drafters() == ["tiny-eagle"]
    ids = torch.randint(3, 96, (1, 4))
    loaded = heads.load("tiny-eagle")
    assert loaded.dtype == torch.float32
    assert_same(run(loaded.attach(target), target, ids), run(drafter, target, ids))
    other = heads.build("eagle", target)
    other.save_pretrained(tmp_path / "tiny-eagle")  # ./tiny-eagle is what the user means
    assert_same(run(heads.load("tiny-eagle").attach(target), target, ids), run(other, target, ids))
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(OSError, match=r"not a shipped drafter \(tiny-eagle\)"):
        heads.load("tiny-eagel")


@pytest.fixture
def saved_eagle(tmp_path):
    drafter = heads.build("eagle", target_for("llama"))
    drafter.save_pretrained(tmp_path)
    return tmp_path


def test_missing_key_is_an_error(saved_eagle):
    tensors = load_file(saved_eagle / "model.safetensors")
    del tensors["fc.weight"]
    save_file(tensors, saved_eagle / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing_keys.*fc.weight"):
        heads.load(saved_eagle)


def test_unexpected_key_is_an_error(saved_eagle):
    tensors = load_file(saved_eagle / "model.safetensors")
    tensors["extra.weight"] = torch.zeros(2)
    save_file(tensors, saved_eagle / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected_keys.*extra.weight"):
        heads.load(saved_eagle)


def test_truncated_safetensors_names_the_file(saved_eagle):
    path = saved_eagle / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match=f"corrupt or truncated safetensors file {path}"):
        heads.load(saved_eagle)
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match="corrupt or truncated"):
        heads.load(saved_eagle)


def test_pickle_only_folder_is_refused(saved_eagle):
    state = load_file(saved_eagle / "model.safetensors")
    os.remove(saved_eagle / "model.safetensors")
    torch.save(state, saved_eagle / "pytorch_model.bin")
    with pytest.raises(ValueError, match="only pickled weights .*pytorch_model.bin"):
        heads.load(saved_eagle)
    with pytest.raises(ValueError, match="safetensors only"):
        heads.EagleModel.from_pretrained(saved_eagle, use_safetensors=False)


def test_load_points_foreign_formats_to_the_importers(tmp_path):
    export_medusa_vllm(heads.build("medusa", target_for("llama")), tmp_path)
    with pytest.raises(ValueError, match="import_medusa_vllm"):
        heads.load(tmp_path)


def test_model_card_is_written(tmp_path):
    target = target_for("llama")
    drafter = heads.build("eagle", target.config, base_model_name_or_path="HuggingFaceTB/SmolLM2-135M",
                          training={"data": "tatsu-lab/alpaca", "steps": 1200},
                          metrics={"mean_accepted_length": 2.7, "speedup": 1.9})
    drafter.save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    for text in ("base_model: HuggingFaceTB/SmolLM2-135M", "- eagle", "EAGLE-1/2 drafter", "datasets:",
                 "tatsu-lab/alpaca", "steps: 1200", "mean_accepted_length: 2.7", "speedup: 1.9"):
        assert text in card
    loaded = heads.load(tmp_path)
    assert loaded.config.metrics == {"mean_accepted_length": 2.7, "speedup": 1.9}


# ---- target checks ----------------------------------------------------------------------------------------------


class FakeTokenizer:
    def __init__(self, vocab: dict[str, int], special=("<s>",)):
        self.vocab, self.all_special_tokens = vocab, list(special)

    def get_vocab(self):
        return dict(self.vocab)


def test_tokenizer_fingerprint():
    a = FakeTokenizer({"a": 0, "b": 1})
    assert heads.tokenizer_fingerprint(a) == heads.tokenizer_fingerprint(FakeTokenizer({"b": 1, "a": 0}))
    assert heads.tokenizer_fingerprint(a) != heads.tokenizer_fingerprint(FakeTokenizer({"a": 1, "b": 0}))
    assert heads.tokenizer_fingerprint(a) != heads.tokenizer_fingerprint(FakeTokenizer({"a": 0, "b": 1}, ["</s>"]))
    assert len(heads.tokenizer_fingerprint(a)) == 16


@pytest.mark.parametrize(("other", "message"), [
    (dict(hidden_size=48), "hidden size: drafter built for 32, target has 48"),
    (dict(vocab_size=128), "vocab size: drafter built for 96, target has 128"),
    (dict(num_hidden_layers=3), "layer count: drafter built for 4, target has 3"),
    (dict(model_type="qwen2"), "model_type: drafter built for 'llama', target has 'qwen2'"),
])
@pytest.mark.parametrize("kind", KINDS)
def test_wrong_target_is_named(kind, other, message):
    drafter = heads.build(kind, target_for("llama").config)
    other = dict(other)
    wrong = tiny_model(other.pop("model_type", "llama"), **other)
    with pytest.raises(ValueError, match=message):
        drafter.check_target(wrong)
    with pytest.raises(ValueError, match=message):
        SelfSpecModel(wrong, drafter)


def test_wrong_tokenizer_is_named():
    target = target_for("llama")
    drafter = heads.build("medusa", target.config, tokenizer=FakeTokenizer({"a": 0}))
    drafter.check_target(target, FakeTokenizer({"a": 0}))
    drafter.check_target(target)  # unknown tokenizer: nothing to compare
    with pytest.raises(ValueError, match="tokenizer fingerprint: drafter trained with"):
        drafter.attach(target, FakeTokenizer({"b": 0}))


def test_target_parts_are_required_until_attached():
    drafter = heads.build("eagle", target_for("llama").config)
    with pytest.raises(RuntimeError, match=r"call drafter.attach\(target\) first"):
        drafter(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, 32))
    assert not any("embed" in name for name in drafter.state_dict())


# ---- export formats ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_two_layer_eagle3_caches_and_stays_exact(arch):
    """`num_layers=2`: the second layer is the target's own layer class with its own slot in the drafter's
    cache: a prefix then the rest through the cache equals one block, and greedy output equals the target's
    (batch 2, left padding), on every architecture (some classes index per-layer settings by layer_idx)."""
    target = target_for(arch)
    drafter = perturb(heads.build("eagle3", target, num_layers=2))
    assert len(drafter.layers) == 2 and type(drafter.layers[1]) is type(drafter.layers[0])
    ids = torch.randint(3, 96, (1, 6))
    _, feats = features(target, drafter, ids)
    h = drafter.fuse_features(feats)
    full_hidden, _ = drafter(ids, h)
    cache = DynamicCache()
    drafter(ids[:, :4], h[:, :4], past_key_values=cache)
    tail_hidden, _ = drafter(ids[:, 4:], h[:, 4:], past_key_values=cache)
    torch.testing.assert_close(tail_hidden, full_hidden[:, 4:], rtol=1e-4, atol=1e-5)
    assert len(cache.layers) == 2

    ids, mask = left_padded_prompts()
    expected = greedy_reference(target, ids, mask, 16)
    got = SelfSpecModel(target, drafter, tree={"depth": 3, "top_k": 3, "total_tokens": 8}).generate(
        ids, attention_mask=mask, max_new_tokens=16, eos_token_id=[])
    assert torch.equal(got, expected)


def test_eagle3_num_layers_must_be_positive():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="num_layers must be an int >= 1"):
            heads.build("eagle3", target_for("llama").config, num_layers=bad)


def test_two_layer_eagle3_exports_to_speculators_and_back(tmp_path):
    """vLLM's EAGLE-3 model reads `num_hidden_layers` layers, the first over [embedding, feature] (2D inputs),
    the rest plain layers over the hidden state: the reimport drafts the same."""
    target = target_for("llama")
    drafter = perturb(heads.build("eagle3", target, num_layers=2, feature_layers=[1, 2, 3]))
    drafter.config.lookup_first = True  # what calibration measured travels in the selfspec block
    export_speculators(drafter, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["transformer_layer_config"]["num_hidden_layers"] == 2
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes["layers.0.self_attn.q_proj.weight"][1] == 64 and shapes["layers.1.self_attn.q_proj.weight"][1] == 32
    assert "layers.1.hidden_norm.weight" not in shapes and "layers.1.mlp.down_proj.weight" in shapes
    reimported = import_speculators(tmp_path)
    assert reimported.config.num_layers == 2 and reimported.config.lookup_first is True
    ids = torch.randint(3, 96, (2, 5))
    hidden, logits = run(reimported.attach(target), target, ids)
    ref_hidden, ref_logits = run(drafter.attach(target), target, ids)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden, ref_hidden, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", SPECULATORS_ARCHS)
def test_speculators_export_keys_shapes_and_reimport(arch, tmp_path):
    target = target_for(arch)
    # Qwen2's own layer: q/k/v biases; layers out of order, which vLLM captures ascending
    drafter = perturb(heads.build("eagle3", target, layer_style="target", feature_layers=[3, 1, 2]))
    export_speculators(drafter, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["architectures"] == ["Eagle3Speculator"]
    assert config["draft_vocab_size"] == 96 and config["norm_before_residual"] is False
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["vocab_size"] == 96
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["proposal_type"] == "greedy"
    assert spec["proposal_methods"][0]["speculative_tokens"] == 6
    assert spec["verifier"]["architectures"] == [type(target).__name__]
    d, heads_, kv_heads = 32, 4, 2
    hd = layer["head_dim"]
    expected = {
        "fc.weight": (d, 3 * d),
        "layers.0.self_attn.q_proj.weight": (heads_ * hd, 2 * d),
        "layers.0.self_attn.k_proj.weight": (kv_heads * hd, 2 * d),
        "layers.0.self_attn.v_proj.weight": (kv_heads * hd, 2 * d),
        "layers.0.self_attn.o_proj.weight": (d, heads_ * hd),
        "layers.0.mlp.gate_proj.weight": (64, d), "layers.0.mlp.up_proj.weight": (64, d),
        "layers.0.mlp.down_proj.weight": (d, 64),
        "layers.0.input_layernorm.weight": (d,), "layers.0.hidden_norm.weight": (d,),
        "layers.0.post_attention_layernorm.weight": (d,),
        "norm.weight": (d,), "lm_head.weight": (96, d), "d2t": (96,), "t2d": (96,),
    }
    if arch == "qwen2":  # q/k/v biases; Llama's attention_bias also needs o's (written as zeros)
        expected.update({"layers.0.self_attn.q_proj.bias": (heads_ * hd,),
                         "layers.0.self_attn.k_proj.bias": (kv_heads * hd,),
                         "layers.0.self_attn.v_proj.bias": (kv_heads * hd,),
                         "layers.0.self_attn.o_proj.bias": (d,)})
    assert layer["attention_bias"] is (arch == "qwen2")
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        assert f.get_slice("d2t").get_dtype() == "I64" and f.get_slice("t2d").get_dtype() == "BOOL"
    assert shapes == expected
    reimported = import_speculators(tmp_path).attach(target)
    ids = torch.randint(3, 96, (2, 5))
    hidden, logits = run(reimported, target, ids)
    ref_hidden, ref_logits = run(drafter.attach(target), target, ids)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden, ref_hidden, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("arch", "message"), [("qwen3", "q_norm"), ("gpt2", "no 'project' input mode"),
                                               ("gemma2", "no 'project' input mode")])
def test_speculators_export_refuses_other_layouts(arch, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        export_speculators(heads.build("eagle3", target_for(arch).config, layer_style="target"), tmp_path)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_dflash_export_keys_shapes_and_reimport(arch, tmp_path):
    """vLLM's DFlashDraftModel layout: Qwen3 layers at the target's sizes, fc blocks in ascending layer order
    (ours are given out of order here), the mask vector in mask_embedding.pt; the reimport drafts the same."""
    target = target_for(arch)
    drafter = perturb(heads.build("dflash", target, block_size=4, num_layers=2, feature_layers=[3, 1, 2]))
    export_dflash(drafter, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["num_hidden_layers"] == 2 and config["block_size"] == 4 and config["num_target_layers"] == 4
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert config["dflash_config"] == {"mask_token_id": drafter.config.mask_token_id, "target_layer_ids": [0, 1, 2]}
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"]
    d, hd = 32, config["head_dim"]
    layer = {"self_attn.q_proj.weight": (4 * hd, d), "self_attn.k_proj.weight": (config["num_key_value_heads"] * hd, d),
             "self_attn.v_proj.weight": (config["num_key_value_heads"] * hd, d), "self_attn.o_proj.weight": (d, 4 * hd),
             "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
             "mlp.gate_proj.weight": (config["intermediate_size"], d), "mlp.up_proj.weight": (config["intermediate_size"], d),
             "mlp.down_proj.weight": (d, config["intermediate_size"]),
             "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,)}
    expected = {"fc.weight": (d, 3 * d), "hidden_norm.weight": (d,), "norm.weight": (d,),
                **{f"layers.{i}.{k}": v for i in range(2) for k, v in layer.items()}}
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()} == expected
        fc = f.get_tensor("fc.weight")
    assert torch.equal(fc[:, :d], drafter.fc.weight[:, d:2 * d])  # layer 1's block comes first
    mask = torch.load(tmp_path / "mask_embedding.pt", weights_only=True)
    assert mask["mask_token_id"] == config["dflash_config"]["mask_token_id"]
    assert torch.equal(mask["embedding"], drafter.mask_embed.weight[0])
    reimported = import_dflash(tmp_path).attach(target)
    assert reimported.feature_layers == (3, 1, 2)
    ids = torch.randint(3, 96, (2, 5))
    torch.testing.assert_close(run(reimported, target, ids)[1], run(drafter.attach(target), target, ids)[1])


def test_dflash_export_refuses_what_vllm_cannot_serve(tmp_path):
    config = target_for("llama").config
    with pytest.raises(ValueError, match=r"feature layers \[4\] cannot be served"):
        export_dflash(heads.build("dflash", config, feature_layers=[1, 4]), tmp_path)
    with pytest.raises(ValueError, match="fc has no bias"):
        export_dflash(heads.build("dflash", config, fc_bias=True), tmp_path)
    with pytest.raises(ValueError, match="mask_token_id must be a token id"):
        export_dflash(heads.build("dflash", config), tmp_path, mask_token_id=96)


@pytest.mark.parametrize("share", [False, True])
def test_medusa_vllm_export_keys_shapes_and_reimport(share, tmp_path):
    target = target_for("llama")
    drafter = perturb(heads.build("medusa", target, share_lm_head=share, num_heads=3, num_layers=2))
    export_medusa_vllm(drafter, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert {k: config[k] for k in ("model_type", "num_heads", "num_hidden_layers", "hidden_size", "vocab_size",
                                   "truncated_vocab_size", "medusa_fc_bias", "original_lm_head")} == {
        "model_type": "medusa", "num_heads": 3, "num_hidden_layers": 2, "hidden_size": 32, "vocab_size": 96,
        "truncated_vocab_size": 96, "medusa_fc_bias": True, "original_lm_head": share}
    expected = {f"blocks.{i}.layers.{j}.{p}": (32, 32) if p == "weight" else (32,)
                for i in range(3) for j in range(2) for p in ("weight", "bias")}
    expected.update({f"lm_heads.{i}.weight": (96, 32) for i in range(1 if share else 3)})
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()} == expected
    reimported = import_medusa_vllm(tmp_path).attach(target)
    hidden = torch.randn(2, 3, 32)
    assert torch.equal(reimported(hidden), drafter(hidden))


# ---- drafting adapters -------------------------------------------------------------------------------------------


def prefill_step(target, drafter, ids, mask) -> TargetStep:
    out, feats = features(target, drafter, ids, mask)
    valid = mask.bool()
    return TargetStep(tokens=ids, valid=valid, hidden=feats,
                      next_tokens=out.logits[:, -1].argmax(-1))


def check_tree(tree, budget, max_depth, max_nodes):
    depth, _ = tree.depth_and_ancestors()
    b, n = tree.tokens.shape
    assert n <= max_nodes
    assert (tree.parents[:, 0] == -1).all()
    idx = torch.arange(n)
    assert (tree.parents[:, 1:] < idx[1:]).all() and (tree.parents[:, 1:] >= 0).all()  # parents first
    assert (depth[tree.valid] <= max_depth).all()
    assert (depth <= budget[:, None]).logical_or(~tree.valid).all()
    for row in range(b):
        siblings = {}
        for i in range(1, n):
            if tree.valid[row, i]:
                key = int(tree.parents[row, i])
                siblings.setdefault(key, []).append(int(tree.tokens[row, i]))
        for toks in siblings.values():
            assert len(toks) == len(set(toks)), "sibling drafts must be distinct"
    assert tree.q is None
    assert ((tree.tokens >= 0) & (tree.tokens < 96)).all()


TREE_CASES = [
    ("medusa", "llama", {}, 4, 41),
    ("medusa", "gpt2", {"paths": [[0], [1], [0, 0], [0, 1], [0, 0, 0]]}, 3, 6),
    ("eagle", "llama", {}, 6, 49),
    ("eagle", "gemma3_text", {"top_k": 3, "depth": 4, "total_tokens": 7}, 4, 8),
    ("eagle", "gpt_neox", {"mode": "static"}, 6, 31),
    ("eagle3", "qwen2", {}, 6, 49),
    ("eagle3", "phi3", {"mode": "static", "paths": [[0], [1], [0, 0], [1, 0], [0, 0, 0]]}, 3, 6),
    ("dflash", "llama", {"depth": 8}, 8, 9),  # a chain
    ("dflash", "gemma2", {"top_k": 3, "depth": 5, "total_tokens": 10}, 5, 11),
    ("dflash", "gpt2", {"top_k": 2, "depth": 4}, 4, 15),
]


@pytest.mark.parametrize(("kind", "arch", "tree", "max_depth", "max_nodes"), TREE_CASES)
def test_propose_builds_valid_trees(kind, arch, tree, max_depth, max_nodes):
    target = target_for(arch)
    drafter = heads.build(kind, target).as_drafter(**tree)
    ids = torch.randint(3, 96, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    drafter.bind(target, SamplingParams(), batch_size=2)
    drafter.observe(prefill_step(target, drafter, ids, mask))
    size = drafter.kv.size if kind != "medusa" else None
    for budget in (torch.tensor([10, 10]), torch.tensor([2, 1]), torch.tensor([0, 0])):
        tree_ = drafter.propose(budget)
        check_tree(tree_, budget, max_depth, max_nodes)
        assert torch.equal(tree_.tokens[:, 0], drafter.root)
        if kind != "medusa":
            assert drafter.kv.size == size  # drafted slots rolled back
    if tree.get("mode", "dynamic") == "dynamic" and kind != "medusa":
        full = drafter.propose(torch.tensor([10, 10]))
        assert full.num_nodes == 1 + min(drafter.tree["total_tokens"],
                                         drafter.tree["top_k"] + (max_depth - 1) * drafter.tree["top_k"] ** 2)


# ---- end to end through the engine ------------------------------------------------------------------------------


E2E_CASES = CASES + [("eagle", "llama", {"mode": "static"}), ("eagle3", "gemma2", {"mode": "static"}),
                     ("dflash", "gpt2", {"top_k": 3}), ("dflash", "qwen3", {"top_k": 2, "total_tokens": 8})]


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("case", E2E_CASES, ids=lambda c: "-".join(map(str, c[:2])) + "".join(
    f"-{k}={v}" for k, v in (c[2] if len(c) > 2 else {}).items()))
def test_speculative_greedy_equals_target_generate(case, batch):
    kind, arch = case[:2]
    tree = case[2] if len(case) > 2 else {}
    target = target_for(arch)
    ids, mask = left_padded_prompts(batch)
    expected = greedy_reference(target, ids, mask, 20)
    drafter = heads.build(kind, target.config, tree=tree)
    got = SelfSpecModel(target, drafter).generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=[])
    assert torch.equal(got, expected)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("fmt", FOREIGN_FORMATS)
def test_imported_drafter_greedy_equals_target_generate(fmt, batch, tmp_path):
    """A drafter published in another project's format (heads/formats/), as heads.load imports it."""
    target = foreign_target()
    WRITERS[fmt](tmp_path, target)
    ids, mask = left_padded_prompts(batch)
    expected = greedy_reference(target, ids, mask, 20)
    got = SelfSpecModel(target, heads.load(tmp_path, target=target)).generate(ids, attention_mask=mask,
                                                                             max_new_tokens=20, eos_token_id=[])
    assert torch.equal(got, expected)


@pytest.mark.parametrize("kind", KINDS)
def test_lookup_first_with_a_trained_kind_stays_exact(kind):
    """Rows switch between prompt-lookup chains and the drafter's tree from step to step."""
    target = target_for("llama")
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]])
    expected = target.generate(ids, do_sample=False, max_new_tokens=24, eos_token_id=None, pad_token_id=0)
    model = SelfSpecModel(target, heads.build(kind, target.config), lookup_first=True)
    assert torch.equal(model.generate(ids, max_new_tokens=24, eos_token_id=[]), expected)


def test_adapter_with_tree_overrides_and_a_bf16_target():
    """A float32 drafter serves a bfloat16 target (inputs are cast at the boundary, the drafter is not
    converted), and `as_drafter(**overrides)` goes straight to the engine."""
    target = tiny_model("qwen2").to(torch.bfloat16)
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(2))
    expected = target.generate(ids, do_sample=False, max_new_tokens=16, eos_token_id=None, pad_token_id=0)
    for kind, overrides in (("eagle", {"top_k": 2, "depth": 3, "total_tokens": 5}),
                            ("eagle3", {"mode": "static", "paths": [[0], [0, 0]]}),
                            ("medusa", {"paths": [[0], [1], [0, 0]]})):
        drafter = heads.build(kind, target)
        got = SelfSpecModel(target, drafter.as_drafter(**overrides)).generate(ids, max_new_tokens=16,
                                                                               eos_token_id=[])
        assert torch.equal(got, expected)
        assert drafter.dtype == torch.float32


def test_sampling_with_a_drafter_runs():
    target = target_for("llama")
    ids = torch.randint(3, 96, (2, 5), generator=torch.Generator().manual_seed(3))
    got = SelfSpecModel(target, heads.build("eagle", target)).generate(
        ids, max_new_tokens=10, do_sample=True, temperature=0.8, top_k=20, eos_token_id=[],
        generator=torch.Generator().manual_seed(0))
    assert got.shape == (2, 15) and ((got >= 0) & (got < 96)).all()


def test_hub_push_checks_the_folder_before_any_network(tmp_path):
    from heads.hub import push

    heads.build("medusa", target_for("llama")).save_pretrained(tmp_path)
    os.remove(tmp_path / "README.md")
    with pytest.raises(ValueError, match=r"missing \['README.md'\]"):
        push(tmp_path, "someone/drafter")
