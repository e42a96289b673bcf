"""Drafters published in other projects' formats (heads/formats/): each tiny checkpoint, written as its project
writes it, loads through heads.load and SelfSpecModel.from_pretrained, keeps greedy output identical to the
target's, and drafts first what that project's math gives, computed here from the math alone; checkpoints that
do not fit the target, or whose format is unknown, are refused by name before any generation."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from foreign_checkpoints import (
    FORMATS,
    PUBLISHED,
    WRITERS,
    target_model,
    write_dflash_zlab,
    write_eagle1_authors,
    write_eagle_authors,
    write_medusa_fd,
    write_specforge,
    write_speculators,
    write_speculators_defaults,
)
from safetensors.torch import save_file

import heads
from infer import SelfSpecModel
from infer.drafting import TargetStep
from infer.sampling import SamplingParams

_TARGET = {}


def target():
    if "t" not in _TARGET:
        _TARGET["t"] = target_model()
    return _TARGET["t"]


PROMPT = torch.tensor([[5, 17, 42, 8, 66, 23, 9, 71, 30]])

# ---- the reference math, written from each project's description of its model ---------------------------------


def rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate(x, positions, theta):
    """Rotary embedding of x [H, T, hd] at integer positions [T]: pairs (i, i + hd/2) rotated by pos * theta^(-2i/hd)."""
    half = x.shape[-1] // 2
    angle = positions[:, None].double() * theta ** (-torch.arange(half).double() * 2 / x.shape[-1])
    cos, sin = angle.cos().float(), angle.sin().float()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attend(q, k, v, allowed):
    """Softmax attention, q [H, Tq, hd], k/v [KV, Tk, hd] shared by H/KV query heads each; allowed [Tq, Tk]."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores = (q @ k.transpose(1, 2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).reshape(q.shape[1], -1)  # [Tq, H*hd]


def swiglu(x, w, p):
    return F.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T) @ w[p + "mlp.down_proj.weight"].T


def target_pass(t, ids):
    with torch.no_grad():
        out = t(ids, output_hidden_states=True)
    return out, out.logits[0, -1].argmax()


def eagle3_layer(t, ckpt, tokens, hidden):
    """EAGLE-3's layer over every position at once (positions 0..T-1, causal): [input_layernorm(embedding of
    tokens[i]), hidden_norm(hidden[i])] into attention with RoPE (residual: hidden, or its norm with
    norm_before_residual; keys fewer than `window` positions back, for a sliding-window layer), then the MLP.
    Returns (output hidden [T, D], logits over the draft vocabulary [T, Vd] = lm_head(norm(output)))."""
    w = {key: v.float() for key, v in ckpt["weights"].items()}
    p, eps, cfg = ckpt["prefix"], ckpt["eps"], t.config
    with torch.no_grad():
        emb = t.get_input_embeddings()(tokens)
    normed = rms(hidden, w[ckpt["hidden_norm"]], eps)
    x = torch.cat([rms(emb, w[p + "input_layernorm.weight"], eps), normed], dim=-1)
    residual = normed if ckpt["norm_before_residual"] else hidden
    n, hd = len(tokens), cfg.hidden_size // cfg.num_attention_heads
    pos = torch.arange(n)
    q = (x @ w[p + "self_attn.q_proj.weight"].T).view(n, -1, hd).transpose(0, 1)
    kk = (x @ w[p + "self_attn.k_proj.weight"].T).view(n, -1, hd).transpose(0, 1)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, -1, hd).transpose(0, 1)
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    if ckpt.get("window"):
        allowed &= pos[:, None] - pos[None, :] < ckpt["window"]
    a = attend(rotate(q, pos, ckpt["rope_theta"]), rotate(kk, pos, ckpt["rope_theta"]), v, allowed)
    h = residual + a @ w[p + "self_attn.o_proj.weight"].T
    h = h + swiglu(rms(h, w[p + "post_attention_layernorm.weight"], eps), w, p)
    return h, rms(h, w["norm.weight"], eps) @ w["lm_head.weight"].T


def eagle3_chain(t, ids, ckpt, steps: int):
    """EAGLE-3 drafting a greedy chain of `steps` tokens after the prompt: the target features at the checkpoint's
    layers in ascending order (as vLLM and SGLang capture and concatenate them; through input_norm with
    norm_before_fc) through fc, then the layer; each draft (mapped to a target id by d2t) goes in at the next
    position with the last output hidden state (its final norm with norm_output), everything recomputed.
    Returns (the drafted target ids, the step-0 draft logits at the last prompt position)."""
    w = {key: v.float() for key, v in ckpt["weights"].items()}
    out, root = target_pass(t, ids)
    feats = torch.cat([out.hidden_states[i][0] for i in sorted(ckpt["layers"])], dim=-1)
    if ckpt.get("norm_before_fc"):
        feats = rms(feats, w["input_norm.weight"], ckpt["eps"])
    hidden, tokens = feats @ w["fc.weight"].T, torch.cat([ids[0, 1:], root[None]])
    d2t = ckpt["weights"].get("d2t", torch.zeros(w["lm_head.weight"].shape[0], dtype=torch.long))
    chain, first = [], None
    for _ in range(steps):
        h, logits = eagle3_layer(t, ckpt, tokens, hidden)
        first = logits[-1] if first is None else first
        draft = int(logits[-1].argmax())
        chain.append(draft + int(d2t[draft]))
        fed = rms(h[-1], w["norm.weight"], ckpt["eps"]) if ckpt.get("norm_output") else h[-1]
        tokens, hidden = torch.cat([tokens, torch.tensor([chain[-1]])]), torch.cat([hidden, fed[None]])
    return chain, first


def eagle3_reference(t, ids, ckpt, k: int):
    """EAGLE-3's first draft step (`eagle3_chain`'s): its top-k mapped to target ids by d2t, and the draft logits."""
    _, logits = eagle3_chain(t, ids, ckpt, steps=1)
    top = logits.topk(k).indices
    d2t = ckpt["weights"].get("d2t", torch.zeros(logits.shape[0], dtype=torch.long))
    return top + d2t[top], logits


