"""Packed rows (several samples per row, train/packing.py) train exactly as one sample per row: the same loss
and the same gradient of every drafter parameter within 1e-5 (of the gradient's largest entry where that
exceeds 1: fp32 sums taken in another order), for every drafter kind, with the frozen target's
features computed through its 4D block-diagonal mask.

Every objective averages its loss per predicted token over the whole batch (heads/losses.py), so the mean is
over the same set of predictions in both layouts; only the order of the sums differs."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import tiny_model
from train_fixtures import conversations, save_tiny_target, write_messages

import heads
from heads.losses import StepStats, target_inputs
from train.config import load_config
from train.data import Sample, collate
from train.features import FeatureCache, OfflineFeatures, OnlineFeatures, needed_layers
from train.objectives import build_objective
from train.packing import first_fit, pack_collate
from train.train_heads import train

TOL = 1e-5
KINDS = [
    ("medusa", {"num_heads": 3}, {"loss": "both"}),
    ("eagle", {}, {"ttt_steps": 3, "loss": "both"}),
    ("eagle3", {"draft_vocab_size": 48}, {"ttt_steps": 3}),
    ("eagle3", {"num_layers": 2}, {"ttt_steps": 2, "loss": "soft"}),
    ("dflash", {"block_size": 4, "anchors_per_sample": 3}, {}),
    ("dflash", {"block_size": 3, "anchors_per_sample": 50}, {"loss": "both"}),
]


def mixed(count: int = 9, seed: int = 0) -> list[Sample]:
    """Samples of 5..40 tokens (ids 3..95 of the tiny vocabulary), the assistant's tokens after a prompt."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        n = rng.randint(5, 40)
        prompt = rng.randint(1, n // 2)
        out.append(Sample(str(i), [rng.randrange(3, 96) for _ in range(n)], [0] * prompt + [1] * (n - prompt)))
    return out


def forward(objective, target, batch, layers, stats=None):
    """Loss and {parameter: gradient} of one step from the same RNG state (DFlash draws anchors)."""
    torch.manual_seed(1)
    features = {i: x.float() for i, x in OnlineFeatures(target, layers).batch(batch).items()}
    objective.zero_grad()
    loss, _ = objective(batch, features, stats=stats)
    if objective.training:
        loss.backward()
    grads = {n: p.grad.clone() for n, p in objective.named_parameters() if p.requires_grad and p.grad is not None}
    return loss.detach(), grads


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


def test_first_fit_packs_longest_first_into_the_first_row_with_room():
    assert first_fit([5, 9, 3, 6, 4], 10) == [[1], [3, 4], [0, 2]]
    batch = pack_collate([Sample("a", [5, 6, 7], [0, 1, 1]), Sample("b", [8, 9], [0, 1]), Sample("c", [4], [1])],
                         [7, 8, 9], pad_id=0, capacity=4)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 4], [8, 9, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0], [0, 1, 0, 0]]
    assert batch["segment_ids"].tolist() == [[1, 1, 1, 2], [1, 1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[False, True, True, True], [False, True, False, False]]
    assert batch["index"].tolist() == [7, 8, 9] and batch["places"].tolist() == [[0, 0, 3], [1, 0, 2], [0, 3, 1]]
    with pytest.raises(ValueError, match="max_length=2"):
        pack_collate([Sample("a", [5, 6, 7], [0, 1, 1])], [0], pad_id=0, capacity=2)


@pytest.mark.parametrize("kind, options, settings", KINDS)
def test_packed_equals_unpacked_loss_and_gradients(target, kind, options, settings):
    config = load_config(None, {"target": "unused", "data": "unused", "drafter": kind, **settings})
    drafter = heads.build(kind, target, **options)
    objective = build_objective(drafter, config).train()
    layers = needed_layers(drafter, target.config.num_hidden_layers, config.loss != "hard")
    samples = mixed()
    indices = list(range(len(samples)))
    unpacked = collate(samples, indices, pad_id=0)
    packed = pack_collate(samples, indices, pad_id=0, capacity=64)
    assert packed["input_ids"].shape[0] < len(samples) and int(packed["segment_ids"].max()) >= 3  # really packed
    loss, grads = forward(objective, target, unpacked, layers)
    loss_p, grads_p = forward(objective, target, packed, layers)
    assert loss > 0 and abs(float(loss - loss_p)) < TOL, (float(loss), float(loss_p))
    assert grads.keys() == grads_p.keys() and grads
    for name, g in grads.items():  # fp32 sums in another order: within 1e-5 of the tensor's scale (at least 1)
        assert (g - grads_p[name]).abs().max() < TOL * max(1.0, float(g.abs().max())), name
    # held-out statistics (per-depth ranks, chains) count the same predictions
    objective.eval()
    steps = heads.get_kind(kind).eval_depth(drafter, config)
    stats, stats_p = StepStats(steps), StepStats(steps)
    forward(objective, target, unpacked, layers, stats)
    forward(objective, target, packed, layers, stats_p)
    assert torch.equal(stats.valid, stats_p.valid) and stats.valid.sum() > 0
    assert torch.equal(stats.ranks, stats_p.ranks) and torch.equal(stats.chain, stats_p.chain)


def test_a_packed_row_read_as_one_sample_gives_another_loss(target):
    """The check above can fail: without the block-diagonal masks and restarting positions (segments and
    positions dropped, as if the row were one long sample) the same packed tokens give another loss."""
    config = load_config(None, {"target": "unused", "data": "unused", "drafter": "eagle", "ttt_steps": 2})
    torch.manual_seed(0)
    drafter = heads.build("eagle", target)
    objective = build_objective(drafter, config).train()
    layers = needed_layers(drafter, target.config.num_hidden_layers, False)
    samples = mixed()
    packed = pack_collate(samples, list(range(len(samples))), pad_id=0, capacity=64)
    leaky = {k: v for k, v in packed.items() if k not in ("segment_ids", "position_ids", "places")}
    assert "position_ids" not in target_inputs(leaky, torch.float32)
    loss, _ = forward(objective, target, collate(samples, list(range(len(samples))), 0), layers)
    loss_leaky, _ = forward(objective, target, leaky, layers)
    assert abs(float(loss - loss_leaky)) > 10 * TOL
    features, features_leaky = (OnlineFeatures(target, layers).batch(b) for b in (packed, leaky))
    assert all((features[i] - features_leaky[i]).abs().max() > 0.1 for i in layers)


def test_offline_features_of_a_packed_batch_are_the_online_ones(target, tmp_path):
    drafter = heads.build("eagle3", target)
    layers = needed_layers(drafter, target.config.num_hidden_layers, True)
    samples = mixed()
    cache = FeatureCache.build(target, samples, layers, tmp_path, "key", dtype="float32", batch_size=4, pad_id=0,
                               progress=False)
    packed = pack_collate(samples, list(range(len(samples))), pad_id=0, capacity=64)
    online = OnlineFeatures(target, layers).batch(packed)
    offline = OfflineFeatures(cache, "cpu").batch(packed)
    tokens = packed["attention_mask"].bool()
    for layer in layers:  # hidden states of the tiny target reach ~50: within 1e-5 of their scale
        x = online[layer][tokens]
        assert (x - offline[layer][tokens]).abs().max() < TOL * max(1.0, float(x.abs().max())), layer


def test_a_feature_cache_holds_no_shard_mapped_between_reads(target, tmp_path):
    """A shard is mapped while a batch reads it only: pages read once an epoch are not kept in the process."""
    from pathlib import Path

    drafter = heads.build("eagle3", target)
    layers = needed_layers(drafter, target.config.num_hidden_layers, False)
    cache = FeatureCache.build(target, mixed(), layers, tmp_path, "key", dtype="float32", batch_size=4, pad_id=0,
                               progress=False)
    shards = sorted(str(p) for p in (tmp_path / "key").glob("shard-*.safetensors"))
    maps = Path("/proc/self/maps")
    if not maps.is_file():
        pytest.skip("no /proc/self/maps to read mappings from")
    assert shards and cache.get([0, 1], 16)[layers[0]].shape[:2] == (2, 16)
    samples = mixed()
    packed = pack_collate(samples, list(range(len(samples))), pad_id=0, capacity=64)
    OfflineFeatures(cache, "cpu").batch(packed)
    import gc

    gc.collect()
    mapped = maps.read_text()
    assert not [s for s in shards if s in mapped]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("pack")
    return {"root": root, "target": save_tiny_target(root / "target"),
            "data": write_messages(root / "data.jsonl", conversations(40))}


@pytest.mark.parametrize("kind, features", [("eagle3", "online"), ("medusa", "offline"), ("dflash", "online")])
def test_packed_training_starts_from_the_same_loss_and_logs_throughput(workspace, kind, features):
    def run(pack: bool) -> dict:
        return train(load_config(None, {
            "target": workspace["target"], "data": workspace["data"], "drafter": kind, "features": features,
            "feature_cache_dir": str(workspace["root"] / "cache"), "output_dir": str(workspace["root"] / f"{kind}{pack}"),
            "batch_size": 8, "max_length": 128, "max_steps": 3, "eval_fraction": 0.2, "pack": pack,
            "progress_bar": False, "log_every": 1}))

    unpacked, packed = run(False), run(True)
    assert abs(unpacked["history"][0]["loss"] - packed["history"][0]["loss"]) < TOL
    for record in packed["history"]:
        assert record["tokens_per_second"] > 0 and record["tokens"] > 0
    assert [r["tokens"] for r in packed["history"]] == [r["tokens"] for r in unpacked["history"]]
    assert abs(unpacked["eval"]["eval_loss"] - packed["eval"]["eval_loss"]) < 1e-3


def test_medusa2_lora_target_runs_packed_rows_through_the_block_diagonal_mask():
    """Medusa-2 trains LoRA on the target inside its objective: the adapted target reads packed rows with the
    same 4D mask and positions, so loss and gradients (the adapters' too) equal one sample per row."""
    from train.train_heads import add_lora

    config = load_config(None, {"target": "unused", "data": "unused", "drafter": "medusa", "lora_r": 4,
                                "loss": "both"})
    target = add_lora(config, tiny_model("llama"))
    torch.manual_seed(0)
    drafter = heads.build("medusa", target.get_base_model(), num_heads=2)
    objective = build_objective(drafter, config, target).train()
    samples = mixed()
    indices = list(range(len(samples)))
    results = []
    for batch in (collate(samples, indices, 0), pack_collate(samples, indices, 0, 64)):
        objective.zero_grad()
        loss, _ = objective(batch, {})
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in objective.named_parameters() if p.grad is not None}))
    (loss, grads), (loss_p, grads_p) = results
    assert abs(float(loss - loss_p)) < TOL and any("lora" in n for n in grads)
    for name, g in grads.items():
        assert (g - grads_p[name]).abs().max() < TOL * max(1.0, float(g.abs().max())), name


def test_packing_a_target_with_narrower_sliding_windows_is_refused(tmp_path):
    target = save_tiny_target(tmp_path / "gemma2", "gemma2")  # sliding_window 16
    data = write_messages(tmp_path / "data.jsonl", conversations(12))
    config = load_config(None, {"target": target, "data": data, "drafter": "medusa", "pack": True, "max_length": 64,
                                "output_dir": str(tmp_path / "out"), "max_steps": 1, "progress_bar": False})
    with pytest.raises(ValueError, match="sliding-window layers see only 16 tokens .* set max_length <= 16, or pack: false"):
        train(config)
