"""target_sharding: fsdp (train/sharding.py): the frozen target split across 2 gloo processes on CPU holds about
half its weights on each, gives the unsharded target's features and loss, and trains, checkpoints and resumes
to the unsharded run's losses.

Run as a script under torch.distributed.run, this file is the per-process side of the features check.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 1e-5
LAYERS = 6  # the tiny target's decoder layers: most of its weights, so a split leaves ~55% per process


def launch(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from train_fixtures import conversations, save_tiny_target, write_messages

    root = tmp_path_factory.mktemp("sharded")
    return {"root": root, "target": save_tiny_target(root / "target", num_hidden_layers=LAYERS),
            "data": write_messages(root / "data.jsonl", conversations(48))}


def test_sharded_features_and_loss_equal_the_whole_target(workspace):
    out = workspace["root"] / "features"
    launch([__file__, workspace["target"], str(out)])
    for rank in range(2):
        got = json.loads((out / f"rank{rank}.json").read_text())
        assert got["share"] < 0.6, got
        assert got["layers_sharded"] == LAYERS
        assert got["feature_diff"] <= TOLERANCE, got
        assert abs(got["loss_sharded"] - got["loss_whole"]) <= TOLERANCE, got


def train_args(workspace, out: str, *extra: str) -> list[str]:
    return [str(ROOT / "train" / "train_heads.py"), f"target={workspace['target']}", f"data={workspace['data']}",
            "drafter=eagle", "batch_size=4", "max_steps=4", "eval_fraction=0.2", "ttt_steps=2", "log_every=0",
            "progress_bar=false", "lr=3e-3", f"output_dir={workspace['root'] / out}",
            f"feature_cache_dir={workspace['root'] / 'cache'}", *extra]


def losses(workspace, out: str) -> list[float]:
    lines = (workspace["root"] / out / "history.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def test_sharded_training_equals_the_unsharded_run_and_resumes(workspace):
    launch(train_args(workspace, "whole"))
    halted = launch(train_args(workspace, "sharded", "target_sharding=fsdp", "save_every=2", "halt_after_steps=2"))
    shares = {int(m[0]): float(m[1]) for m in
              re.findall(r"\[target\] process (\d)/2 holds ([\d.]+)% of the target's parameters", halted.stdout)}
    assert set(shares) == {0, 1} and all(s < 60 for s in shares.values()), halted.stdout[-2000:]
    assert not (workspace["root"] / "sharded" / "result.json").exists()  # halted as a kill would
    launch(train_args(workspace, "sharded", "target_sharding=fsdp", "save_every=2", "--resume"))
    whole, sharded = losses(workspace, "whole"), losses(workspace, "sharded")
    assert len(whole) == len(sharded) == 4
    assert max(abs(a - b) for a, b in zip(whole, sharded, strict=True)) <= TOLERANCE, (whole, sharded)
    result = json.loads((workspace["root"] / "sharded" / "result.json").read_text())
    assert result["eval"]["eval_loss"] == pytest.approx(
        json.loads((workspace["root"] / "whole" / "result.json").read_text())["eval"]["eval_loss"], abs=TOLERANCE)


# ---- bad settings, refused before the data or the target load ------------------------------------------------

def test_one_process_cannot_shard(workspace):
    from train.config import load_config
    from train.train_heads import train

    config = load_config(None, {"target": workspace["target"], "data": str(workspace["root"] / "missing.jsonl"),
                                "target_sharding": "fsdp", "output_dir": str(workspace["root"] / "one"),
                                "progress_bar": False})
    with pytest.raises(ValueError, match="has 1 process; launch 2 or more"):
        train(config)  # the missing data file would fail later: the sharding check comes first


def test_lora_and_unknown_modes_are_refused():
    from train.config import load_config
    from train.sharding import check_sharding

    with pytest.raises(ValueError, match="lora_r > 0"):
        check_sharding("fsdp", 2, lora_r=8)
    with pytest.raises(ValueError, match="'target_sharding' must be one of"):
        load_config(None, {"data": "d.jsonl", "target_sharding": "zero3"})


def test_targets_that_cannot_be_split_by_layers():
    from conftest import tiny_model

    from train.sharding import check_shardable, decoder_layers

    model = tiny_model("llama")
    model.config.num_hidden_layers = 99  # no list of that many layers
    with pytest.raises(ValueError, match="has no list of 99 layers"):
        decoder_layers(model)
    model = tiny_model("llama")
    model.extra = torch.nn.Linear(32, 32, bias=False)
    model.extra.weight = model.model.layers[0].self_attn.q_proj.weight  # a layer's weight used outside it
    with pytest.raises(ValueError, match="share weights with other modules"):
        check_shardable(model, decoder_layers(model))
    gpt2 = tiny_model("gpt2")
    assert decoder_layers(gpt2) is gpt2.transformer.h  # found by its length, not by a name


def _features_worker(target_path: str, out: str) -> None:
    """One process of the features check: the same target whole and sharded, features and an EAGLE loss."""
    import torch.distributed as dist

    import heads
    from train.config import load_config
    from train.features import target_hidden_states
    from train.objectives import build_objective
    from train.sharding import local_parameters, shard_target
    from train.target import load_target

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    whole, tokenizer = load_target(target_path)
    sharded, _ = load_target(target_path)
    total = sum(p.numel() for p in whole.parameters())
    share = shard_target(sharded, torch.device("cpu"), dist.get_world_size())
    assert share == local_parameters(sharded) / total
    g = torch.Generator().manual_seed(rank)  # each process its own batch: the all-gathers must not mix them
    ids = torch.randint(3, 90, (3, 12), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 9:] = 0
    layers = tuple(range(LAYERS + 1))
    a = target_hidden_states(sharded, ids, attn, layers)
    b = target_hidden_states(whole, ids, attn, layers)
    diff = max(float((a[k] - b[k]).abs().max()) for k in layers)
    config = load_config(None, {"data": "unused.jsonl", "ttt_steps": 2, "loss": "both"})
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": attn.bool(), "index": torch.arange(3)}
    loss = {}
    for name, target, feats in (("sharded", sharded, a), ("whole", whole, b)):
        torch.manual_seed(0)
        drafter = heads.build("eagle", target, tokenizer=tokenizer)  # borrows this target's embedding and lm_head
        objective = build_objective(drafter, config).eval()
        layers_needed = {k: feats[k] for k in (*drafter.feature_layers, LAYERS)}
        with torch.no_grad():
            loss[name] = float(objective(batch, layers_needed)[0])
    sharded_layers = sum(any(hasattr(p, "to_local") for p in layer.parameters()) for layer in sharded.model.layers)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps({
        "share": share, "feature_diff": diff, "loss_sharded": loss["sharded"], "loss_whole": loss["whole"],
        "layers_sharded": sharded_layers}))
    dist.destroy_process_group()


if __name__ == "__main__":
    _features_worker(*sys.argv[1:3])