def eagle1_chain(t, ids, ckpt, steps: int) -> list[int]:
    """EAGLE-1/2 as the EAGLE authors' code computes it (cnets1.py): the target's last hidden state (after its final
    norm) and the embedding of the next token through fc (with its bias), the layer without an input norm (causal
    attention with RoPE, q/k/v biases where the config has qkv_bias), then the MLP; the target's lm_head on the
    output, no norm. Each greedy draft goes in at the next position with the output hidden state that drafted it,
    everything recomputed. Returns the drafted token ids."""
    w = {key: v.float() for key, v in ckpt["weights"].items()}
    p, cfg = "layers.0.self_attn.", ckpt["config"]
    out, root = target_pass(t, ids)
    hidden, tokens = out.hidden_states[-1][0], torch.cat([ids[0, 1:], root[None]])
    hd = cfg["hidden_size"] // cfg["num_attention_heads"]
    chain = []
    for _ in range(steps):
        with torch.no_grad():
            emb = t.get_input_embeddings()(tokens)
        x = torch.cat([emb, hidden], dim=-1) @ w["fc.weight"].T + w.get("fc.bias", 0)
        n, pos = len(tokens), torch.arange(len(tokens))
        q, k, v = ((x @ w[p + f"{name}_proj.weight"].T + w.get(p + f"{name}_proj.bias", 0)).view(n, -1, hd)
                   .transpose(0, 1) for name in "qkv")
        theta = ckpt["rope_theta"]
        a = attend(rotate(q, pos, theta), rotate(k, pos, theta), v, torch.ones(n, n, dtype=torch.bool).tril())
        h = x + a @ w[p + "o_proj.weight"].T
        h = h + swiglu(rms(h, w["layers.0.post_attention_layernorm.weight"], ckpt["eps"]), w, "layers.0.")
        chain.append(int((h[-1] @ t.get_output_embeddings().weight.detach().T).argmax()))
        tokens, hidden = torch.cat([tokens, torch.tensor(chain[-1:])]), torch.cat([hidden, h[-1:]])
    return chain


def medusa_reference(t, ids, ckpt, k: int):
    """Medusa head i on the target's last hidden state: x + SiLU(W x + b) per block, then its own lm_head.
    Returns the top-k token ids per head, [K, k]."""
    w = {key: v.float() for key, v in ckpt["weights"].items()}
    out, _ = target_pass(t, ids)
    h = out.hidden_states[-1][0, -1]
    tops = []
    for i in range(ckpt["config"]["medusa_num_heads"]):
        x = h
        for j in range(ckpt["num_layers"]):
            x = x + F.silu(x @ w[f"{i}.{j}.linear.weight"].T + w[f"{i}.{j}.linear.bias"])
        tops.append((x @ w[f"{i}.{ckpt['num_layers']}.weight"].T).topk(k).indices)
    return torch.stack(tops)


def dflash_reference(t, ids, ckpt):
    """DFlash's block: context = hidden_norm(fc(target hidden_states[id + 1] for id in target_layer_ids)); the block
    [embedding of the root, embedding of mask_token_id, ...] attends, not causally, to the whole context and itself;
    queries from the input-normed block (q_norm), keys/values from the context (no input norm; k_norm) and the
    block, RoPE at each slot's position; mask slots read through norm and the target's lm_head. Returns the argmax
    of each mask slot."""
    w = {key: v.float() for key, v in ckpt["weights"].items()}
    cfg = ckpt["config"]
    eps, theta, hd = cfg["rms_norm_eps"], cfg["rope_parameters"]["rope_theta"], cfg["head_dim"]
    out, root = target_pass(t, ids)
    ctx_ids = cfg["dflash_config"]["target_layer_ids"]
    ctx = rms(torch.cat([out.hidden_states[i + 1][0] for i in ctx_ids], -1) @ w["fc.weight"].T,
              w["hidden_norm.weight"], eps)
    size, c = cfg["block_size"], ctx.shape[0]
    with torch.no_grad():
        block = t.get_input_embeddings()(torch.tensor([int(root)] + [cfg["dflash_config"]["mask_token_id"]] * (size - 1)))
    ctx_pos, block_pos = torch.arange(c), torch.arange(c, c + size)
    for n in range(cfg["num_hidden_layers"]):
        p = f"layers.{n}.self_attn."
        x = rms(block, w[f"layers.{n}.input_layernorm.weight"], eps)
        q = rms((x @ w[p + "q_proj.weight"].T).view(size, -1, hd), w[p + "q_norm.weight"], eps).transpose(0, 1)
        kv_in = torch.cat([ctx, x])
        k = rms((kv_in @ w[p + "k_proj.weight"].T).view(c + size, -1, hd), w[p + "k_norm.weight"], eps).transpose(0, 1)
        v = (kv_in @ w[p + "v_proj.weight"].T).view(c + size, -1, hd).transpose(0, 1)
        positions = torch.cat([ctx_pos, block_pos])
        a = attend(rotate(q, block_pos, theta), rotate(k, positions, theta), v,
                   torch.ones(size, c + size, dtype=torch.bool))
        block = block + a @ w[p + "o_proj.weight"].T
        block = block + swiglu(rms(block, w[f"layers.{n}.post_attention_layernorm.weight"], eps), w, f"layers.{n}.")
    logits = rms(block[1:], w["norm.weight"], eps) @ t.get_output_embeddings().weight.detach().T
    return logits.argmax(-1)


# ---- loading, exactness, first proposals ------------------------------------------------------------------------


def first_tree(drafter_model, t, ids, **tree):
    drafter = drafter_model.as_drafter(**tree)
    drafter.bind(t, SamplingParams(), batch_size=1)
    out, root = target_pass(t, ids)
    drafter.observe(TargetStep(tokens=ids, valid=torch.ones_like(ids, dtype=torch.bool),
                               hidden=tuple(out.hidden_states[i] for i in drafter.feature_layers),
                               next_tokens=root[None]))
    with torch.no_grad():
        return drafter, drafter.propose(torch.tensor([16]))


