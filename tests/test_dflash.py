"""DFlash block drafters (heads/dflash/): the attention layout, drafting from the cache equals the training
layout, trees and sampled chains, config and target errors, and the block objective learning what the
engine then accepts. The kind also runs through every table of tests/test_heads.py (build, save/load,
greedy equivalence on every architecture), test_sampling.py (chi-square) and test_train_loop.py."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_model

import heads
from heads.dflash.model import block_attention, block_positions
from heads.dflash.objective import DFlashObjective
from infer import SelfSpecModel
from infer.attention import additive_mask
from infer.drafting import TargetStep
from infer.sampling import SamplingParams
from train.config import load_config


def perturb(model, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def test_block_attention_layout():
    # 3 context slots (the first is padding), two blocks of 2 anchored at context indices 2 and 3.
    allowed = block_attention(torch.tensor([[False, True, True]]), torch.tensor([[2, 3]]), 2)[0].int()
    assert allowed.tolist() == [
        # ctx0 ctx1 ctx2 | b0 b0 | b1 b1
        [1, 0, 0, 0, 0, 0, 0],  # padding sees itself only
        [0, 1, 0, 0, 0, 0, 0],
        [0, 1, 1, 0, 0, 0, 0],  # causal context
        [0, 1, 0, 1, 1, 0, 0],  # block 0: context before index 2, all of its own block
        [0, 1, 0, 1, 1, 0, 0],
        [0, 1, 1, 0, 0, 1, 1],  # block 1: context before index 3
        [0, 1, 1, 0, 0, 1, 1],
    ]
    assert block_positions(torch.tensor([[2, 3]]), 2).tolist() == [[2, 3, 3, 4]]


def _hidden(target, drafter, ids, mask=None):
    mask = torch.ones_like(ids) if mask is None else mask
    positions = (mask.cumsum(1) - 1).clamp(min=0)  # as the engine places a left-padded prompt
    out = target(ids, attention_mask=mask, position_ids=positions, output_hidden_states=True)
    return out, tuple(out.hidden_states[i] for i in drafter.feature_layers)


def _layout_logits(target, drafter, tokens: list[int], root: int) -> torch.Tensor:
    """[S-1, V]: the block after `tokens` with anchor `root`, run the way the objective runs it (one
    forward: context of all tokens' features, one block anchored after them)."""
    ids = torch.tensor([tokens + [root]])
    _, feats = _hidden(target, drafter, ids)
    t, s = ids.shape[1], drafter.config.block_size
    anchors = torch.tensor([[t - 1]])
    mask = additive_mask(block_attention(torch.ones(1, t, dtype=torch.bool), anchors, s), drafter.dtype)
    positions = torch.cat([torch.arange(t)[None], block_positions(anchors, s)], dim=1)
    _, logits = drafter(drafter.fuse_features(feats), anchors.new_tensor([[root]]), attention_mask=mask,
                        position_ids=positions)
    return logits[0, 0]


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2", "qwen3"])
def test_drafting_from_the_cache_equals_the_training_layout(arch):
    """observe/propose (a KV cache with left padding, then holes after a verify) give the block the same
    logits as the objective's one-forward layout over the unpadded sequence."""
    target = tiny_model(arch)
    drafter = perturb(heads.build("dflash", target, block_size=5))
    adapter = drafter.as_drafter()
    adapter.bind(target, SamplingParams(), batch_size=2)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 96, (2, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    out, feats = _hidden(target, drafter, ids, mask)
    valid = mask.bool()
    root = torch.tensor([7, 9])
    adapter.observe(TargetStep(ids, valid, feats, root))
    rows = [ids[0].tolist(), ids[1, 2:].tolist()]
    got = adapter._block_logits()
    for b in range(2):
        torch.testing.assert_close(got[b], _layout_logits(target, drafter, rows[b], int(root[b])),
                                   rtol=1e-4, atol=1e-4)

    # A verify step: row 0 keeps root + 2 drafts, row 1 the root only (right-padded, holes in the cache).
    step_ids = torch.cat([root[:, None], torch.randint(3, 96, (2, 2), generator=g)], dim=1)
    keep = torch.tensor([[True, True, True], [True, False, False]])
    full = [rows[b] + step_ids[b][keep[b]].tolist() for b in range(2)]
    hidden = []
    for b in range(2):  # each row's features as the target computes them on its own sequence
        _, f = _hidden(target, drafter, torch.tensor([full[b]]))
        hidden.append([h[0, len(rows[b]):] for h in f])
    step_hidden = tuple(torch.stack([torch.nn.functional.pad(hidden[b][i], (0, 0, 0, 3 - hidden[b][i].shape[0]))
                                     for b in range(2)]) for i in range(len(feats)))
    nxt = torch.tensor([11, 13])
    adapter.observe(TargetStep(step_ids, keep, step_hidden, nxt))
    got = adapter._block_logits()
    for b in range(2):
        torch.testing.assert_close(got[b], _layout_logits(target, drafter, full[b], int(nxt[b])),
                                   rtol=1e-4, atol=1e-4)


def test_sampled_chain_carries_q_and_tree_is_deterministic():
    target = tiny_model("llama")
    drafter = heads.build("dflash", target, block_size=6)
    ids = torch.randint(3, 96, (2, 5), generator=torch.Generator().manual_seed(1))
    for tree, sampling in (({}, SamplingParams(do_sample=True, temperature=0.8, top_k=20)),
                           ({"top_k": 3, "total_tokens": 7}, SamplingParams(do_sample=True))):
        adapter = drafter.as_drafter(**tree)
        adapter.bind(target, sampling, batch_size=2, generator=torch.Generator().manual_seed(0))
        out, feats = _hidden(target, drafter, ids)
        valid = torch.ones_like(ids, dtype=torch.bool)
        adapter.observe(TargetStep(ids, valid, feats, torch.tensor([4, 5])))
        proposed = adapter.propose(torch.tensor([10, 3]))
        depth, _ = proposed.depth_and_ancestors()
        assert (depth[proposed.valid] <= torch.tensor([10, 3])[:, None].expand_as(depth)[proposed.valid]).all()
        if not tree:  # a chain of 5 drafts, each from its own q (warped: at most top_k tokens)
            assert proposed.num_nodes == 6 and proposed.q.shape == (2, 6, 96)
            q = proposed.q[:, 1:]
            assert ((q > 0).sum(-1) <= 20).all()
            assert (q.gather(2, proposed.tokens[:, 1:, None]) > 0).all()
        else:
            assert proposed.num_nodes == 8 and proposed.q is None


def test_config_errors_name_the_field():
    config = tiny_model("llama").config
    with pytest.raises(ValueError, match=r"DFlash feature_layers \[1, 9\] must be .* 0..4"):
        heads.build("dflash", config, feature_layers=[1, 9])
    with pytest.raises(ValueError, match="block_size must be an int >= 2"):
        heads.build("dflash", config, block_size=1)
    with pytest.raises(ValueError, match="deeper than the block"):
        heads.build("dflash", config, block_size=4, tree={"depth": 4})
    with pytest.raises(ValueError, match="tree top_k must be an int >= 1"):
        heads.build("dflash", config).as_drafter(top_k=0)
    with pytest.raises(ValueError, match="loss_decay must be a number > 0"):
        heads.build("dflash", config, loss_decay=0)


def test_wrong_target_lists_every_mismatch():
    drafter = heads.build("dflash", tiny_model("llama").config, feature_layers=[1, 3, 4])
    wrong = tiny_model("llama", hidden_size=48, vocab_size=128, num_hidden_layers=2)
    with pytest.raises(ValueError) as err:
        drafter.check_target(wrong)
    for line in ("hidden size: drafter built for 32, target has 48",
                 "vocab size: drafter built for 96, target has 128",
                 "layer count: drafter built for 4, target has 2",
                 "feature layers [3, 4] do not exist: the target's hidden_states are 0..2"):
        assert f"  - {line}" in str(err.value)
    with pytest.raises(ValueError, match="feature layers"):
        SelfSpecModel(wrong, drafter)


def test_saved_config_with_missing_target_layers_is_refused(tmp_path):
    drafter = heads.build("dflash", tiny_model("llama").config)
    drafter.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved["feature_layers"] = [2, 7]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"feature_layers \[2, 7\]"):
        heads.load(tmp_path)


def _batch(sequences: list[list[int]], prompt_len: int) -> dict:
    t = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), t, dtype=torch.long)
    attn, loss = torch.zeros_like(ids), torch.zeros_like(ids, dtype=torch.bool)
    for b, s in enumerate(sequences):
        ids[b, :len(s)], attn[b, :len(s)] = torch.tensor(s), 1
        loss[b, prompt_len:len(s)] = True
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss, "index": torch.arange(len(sequences))}


