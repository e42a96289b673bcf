"""The trainers the benchmark compares, each as a `train.apps.bench.trainer_runs.Runner`: its command, resume switch,
export and the folder selfspec imports.

    selfspec           train/train_heads.py with configs/smollm2_eagle3.yaml (its recommended EAGLE-3 recipe) at
                       TTT depth 7, one pass over the rows, nothing held out, on its offline feature cache
    specforge          SpecForge 0.2.0's `specforge train` (offline EAGLE-3, its defaults: batch 1, lr 1e-4, cosine
                       with 1.5% warm-up, its draft-vocabulary mapping from the rows) through peer_cpu/specforge_cpu.py,
                       then `specforge export --to sglang`
    speculators        speculators 0.9.0's `speculators train` at its EAGLE-3 defaults (norm before fc, normed output
                       fed back, sliding-window attention layer, kl_div, Muon) through peer_cpu/speculators_cpu.py;
                       its checkpoint folder is imported as it is
    speculators-paper  the same in the EAGLE-3 paper's layout (no norm before fc or residual, no normed output, full
                       attention)

The peers run in their own environment (`make peers`, `--peers-python`), one process each, on the features
`train.apps.bench.trainer_data.capture` wrote. All at TTT depth 7, a draft vocabulary of 8192 tokens, one epoch over the
same rows; each trainer's other settings are its own.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from train.apps.bench.trainer_data import Layouts, speculators_train_ratio
from train.apps.bench.trainer_runs import Runner

ROOT = Path(__file__).resolve().parents[3]
PEER_CPU = Path(__file__).resolve().parent / "peer_cpu"
TTT_DEPTH = 7
DRAFT_VOCAB = 8192
CHECKPOINTS = 10  # checkpoints a run saves over its course, so a kill loses at most a tenth of it
SELFSPEC_CONFIG = ROOT / "configs" / "smollm2_eagle3.yaml"


@dataclass(frozen=True)
class PeerNames:
    """The peers' own names for what every framework here trains."""

    algorithm: str = "eagle3"  # specforge's `training.strategy`, speculators' `--speculator-type`


PEER = PeerNames()
SELFSPEC_BATCH = 8  # configs/smollm2_eagle3.yaml's batch_size: its steps, for save_every

# The CPU patches each run relies on, for the report's notes (the wrappers' docstrings say why).
PATCHES = {
    "selfspec": "none",
    "specforge": "peer_cpu/specforge_cpu.py: the Triton KL loss (LogSoftmaxLoss) replaced by its plain-torch form; "
                 "config fsdp_sharding NO_SHARD (DDP on gloo), attention_backend sdpa, torch_dtype bfloat16",
    "speculators": "peer_cpu/speculators_cpu.py: device 'cpu' for the trainer's local_rank, autocast device and "
                   "resume loads; no accelerator synchronize in the step timer; flags --draft-attn-impl sdpa "
                   "--loss-implementation eager --num-workers 0 --on-missing raise",
}
PATCHES["speculators-paper"] = PATCHES["speculators"]
PAPER_FLAGS = ["--no-norm-before-residual", "--no-norm-output", "--no-norm-before-fc", "--full-attention-indices", "0"]
FRAMEWORKS = ("selfspec", "specforge", "speculators", "speculators-paper")
PEERS = frozenset(FRAMEWORKS) - {"selfspec"}


@dataclass
class Setup:
    """What every runner reads: the prepared inputs and the settings shared by all runs."""

    work: Path
    rows_file: Path  # rows.jsonl, selfspec's data
    rows: int
    layouts: Layouts
    target_name: str  # what selfspec's run is given as its target
    peer_target: Path  # the target as a plain HF folder, for the peers
    target_config: dict  # the target's config.json
    max_length: int
    threads: int
    peers_python: Path
    speculators_seq_len: int
    python: Path = Path(sys.executable)
    # key=value settings of train/train_heads.py after the recipe's (a variant of selfspec's recipe, measured on the
    # same rows: its runs go to folders of their own, `selfspec_label`)
    selfspec_overrides: tuple[str, ...] = ()