def children_of_root(tree) -> list[int]:
    return sorted(int(tok) for tok, par, ok in zip(tree.tokens[0], tree.parents[0], tree.valid[0], strict=True)
                  if ok and par == 0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_import_loads_the_right_kind_and_stays_exact(fmt, tmp_path):
    t = target()
    WRITERS[fmt](tmp_path, t)
    assert heads.imported_format(tmp_path).name == fmt
    model = heads.load(tmp_path, target=t)
    (kind,) = [k.name for k in heads.REGISTRY.values() if fmt in k.imports]  # the registry says what it loads as
    assert model.kind == kind
    assert model.dtype == torch.float32
    expected = t.generate(PROMPT, do_sample=False, max_new_tokens=24, eos_token_id=None, pad_token_id=0)
    spec = SelfSpecModel.from_pretrained(str(tmp_path), target=t)
    assert torch.equal(spec.generate(PROMPT, max_new_tokens=24, eos_token_id=[]), expected)


@pytest.mark.parametrize("fmt", ["eagle_authors", "specforge", "speculators"])
def test_eagle3_first_proposals_match_the_reference(fmt, tmp_path):
    t = target()
    ckpt = WRITERS[fmt](tmp_path, t)
    model = heads.load(tmp_path, target=t)
    expected_ids, expected_logits = eagle3_reference(t, PROMPT, ckpt, k=4)
    _, tree = first_tree(model, t, PROMPT, top_k=4, depth=1, total_tokens=4)
    assert children_of_root(tree) == sorted(expected_ids.tolist())
    # the drafter's own logits for that step, to the reference's precision
    out, root = target_pass(t, PROMPT)
    feats = model.fuse_features(tuple(out.hidden_states[i] for i in model.feature_layers))
    with torch.no_grad():
        _, logits = model(torch.cat([PROMPT[:, 1:], root.view(1, 1)], dim=1), feats, fused=True)
    torch.testing.assert_close(logits[0, -1], expected_logits, atol=2e-4, rtol=2e-4)


def test_specforge_config_with_pickled_weights_is_specforge(tmp_path):
    """Its capture layers are SpecForge's own key: with pytorch_model.bin it is still read as SpecForge's."""
    from safetensors.torch import load_file

    t = target()
    ckpt = write_specforge(tmp_path, t)
    torch.save(load_file(tmp_path / "model.safetensors"), tmp_path / "pytorch_model.bin")
    (tmp_path / "model.safetensors").unlink()
    assert heads.imported_format(tmp_path).name == "specforge"
    expected_ids, _ = eagle3_reference(t, PROMPT, ckpt, k=4)
    model = heads.load(tmp_path, target=t)
    assert children_of_root(first_tree(model, t, PROMPT, top_k=4, depth=1, total_tokens=4)[1]) == \
        sorted(expected_ids.tolist())


def test_eagle_authors_full_draft_vocabulary_ignores_the_map(tmp_path):
    """Their code drafts target ids directly when the draft vocabulary is the whole vocabulary, whatever d2t holds."""
    t = target()
    ckpt = write_eagle_authors(tmp_path, t, draft_vocab=t.config.vocab_size)
    weights = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    vocab = t.config.vocab_size
    weights["d2t"] = torch.randperm(vocab, generator=torch.Generator().manual_seed(0)) - torch.arange(vocab)
    torch.save(weights, tmp_path / "pytorch_model.bin")  # a map their code never reads
    model = heads.load(tmp_path, target=t)
    assert int(model.d2t.abs().sum()) == 0 and bool(model.t2d.all())
    ckpt["weights"]["d2t"] = torch.zeros_like(ckpt["weights"]["d2t"])
    expected_ids, _ = eagle3_reference(t, PROMPT, ckpt, k=4)
    assert children_of_root(first_tree(model, t, PROMPT, top_k=4, depth=1, total_tokens=4)[1]) == \
        sorted(expected_ids.tolist())


@pytest.mark.parametrize("pt,num_layers", [(False, 1), (True, 2)], ids=["safetensors", "pt-two-blocks"])
def test_medusa_first_proposals_match_the_reference(pt, num_layers, tmp_path):
    t = target()
    ckpt = write_medusa_fd(tmp_path, t, num_layers=num_layers, pt=pt)
    model = heads.load(tmp_path, target=t)
    assert model.config.num_layers == num_layers
    top = medusa_reference(t, PROMPT, ckpt, k=3)
    paths = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    drafter, tree = first_tree(model, t, PROMPT, paths=paths)
    for node in range(1, tree.tokens.shape[1]):
        depth, rank = int(drafter.depth[node]), int(drafter.ranks[node])
        assert int(tree.tokens[0, node]) == int(top[depth - 1, rank])


@pytest.mark.parametrize("layer_ids", [(1, 5, 3), None], ids=["named-layers", "default-layers"])
def test_dflash_first_proposals_match_the_reference(layer_ids, tmp_path):
    t = target()
    ckpt = write_dflash_zlab(tmp_path, t, target_layer_ids=layer_ids)
    model = heads.load(tmp_path, target=t)
    if layer_ids is None:  # z-lab's default for a two-layer drafter of an 8-layer target: 1 and L - 3
        assert list(model.feature_layers) == [2, 6]
        ckpt["config"]["dflash_config"]["target_layer_ids"] = [1, 5]
    expected = dflash_reference(t, PROMPT, ckpt)
    _, tree = first_tree(model, t, PROMPT)
    assert tree.tokens[0, 1:].tolist() == expected.tolist()


def test_our_sglang_export_reads_back_as_specforge(tmp_path):
    """heads.export.export_sglang writes SpecForge's layout; reading it back gives the drafter's own outputs."""
    from heads.export import export_sglang

    t = target()
    drafter = heads.build("eagle3", t, layer_style="llama", draft_vocab_size=48, tree={"top_k": 3})
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(5)) * 0.1)
    export_sglang(drafter, tmp_path)
    assert heads.imported_format(tmp_path).name == "specforge"
    back = heads.load(tmp_path, target=t).attach(t)
    assert back.config.tree["top_k"] == 3  # carried by the export's selfspec block
    out, root = target_pass(t, PROMPT)
    ids = torch.cat([PROMPT[:, 1:], root.view(1, 1)], dim=1)
    with torch.no_grad():
        ours = drafter(ids, drafter.fuse_features(tuple(out.hidden_states[i] for i in drafter.feature_layers)))[1]
        theirs = back(ids, back.fuse_features(tuple(out.hidden_states[i] for i in back.feature_layers)))[1]
    torch.testing.assert_close(theirs, ours)