def test_objective_anchors_weights_and_repeatable_evaluation():
    target = tiny_model("llama")
    drafter = heads.build("dflash", target, block_size=4, anchors_per_sample=50)
    config = load_config(None, {"target": "unused", "data": "unused", "drafter": "dflash"})
    objective = DFlashObjective(drafter, config)
    assert objective.weights.tolist() == pytest.approx([1.0, torch.e ** (-1 / 7), torch.e ** (-2 / 7)])
    batch = _batch([list(range(3, 15)), list(range(20, 28))], prompt_len=4)
    anchors, usable = objective.anchors(batch)
    # usable anchors: positions 1..T-2 whose next token is an assistant token, on real tokens
    assert sorted(anchors[0][usable[0]].tolist()) == list(range(3, 11))
    assert sorted(anchors[1][usable[1]].tolist()) == list(range(3, 7))
    with torch.no_grad():
        out = target(batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
    features = {i: out.hidden_states[i] for i in drafter.feature_layers}
    objective.eval()
    state = torch.get_rng_state()
    first, _ = objective(batch, features)
    again, _ = objective(batch, features)
    assert torch.equal(first, again) and torch.equal(torch.get_rng_state(), state)
    objective.train()
    loss, logs = objective(batch, features)
    assert set(logs) == {"loss/pos0", "loss/pos1", "loss/pos2"}
    loss.backward()
    for name in ("fc.weight", "mask_embed.weight", "layers.0.mlp.down_proj.weight", "norm.weight"):
        assert drafter.get_parameter(name).grad.abs().sum() > 0, name


def test_trained_block_is_accepted_by_the_engine():
    """Trained with the block objective on the target's own greedy text, the drafter's blocks are accepted
    several tokens deep by speculative decoding of the same prompts, and the output stays the target's."""
    torch.manual_seed(0)
    target = tiny_model("llama")
    prompts = torch.randint(3, 96, (8, 4), generator=torch.Generator().manual_seed(2))
    text = target.generate(prompts, do_sample=False, max_new_tokens=24, eos_token_id=None, pad_token_id=0)
    batch = _batch(text.tolist(), prompt_len=4)
    drafter = heads.build("dflash", target, block_size=5, num_layers=1, anchors_per_sample=24).train()
    config = load_config(None, {"target": "unused", "data": "unused", "drafter": "dflash"})
    objective = DFlashObjective(drafter, config)
    with torch.no_grad():
        out = target(batch["input_ids"], output_hidden_states=True)
    features = {i: out.hidden_states[i] for i in drafter.feature_layers}
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(150):
        loss, _ = objective(batch, features)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model = SelfSpecModel(target, drafter.eval())
    got = model.generate(prompts, max_new_tokens=24, eos_token_id=[])
    assert torch.equal(got, text)
    assert model.last_stats["mean_accepted_length"] > 2.5, model.last_stats["mean_accepted_length"]