def runner(name: str, setup: Setup, seed: int) -> Runner:
    if name not in FRAMEWORKS:
        raise ValueError(f"unknown framework {name!r}; the frameworks are {', '.join(FRAMEWORKS)}")
    env = {"OMP_NUM_THREADS": str(setup.threads), "MKL_NUM_THREADS": str(setup.threads),
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    if name == "selfspec":
        return Runner(name, partial(selfspec_command, setup, seed), selfspec_checkpointed,
                      lambda folder: folder / "out" / "drafter", fresh=partial(remove, "out"),
                      verify=partial(selfspec_used_the_capture, setup), env=env, cwd=ROOT)
    if name == "specforge":
        return Runner(name, partial(specforge_command, setup, seed), specforge_checkpointed,
                      lambda folder: folder / "drafter", exports=partial(specforge_export, setup),
                      fresh=partial(remove, "out"), env={**env, "SPECFORGE_DEVICE": "cpu"})
    return Runner(name, partial(speculators_command, setup, seed, name == "speculators-paper"),
                  lambda folder: last_checkpoint(folder / "out") is not None,
                  lambda folder: last_checkpoint(folder / "out") or folder / "out" / "no-checkpoint",
                  fresh=partial(remove, "out"), env=env)


def remove(name: str, folder: Path) -> None:
    shutil.rmtree(folder / name, ignore_errors=True)


def every(steps: int) -> int:
    return max(1, steps // CHECKPOINTS)


# ---- selfspec ---------------------------------------------------------------------------------------------------
def selfspec_label(overrides: tuple[str, ...]) -> str:
    """The name of selfspec's runs: "selfspec", or with a variant's settings, "selfspec[key=value,...]"."""
    return f"selfspec[{','.join(overrides)}]" if overrides else "selfspec"


def selfspec_command(setup: Setup, seed: int, folder: Path, resume: bool) -> list[str]:
    batch = next((int(o.split("=", 1)[1]) for o in reversed(setup.selfspec_overrides) if o.startswith("batch_size=")),
                 SELFSPEC_BATCH)
    steps = -(-setup.rows // batch)
    argv = [str(setup.python), str(ROOT / "train" / "train_heads.py"), "--config", str(SELFSPEC_CONFIG),
            f"target={setup.target_name}", f"data={setup.rows_file}", f"max_length={setup.max_length}",
            f"ttt_steps={TTT_DEPTH}", "epochs=1", "max_steps=0", "eval_fraction=0",
            f"drafter_options={{draft_vocab_size: {DRAFT_VOCAB}}}", "features=offline",
            f"feature_cache_dir={setup.layouts.selfspec_root}", f"output_dir={folder / 'out'}", f"seed={seed}",
            f"save_every={every(steps)}", "keep_checkpoints=2", "progress_bar=false", "log_every=10",
            *setup.selfspec_overrides]
    return [*argv, "--resume"] if resume else argv


def selfspec_used_the_capture(setup: Setup, folder: Path) -> str | None:
    """selfspec tokenizes rows.jsonl itself; its feature cache's key hashes the ids it got, so a cache beside the
    captured one means other ids than the peers'."""
    root = setup.layouts.selfspec_root
    others = sorted(p.name for p in root.iterdir() if p.name != setup.layouts.selfspec_key and not p.name.startswith("."))
    if others:
        return (f"its training tokenized the rows otherwise than the benchmark did (it built the feature cache "
                f"{root / others[0]} beside the captured {setup.layouts.selfspec}), so it did not train on the peers' "
                "token ids; check the target's tokenizer and chat template, then remove that cache and run again")
    return None


def selfspec_checkpointed(folder: Path) -> bool:
    return any((folder / "out" / "checkpoints").glob("step_*"))


# ---- SpecForge --------------------------------------------------------------------------------------------------
def specforge_command(setup: Setup, seed: int, folder: Path, resume: bool) -> list[str]:
    """Writes the run's config (run.yaml) and SpecForge's draft config (draft.json), then its command."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "draft.json").write_text(json.dumps(specforge_draft_config(setup.target_config), indent=2) + "\n")
    (folder / "run.yaml").write_text(json.dumps(specforge_config(setup, seed, folder), indent=2) + "\n")
    argv = [str(setup.peers_python), str(PEER_CPU / "specforge_cpu.py"), "train", "--config", str(folder / "run.yaml")]
    return [*argv, f"training.resume_from={folder / 'out'}"] if resume else argv


def specforge_config(setup: Setup, seed: int, folder: Path) -> dict:
    """An offline EAGLE-3 run at SpecForge's defaults but for what the CPU needs and what the benchmark fixes (one
    epoch, TTT 7, max_length, the seed). JSON is YAML, and SpecForge reads either."""
    tied = setup.target_config.get("tie_word_embeddings", False)
    return {
        "model": {"target_model_path": str(setup.peer_target), "draft_model_config": str(folder / "draft.json"),
                  "target_backend": "sglang", "embedding_key": "model.embed_tokens.weight",
                  "lm_head_key": "model.embed_tokens.weight" if tied else "lm_head.weight",
                  "torch_dtype": "bfloat16"},
        "data": {"hidden_states_path": str(setup.layouts.specforge), "max_length": setup.max_length,
                 "cache_dir": str(folder / "cache"), "dataloader_num_workers": 0},
        "training": {"strategy": PEER.algorithm, "num_epochs": 1, "batch_size": 1, "ttt_length": TTT_DEPTH,
                     "attention_backend": "sdpa", "fsdp_sharding": "NO_SHARD", "log_interval": 10,
                     "save_interval": every(setup.rows), "max_checkpoints": 2, "seed": seed},
        "run_id": "bench", "output_dir": str(folder / "out"),
        "deployment": {"mode": "local_colocated", "trainer": {"nnodes": 1, "nproc_per_node": 1}},
    }


def specforge_draft_config(target: dict) -> dict:
    """SpecForge's one-layer LlamaForCausalLMEagle3 at the target's sizes (its own example configs' layout)."""
    rope = target.get("rope_theta") or (target.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "hidden_act",
            "rms_norm_eps", "max_position_embeddings", "bos_token_id", "eos_token_id", "vocab_size")
    heads = target["num_attention_heads"]
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **{k: target[k] for k in keys},
            "head_dim": target.get("head_dim") or target["hidden_size"] // heads, "num_hidden_layers": 1,
            "pad_token_id": target.get("pad_token_id", target["eos_token_id"]), "rope_theta": rope,
            "tie_word_embeddings": False, "draft_vocab_size": DRAFT_VOCAB}


def specforge_checkpointed(folder: Path) -> bool:
    return any(p.is_dir() for p in (folder / "out").glob("bench-step*"))


def specforge_export(setup: Setup, folder: Path) -> list[list[str]]:
    shutil.rmtree(folder / "drafter", ignore_errors=True)  # a half-written export from a killed run
    return [[str(setup.peers_python), str(PEER_CPU / "specforge_cpu.py"), "export", "--to", "sglang",
             "--checkpoint", str(folder / "out" / "bench-latest"), "--draft-config", str(folder / "draft.json"),
             "--output-dir", str(folder / "drafter")]]


# ---- speculators ------------------------------------------------------------------------------------------------
def speculators_command(setup: Setup, seed: int, paper: bool, folder: Path, resume: bool) -> list[str]:
    """speculators resumes from the newest checkpoint in --save-path by itself, so `resume` changes nothing."""
    argv = [str(setup.peers_python), str(PEER_CPU / "speculators_cpu.py"), "--speculator-type", PEER.algorithm,
            "--verifier-name-or-path", str(setup.peer_target), "--data-path", str(setup.layouts.speculators),
            "--save-path", str(folder / "out"), "--draft-vocab-size", str(DRAFT_VOCAB),
            "--ttt-steps", str(TTT_DEPTH), "--epochs", "1", "--train-data-ratio", repr(speculators_train_ratio(setup.rows)),
            "--total-seq-len", str(setup.speculators_seq_len), "--checkpoint-freq", repr(1 / CHECKPOINTS),
            "--seed", str(seed), "--log-freq", "10", "--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
            "--num-workers", "0", "--on-missing", "raise"]
    return [*argv, *PAPER_FLAGS] if paper else argv


def last_checkpoint(out: Path) -> Path | None:
    """speculators' newest checkpoint: the highest-numbered folder (its symlinks only name them)."""
    numbered = [p for p in out.glob("*") if p.is_dir() and not p.is_symlink() and p.name.isdigit()] \
        if out.is_dir() else []
    return max(numbered, key=lambda p: int(p.name)) if numbered else None