def test_target_named_in_the_checkpoint(tmp_path):
    write_medusa_fd(tmp_path / "medusa", target(), base_model="org/base-model")
    write_speculators(tmp_path / "spec", target(), verifier="org/verifier")
    write_eagle_authors(tmp_path / "eagle", target())
    assert heads.target_name(tmp_path / "medusa") == "org/base-model"
    assert heads.target_name(tmp_path / "spec") == "org/verifier"
    assert heads.target_name(tmp_path / "eagle") is None
    with pytest.raises(ValueError, match="records no base_model_name_or_path .*pass target="):
        SelfSpecModel.from_pretrained(str(tmp_path / "eagle"))


@pytest.mark.parametrize("fmt", ["medusa_fd", "speculators"])
def test_from_pretrained_loads_the_target_the_checkpoint_names(fmt, tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    t = target()
    t.save_pretrained(tmp_path / "target")
    vocab = {f"t{i}": i for i in range(t.config.vocab_size)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0"))).save_pretrained(
        tmp_path / "target")
    name = str(tmp_path / "target")
    if fmt == "medusa_fd":
        write_medusa_fd(tmp_path / "drafter", t, base_model=name)
    else:
        write_speculators(tmp_path / "drafter", t, verifier=name)
    spec = SelfSpecModel.from_pretrained(str(tmp_path / "drafter"))
    expected = t.generate(PROMPT, do_sample=False, max_new_tokens=16, eos_token_id=None, pad_token_id=0)
    assert torch.equal(spec.generate(PROMPT, max_new_tokens=16, eos_token_id=[]), expected)
    assert spec.target is not t  # loaded from the name in the checkpoint


def test_speculators_checkpoint_without_target_loads_from_its_config(tmp_path):
    """What the target would add (its layer count, model type) is checked later, at attach."""
    write_speculators(tmp_path, target())
    model = heads.load(tmp_path)
    assert list(model.feature_layers) == [2, 4, 6] and model.config.target_num_layers is None


# ---- speculators' current defaults, the whole vocabulary, feature layers as vLLM serves them (issue 56) ----------


def drafted_chain(model, t, ids, steps: int) -> list[int]:
    """The greedy chain our drafter drafts below the root (top-1 at each depth)."""
    _, tree = first_tree(model, t, ids, top_k=1, depth=steps, total_tokens=steps)
    return [int(tok) for tok in tree.tokens[0, 1:steps + 1]]


def test_speculators_current_defaults_draft_what_speculators_computes(tmp_path):
    """speculators 0.9.0 trains EAGLE-3 with norm_before_fc, norm_output and sliding-window layers, and lists the
    layers as given: each is read as its Eagle3DraftModel computes it (the chain fed back with the normed state,
    the window cutting the prompt), generation stays exact, and the export writes the flags back."""
    from heads.eagle3.lean import why_not
    from heads.eagle3.objective import Eagle3Objective
    from heads.export import export_speculators

    t = target()
    ckpt = write_speculators_defaults(tmp_path / "theirs", t, seed=6)
    model = heads.load(tmp_path / "theirs", target=t)
    c = model.config
    assert (c.norm_before_fc, c.norm_output, c.layer_windows, list(c.feature_layers)) == (True, True, [4], [2, 4, 6])
    chain, logits = eagle3_chain(t, PROMPT, ckpt, steps=3)
    assert drafted_chain(model, t, PROMPT, 3) == chain
    out, root = target_pass(t, PROMPT)
    with torch.no_grad():
        ours = model(torch.cat([PROMPT[:, 1:], root.view(1, 1)], dim=1),
                     model.fuse_features(tuple(out.hidden_states[i] for i in model.feature_layers)), fused=True)[1]
    torch.testing.assert_close(ours[0, -1], logits, atol=2e-4, rtol=2e-4)
    # each option changes the chain at this seed, so the reference tells them apart
    for off in ({"window": None}, {"norm_output": False}, {"norm_before_fc": False}):
        assert eagle3_chain(t, PROMPT, {**ckpt, **off}, steps=3)[0] != chain, off
    expected = t.generate(PROMPT, do_sample=False, max_new_tokens=24, eos_token_id=None, pad_token_id=0)
    spec = SelfSpecModel.from_pretrained(str(tmp_path / "theirs"), target=t)
    assert torch.equal(spec.generate(PROMPT, max_new_tokens=24, eos_token_id=[]), expected)

    export_speculators(model, tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert (config["norm_before_fc"], config["norm_output"], config["fc_norm"]) == (True, True, False)
    layer = config["transformer_layer_config"]
    assert (layer["layer_types"], layer["sliding_window"]) == (["sliding_attention"], 4)
    again = heads.load(tmp_path / "ours", target=t)
    assert [k for k, v in model.state_dict().items() if not torch.equal(v, again.state_dict()[k])] == []
    assert drafted_chain(again, t, PROMPT, 3) == chain
    with pytest.raises(ValueError, match="sliding-window attention layers .* does not mask"):
        Eagle3Objective(model, None)  # training masks attend to everything
    assert "sliding-window" in why_not(model.attach(t))  # drafts through the model's own modules


@pytest.mark.parametrize("fmt", ["speculators", "eagle_authors", "specforge"])
def test_whole_draft_vocabulary_without_a_map(fmt, tmp_path):
    """speculators writes no d2t/t2d when the draft vocabulary is the target's (vLLM then drafts target ids as they
    are); the others write an identity map, or one their code ignores."""
    t = target()
    ckpt = WRITERS[fmt](tmp_path, t, draft_vocab=t.config.vocab_size)
    if fmt == "speculators":
        from safetensors import safe_open

        with safe_open(tmp_path / "model.safetensors", "pt") as f:
            assert "d2t" not in f.keys() and "t2d" not in f.keys()
    model = heads.load(tmp_path, target=t)
    assert int(model.d2t.abs().sum()) == 0 and bool(model.t2d.all())
    assert drafted_chain(model, t, PROMPT, 3) == eagle3_chain(t, PROMPT, ckpt, steps=3)[0]


def test_speculators_partial_vocabulary_without_its_map_is_refused(tmp_path):
    t = target()
    write_speculators(tmp_path, t)
    from safetensors.torch import load_file

    state = load_file(tmp_path / "model.safetensors")
    del state["d2t"], state["t2d"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="draft vocabulary of 48 < 96 needs its d2t map, which model.safetensors lacks"):
        heads.load(tmp_path, target=t)


def test_speculators_export_writes_layers_as_vllm_captures_them(tmp_path):
    """vLLM captures the listed layers once each and concatenates them ascending, and its fc reads three: the export
    writes the layers ascending with fc's column blocks (and norm_before_fc's norm) permuted to match, drafts the
    same after re-import, and refuses a count or repeat vLLM cannot serve."""
    from heads.export import export_speculators

    t = target()
    drafter = heads.build("eagle3", t, feature_layers=[6, 2, 4], draft_vocab_size=48, norm_before_fc=True)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)) * 0.1)
    drafter.attach(t)
    export_speculators(drafter, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6]
    from safetensors.torch import load_file

    written = load_file(tmp_path / "out" / "model.safetensors")
    blocks = dict(zip([6, 2, 4], drafter.fc.weight.split(32, dim=1), strict=True))
    assert torch.equal(written["fc.weight"], torch.cat([blocks[i] for i in (2, 4, 6)], dim=1))
    norms = dict(zip([6, 2, 4], drafter.input_norm.weight.split(32), strict=True))
    assert torch.equal(written["input_norm.weight"], torch.cat([norms[i] for i in (2, 4, 6)]))
    again = heads.load(tmp_path / "out", target=t)
    assert list(again.feature_layers) == [2, 4, 6]
    assert drafted_chain(again, t, PROMPT, 3) == drafted_chain(drafter, t, PROMPT, 3)
    for layers, message in (([2, 4], "reads exactly 3 target layers"), ([2, 2, 4], "repeated layers"),
                            ([1, 2, 4, 6], "reads exactly 3 target layers")):
        with pytest.raises(ValueError, match=message):
            export_speculators(heads.build("eagle3", t.config, feature_layers=layers), tmp_path / "refused")
        assert not (tmp_path / "refused").exists()


# ---- EAGLE-1/2 as the EAGLE authors publish them (issue 56) -----------------------------------------------------


@pytest.mark.parametrize("layout", ["llama3", "vicuna", "qwen2"])
def test_eagle1_authors_draft_what_their_code_computes(layout, tmp_path):
    """yuhuili/EAGLE-LLaMA3-Instruct-8B's layout (fc without bias, `bias: false`), EAGLE-Vicuna's (fc with a bias)
    and their Qwen2 drafters' (q/k/v biases): layer 0 without an input norm, the target's lm_head on its output."""
    t = target()
    ckpt = write_eagle1_authors(tmp_path, t, layout=layout)
    assert heads.imported_format(tmp_path).name == "eagle1_authors"
    model = heads.load(tmp_path, target=t)
    assert model.kind == "eagle" and model.config.layer_input_norm is False
    assert model.fc.bias is not None if layout != "llama3" else model.fc.bias is None
    assert drafted_chain(model, t, PROMPT, 4) == eagle1_chain(t, PROMPT, ckpt, 4)
    expected = t.generate(PROMPT, do_sample=False, max_new_tokens=24, eos_token_id=None, pad_token_id=0)
    spec = SelfSpecModel.from_pretrained(str(tmp_path), target=t)
    assert torch.equal(spec.generate(PROMPT, max_new_tokens=24, eos_token_id=[]), expected)
    model.save_pretrained(tmp_path / "ours")  # ours from now on, the layout kept
    again = heads.load(tmp_path / "ours").attach(t)
    assert drafted_chain(again, t, PROMPT, 4) == eagle1_chain(t, PROMPT, ckpt, 4)


def _eagle1_bias_missing(folder, t):
    write_eagle1_authors(folder, t, layout="vicuna")
    weights = torch.load(folder / "pytorch_model.bin", weights_only=True)
    del weights["fc.bias"]
    torch.save(weights, folder / "pytorch_model.bin")


def _one_layer_llama(folder, t):
    """A one-layer Llama model saved as pytorch_model.bin: the same config family, not a drafter."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = t.config
    model = LlamaForCausalLM(LlamaConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                                         num_attention_heads=c.num_attention_heads, num_hidden_layers=1,
                                         vocab_size=c.vocab_size))
    model.config.architectures = ["LlamaForCausalLM"]
    model.config.save_pretrained(folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")


# ---- published checkpoints' layouts (issue 56) -------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_layouts_import_and_stay_exact(name, tmp_path):
    """Each published checkpoint's config keys and tensor names at the tiny target's sizes: recognised as its format,
    loaded, and greedy generation identical to the target's."""
    t = target()
    write, fmt = PUBLISHED[name]
    write(tmp_path, t)
    assert heads.imported_format(tmp_path).name == fmt
    heads.load(tmp_path, target=t)
    expected = t.generate(PROMPT, do_sample=False, max_new_tokens=24, eos_token_id=None, pad_token_id=0)
    spec = SelfSpecModel.from_pretrained(str(tmp_path), target=t)
    assert torch.equal(spec.generate(PROMPT, max_new_tokens=24, eos_token_id=[]), expected)


# ---- bad input: refused by name before any generation ------------------------------------------------------------


def _mystery(folder):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "mystery", "hidden_size": 32}))
    save_file({"w": torch.zeros(2)}, folder / "model.safetensors")


def _d2t_out_of_range(folder, t):
    write_specforge(folder, t)
    from safetensors.torch import load_file

    state = load_file(folder / "model.safetensors")
    state["d2t"] = state["d2t"].clone()
    state["d2t"][-1] += 40  # past the 96-token vocabulary
    save_file(state, folder / "model.safetensors")


def _t2d_disagrees(folder, t):
    write_specforge(folder, t)
    from safetensors.torch import load_file

    state = load_file(folder / "model.safetensors")
    state["t2d"] = state["t2d"].clone()
    state["t2d"][~state["t2d"]] = torch.tensor([True] + [False] * (int((~state["t2d"]).sum()) - 1))
    save_file(state, folder / "model.safetensors")


def _other_tokenizer(folder, t):
    other = t.get_input_embeddings().weight.detach().clone()
    other[[3, 4]] = other[[4, 3]]  # two tokens swapped: another tokenizer's ids
    write_speculators(folder, t, embedding=other)


BAD = [
    ("hidden size", lambda f, t: write_eagle_authors(f, target_model(hidden_size=48, intermediate_size=96)),
     ValueError, r"hidden size: checkpoint 48, target 32"),
    ("vocabulary", lambda f, t: write_medusa_fd(f, target_model(vocab_size=128)), ValueError,
     r"vocabulary size: checkpoint 128, target 96"),
    ("DFlash for a deeper target", lambda f, t: write_dflash_zlab(f, target_model(num_hidden_layers=10),
                                                                  target_layer_ids=(1, 8, 3)),
     ValueError, r"layer count: checkpoint 10, target 8"),
    ("d2t past the vocabulary", _d2t_out_of_range, ValueError, r"d2t maps draft ids to target ids outside"),
    ("t2d disagrees with d2t", _t2d_disagrees, ValueError, r"t2d and d2t disagree"),
    ("another tokenizer's embedding", _other_tokenizer, ValueError,
     r"embed_tokens.weight differs from the target's input embedding in 2 of 96 rows"),
    ("unknown format", lambda f, t: _mystery(f), ValueError,
     r"model_type 'mystery', not a selfspec drafter .* nor a checkpoint in a format selfspec imports:(.|\n)*eagle_authors(.|\n)*specforge"
     r"(.|\n)*speculators(.|\n)*medusa_fd(.|\n)*dflash_zlab"),
    ("SpecForge fc_norm", lambda f, t: write_specforge(f, t, fc_norm=True), ValueError, r"fc_norm: true"),
    ("speculators fc_norm", lambda f, t: _with_config(write_speculators, f, t, fc_norm=True),
     ValueError, r"sets fc_norm: true \(an RMSNorm per feature layer before fc\)"),
    ("speculators layer types of another kind", lambda f, t: _with_layer_config(
        write_speculators, f, t, layer_types=["chunked_attention"]), ValueError,
     r"layer_types must list one of \['full_attention', 'sliding_attention'\] for each of its 1 layers"),
    ("speculators layers repeated", lambda f, t: _with_config(write_speculators, f, t,
                                                              eagle_aux_hidden_state_layer_ids=[2, 2, 4]),
     ValueError, r"eagle_aux_hidden_state_layer_ids \[2, 2, 4\] repeats a layer"),
    ("speculators DFlash algorithm", lambda f, t: _with_config(write_speculators, f, t,
                                                               speculators_model_type="dflash"),
     ValueError, r"speculators 'dflash' drafter; selfspec imports \['eagle3'\]"),
    ("Medusa blocks that differ", lambda f, t: _unshared_medusa(f, t), ValueError, r"head 0's residual blocks differ"),
    ("EAGLE-1 fc bias missing", _eagle1_bias_missing, ValueError,
     r"gives fc a bias \(no `bias: false`\), which pytorch_model.bin lacks"),
    ("one-layer Llama model, not a drafter", _one_layer_llama, ValueError,
     r"holds fc.weight \[32, 64\] .* it is not an EAGLE drafter"),
]


def _with_config(writer, folder, t, **changes):
    writer(folder, t)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def _with_layer_config(writer, folder, t, **changes):
    writer(folder, t)
    config = json.loads((folder / "config.json").read_text())
    config["transformer_layer_config"].update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def _unshared_medusa(folder, t):
    write_medusa_fd(folder, t, num_layers=2, pt=True)
    state = torch.load(folder / "medusa_lm_head.pt", weights_only=True)
    state["0.1.linear.weight"] = state["0.1.linear.weight"] + 1
    torch.save(state, folder / "medusa_lm_head.pt")


@pytest.mark.parametrize("name,write,error,message", BAD, ids=[b[0] for b in BAD])
def test_bad_checkpoints_are_refused_by_name(name, write, error, message, tmp_path):
    t = target()
    folder = tmp_path / "ckpt"
    write(folder, t)
    with pytest.raises(error, match=message):
        heads.load(folder, target=t)
    with pytest.raises(error, match=message):
        SelfSpecModel.from_pretrained(str(folder), target=t)


# ---- damaged files and configs: refused naming the file, the key and the fix (issue 55, findings 12 and 13) --------


def _damaged(writer, name: str, damage):
    """A checkpoint written by `writer` whose file `name` is then damaged: `damage(bytes) -> bytes`."""
    def write(folder, t):
        writer(folder, t)
        path = folder / name
        path.write_bytes(damage(path.read_bytes()))
    return write


def _holding(writer, name: str, value):
    def write(folder, t):
        writer(folder, t)
        torch.save(value, folder / name)
    return write


def _edited(writer, edit):
    """A checkpoint written by `writer` whose config.json is then edited in place: `edit(config)`."""
    def write(folder, t):
        writer(folder, t)
        config = json.loads((folder / "config.json").read_text())
        edit(config)
        (folder / "config.json").write_text(json.dumps(config))
    return write


def _wrong_shape(folder, t):
    from safetensors.torch import load_file

    write_speculators(folder, t)
    state = load_file(folder / "model.safetensors")
    state["norm.weight"] = torch.ones(16)
    save_file(state, folder / "model.safetensors")


def _dflash_export(folder, t):
    """Our DFlash export as written before exports recorded their files: its mask_embedding.pt is read as it is."""
    from heads.export import export_dflash

    export_dflash(heads.build("dflash", t), folder)
    config = json.loads((folder / "config.json").read_text())
    del config["selfspec"]["files"]
    (folder / "config.json").write_text(json.dumps(config))


def _speculators_export(folder, t):
    from heads.export import export_speculators

    export_speculators(heads.build("eagle3", t, draft_vocab_size=48), folder)


def _half(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _garbage(data: bytes) -> bytes:
    return bytes(torch.randint(0, 256, (5000,), generator=torch.Generator().manual_seed(0)).to(torch.uint8).tolist())


CORRUPT = "corrupt or truncated safetensors file .*model.safetensors: .*re-download"
UNPICKLABLE = "it is corrupt or truncated, or not a file of tensors .* re-download the checkpoint"
EDITED = "the file was edited or damaged; re-download the checkpoint"
DAMAGED = [
    # weight files
    ("speculators weights truncated", _damaged(write_speculators, "model.safetensors", _half), CORRUPT),
    ("speculators weights empty", _damaged(write_speculators, "model.safetensors", lambda b: b""), CORRUPT),
    ("speculators weights garbage", _damaged(write_speculators, "model.safetensors", _garbage), CORRUPT),
    ("speculators weights zeroed", _damaged(write_speculators, "model.safetensors", lambda b: bytes(len(b))), CORRUPT),
    ("speculators tensor of a wrong shape", _wrong_shape,
     r"does not map onto the drafter: shapes differ: norm.weight: checkpoint \(16,\), drafter \(32,\)"),
    ("SpecForge weights truncated", _damaged(write_specforge, "model.safetensors", _half),
     "cannot read .*model.safetensors: .*The file is corrupt or truncated: re-download the checkpoint"),
    ("EAGLE authors' pickle garbage", _damaged(write_eagle_authors, "pytorch_model.bin", _garbage),
     r"cannot read .*pytorch_model.bin \(5000 bytes\): " + UNPICKLABLE),
    ("EAGLE authors' pickle truncated", _damaged(write_eagle_authors, "pytorch_model.bin", _half),
     "pytorch_model.bin .*" + UNPICKLABLE),
    ("EAGLE authors' pickle empty", _damaged(write_eagle_authors, "pytorch_model.bin", lambda b: b""),
     r"pytorch_model.bin \(0 bytes\): " + UNPICKLABLE),
    ("EAGLE authors' pickle of a list", _holding(write_eagle_authors, "pytorch_model.bin", [torch.zeros(2)]),
     "pytorch_model.bin is not a state dict of tensors .* but a list"),
    ("Medusa pickle garbage", _damaged(lambda f, t: write_medusa_fd(f, t, pt=True), "medusa_lm_head.pt", _garbage),
     "medusa_lm_head.pt .*" + UNPICKLABLE),
    ("DFlash mask vector garbage", _damaged(_dflash_export, "mask_embedding.pt", _garbage),
     "mask_embedding.pt .*" + UNPICKLABLE),
    ("DFlash mask vector truncated", _damaged(_dflash_export, "mask_embedding.pt", _half),
     "mask_embedding.pt .*" + UNPICKLABLE),
    ("DFlash mask vector a list", _holding(_dflash_export, "mask_embedding.pt", [1, 2]),
     r"mask_embedding.pt holds a list, not DFlash's mask vector \({'mask_token_id'"),
    ("DFlash mask vector without its embedding", _holding(_dflash_export, "mask_embedding.pt", {"mask_token_id": 2}),
     r"holds a dict with keys \['mask_token_id'\], not DFlash's mask vector"),
    # configs: keys missing or of another kind
    ("speculators without transformer_layer_config", _edited(write_speculators, lambda c: c.pop("transformer_layer_config")),
     "config.json has no 'transformer_layer_config' \\(an object"),
    ("speculators transformer_layer_config a list", _edited(write_speculators,
                                                            lambda c: c.update(transformer_layer_config=[1])),
     r"config.json's 'transformer_layer_config' must be an object \({...}\), got \[1\]: " + EDITED),
    ("speculators without draft_vocab_size", _edited(write_speculators, lambda c: c.pop("draft_vocab_size")),
     "config.json has no 'draft_vocab_size' \\(a whole number >= 1\\), which this format always writes"),
    ("speculators draft_vocab_size a string (was a d2t message)",
     _edited(write_speculators, lambda c: c.update(draft_vocab_size="48")),
     "config.json's 'draft_vocab_size' must be a whole number >= 1, got '48': " + EDITED),
    ("speculators without vocab_size", _edited(write_speculators,
                                               lambda c: c["transformer_layer_config"].pop("vocab_size")),
     "config.json's transformer_layer_config has no 'vocab_size'"),
    ("speculators export with a selfspec block that is a list", _edited(_speculators_export,
                                                                        lambda c: c.update(selfspec=[1])),
     "config.json's 'selfspec' must be an object, got \\[1\\]"),
    ("SpecForge without hidden_size", _edited(write_specforge, lambda c: c.pop("hidden_size")),
     "config.json has no 'hidden_size'"),
    ("SpecForge without num_attention_heads", _edited(write_specforge, lambda c: c.pop("num_attention_heads")),
     "config.json has no 'num_attention_heads'"),
    ("SpecForge hidden_size a string (was 'hidden size: checkpoint 32, target 32')",
     _edited(write_specforge, lambda c: c.update(hidden_size="32")),
     "config.json's 'hidden_size' must be a whole number >= 1, got '32'"),
    ("SpecForge KV heads not dividing the heads", _edited(write_specforge, lambda c: c.update(num_key_value_heads=3)),
     "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ("EAGLE authors' target_hidden_size a string (was 'its layer is 32 wide over a 32-wide target')",
     _edited(write_eagle_authors, lambda c: c.update(target_hidden_size="32")),
     "config.json's 'target_hidden_size' must be a whole number >= 1, got '32'"),
    ("EAGLE authors' draft_vocab_size a string (was a d2t message)",
     _edited(write_eagle_authors, lambda c: c.update(draft_vocab_size="48")),
     "config.json's 'draft_vocab_size' must be a whole number >= 1, got '48'"),
    ("EAGLE authors' heads not dividing the width", _edited(write_eagle_authors,
                                                            lambda c: c.update(num_attention_heads=3)),
     "hidden_size 32 is not a multiple of num_attention_heads 3"),
    ("DFlash without hidden_size (was read as Qwen3's 4096)", _edited(write_dflash_zlab, lambda c: c.pop("hidden_size")),
     "config.json has no 'hidden_size'"),
    ("DFlash dflash_config a list", _edited(write_dflash_zlab, lambda c: c.update(dflash_config=[1])),
     "config.json's 'dflash_config' must be an object"),
    ("DFlash target_layer_ids a string", _edited(write_dflash_zlab,
                                                 lambda c: c["dflash_config"].update(target_layer_ids="1,5,3")),
     "config.json's dflash_config's 'target_layer_ids' must be a list of whole numbers >= 0, got '1,5,3'"),
    ("Medusa medusa_num_layers a string", _edited(write_medusa_fd, lambda c: c.update(medusa_num_layers="1")),
     "config.json's 'medusa_num_layers' must be a whole number >= 1, got '1'"),
]


@pytest.mark.parametrize("name,write,message", DAMAGED, ids=[d[0] for d in DAMAGED])
def test_damaged_checkpoints_are_refused_naming_the_file_and_the_fix(name, write, message, tmp_path):
    t = target()
    folder = tmp_path / "ckpt"
    write(folder, t)
    for load in (lambda: heads.load(folder, target=t), lambda: SelfSpecModel.from_pretrained(str(folder), target=t)):
        with pytest.raises(ValueError, match=message) as info:
            load()
        assert str(folder) in str(info.value)
        assert "weights_only=False" not in str(info.value) and "weights_only` set to `False" not in str(info.value)


def test_formats_needing_the_target_say_so(tmp_path):
    write_eagle_authors(tmp_path / "eagle", target())
    write_dflash_zlab(tmp_path / "dflash", target())
    write_specforge(tmp_path / "specforge", target(), aux_layer_ids=None)
    with pytest.raises(ValueError, match="pass target="):
        heads.load(tmp_path / "eagle")
    with pytest.raises(ValueError, match="pass target=<the target model>"):
        heads.load(tmp_path / "dflash")
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids.*pass target="):
        heads.load(tmp_path / "specforge")


def test_medusa_config_undercounting_its_heads_warns(tmp_path):
    write_medusa_fd(tmp_path, target(), num_heads=3)
    config = json.loads((tmp_path / "config.json").read_text())
    config["medusa_num_heads"] = 2
    (tmp_path / "config.json").write_text(json.dumps(config))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = heads.load(tmp_path, target=target())
    assert model.config.num_heads == 3
    assert any("says 2 heads, its weights hold 3" in str(w.message) for w in caught)


def test_specforge_llama3_rope_scaling_is_the_drafters_rope(tmp_path):
    """Llama-3.1 drafters carry `rope_scaling` of type llama3 (SpecForge's configs do): the imported layer rotates by
    the frequencies transformers computes for that scaling, not the unscaled ones, and generation stays exact."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    t = target()
    write_specforge(tmp_path, t)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_parameters", None)
    scaling = {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
               "original_max_position_embeddings": 1024, "rope_type": "llama3"}
    config.update(rope_theta=500000.0, rope_scaling=scaling)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = heads.load(tmp_path, target=t)
    layer = LlamaConfig(hidden_size=config["hidden_size"], num_attention_heads=config["num_attention_heads"],
                        head_dim=config["head_dim"], max_position_embeddings=config["max_position_embeddings"],
                        rope_parameters={**scaling, "rope_theta": 500000.0})
    unscaled = LlamaConfig(hidden_size=config["hidden_size"], num_attention_heads=config["num_attention_heads"],
                           head_dim=config["head_dim"], rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    expected, plain = LlamaRotaryEmbedding(layer).inv_freq, LlamaRotaryEmbedding(unscaled).inv_freq
    assert not torch.allclose(expected, plain)  # the scaling changes some frequencies at these sizes
    torch.testing.assert_close(model.rotary_emb.inv_freq, expected)
    reference = t.generate(PROMPT, do_sample=False, max_new_tokens=16, eos_token_id=None, pad_token_id=0)
    spec = SelfSpecModel.from_pretrained(str(tmp_path), target=t)
    assert torch.equal(spec.generate(PROMPT, max_new_tokens=16, eos_token_id=[]), reference)


def test_unknown_rope_scaling_is_refused_by_name(tmp_path):
    t = target()
    write_specforge(tmp_path, t)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_parameters", None)
    config.update(rope_theta=500000.0, rope_scaling={"rope_type": "spiral", "factor": 2.0})
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="RoPE scaling 'spiral' is not one transformers computes"):
        heads.load(tmp_path, target=t)
