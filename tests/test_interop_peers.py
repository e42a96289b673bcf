"""selfspec's exports read by the peers' own code, and a peer's conversion read by selfspec (issue 56), in the
peers' environment (`make peers`: .venv-peers with speculators 0.9.0 and SpecForge 0.2.0; skipped, saying so, where
it is not built). Each check runs the peer in a subprocess with that environment's python (tests/peer_checks.py),
on tiny models (seconds each):

- every speculators export of ours (the paper layout, two layers, layers listed out of order, speculators' own
  defaults with norm_before_fc, norm_output and a sliding window, the whole vocabulary) loads with speculators'
  `SpeculatorModel.from_pretrained` and its forward gives our draft logits, over three training-time-test steps
  (the first only where a window cuts in: speculators' training masks measure the window from the chain's root,
  vLLM and selfspec from the draft's own position);
- every SGLang export warm-starts SpecForge's EAGLE-3 training model (`AutoDraftModel.from_config`, then its
  `warm_start_draft_model`, which refuses unexpected or missing tensors) and its steps give our logits;
- `speculators convert` of an EAGLE authors' EAGLE-3 folder imports into selfspec and drafts what their checkpoint
  drafts, with generation exact.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from foreign_checkpoints import write_eagle_authors, write_speculators_defaults
from transformers import AutoModelForCausalLM, DynamicCache

import heads
from heads.export import export_sglang, export_speculators
from infer import SelfSpecModel

ROOT = Path(__file__).resolve().parent.parent
PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
CHECKS = ROOT / "tests" / "peer_checks.py"
STEPS = 3
PROMPT = torch.tensor([[5, 17, 42, 8, 66, 23, 9, 71, 30, 12]])

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def peers() -> Path:
    if not (ROOT / ".venv-peers" / ".peers").exists():
        pytest.skip(f"no peers environment at {PEERS_PYTHON.parent.parent} (speculators 0.9.0, SpecForge 0.2.0): run "
                    "`make peers`")
    return PEERS_PYTHON


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    """The 8-layer tiny Llama saved as a folder: the peers read the verifier's config and embedding from it."""
    from foreign_checkpoints import target_model

    folder = tmp_path_factory.mktemp("peers") / "target"
    target_model().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def target(target_dir):
    return AutoModelForCausalLM.from_pretrained(target_dir).eval()


def peers_run(python: Path, jobs: list[dict], tmp_path: Path) -> list[dict]:
    """tests/peer_checks.py's `jobs` in one process of the peers' environment; what each wrote."""
    (tmp_path / "jobs.json").write_text(json.dumps([{k: str(v) for k, v in job.items()} for job in jobs]))
    run = subprocess.run([str(python), str(CHECKS), str(tmp_path / "jobs.json")], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return [torch.load(job["out"]) for job in jobs]


def perturbed(drafter, seed: int = 3):
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.1)
    return drafter


def inputs_for(target, layers, path: Path) -> Path:
    """The peers' inputs, saved at `path`: the prompt's features at `layers` in ascending order, and its tokens
    shifted by one."""
    with torch.no_grad():
        out = target(PROMPT, output_hidden_states=True)
    ids = torch.cat([PROMPT[:, 1:], out.logits[:, -1:].argmax(-1)], dim=1)
    torch.save({"features": torch.cat([out.hidden_states[i] for i in sorted(layers)], dim=-1), "input_ids": ids,
                "steps": STEPS}, path)
    return path


def our_steps(drafter, target, steps: int) -> torch.Tensor:
    """Our drafter over the same training-time-test steps: step s puts token t + 1 + s at position t + s, with the
    step before's output hidden state, seeing the prompt up to t and its own earlier steps. [steps, T, Vd]."""
    drafter = drafter.attach(target).eval()
    with torch.no_grad():
        out = target(PROMPT, output_hidden_states=True)
        ids = torch.cat([PROMPT[:, 1:], out.logits[:, -1:].argmax(-1)], dim=1)
        t = ids.shape[1]
        hidden = drafter.fuse_features(tuple(out.hidden_states[i] for i in drafter.feature_layers))
        cache, logits = DynamicCache(), []
        for s in range(steps):
            allowed = torch.zeros(t, (s + 1) * t, dtype=torch.bool)
            allowed[:, :t] = torch.ones(t, t, dtype=torch.bool).tril()
            for j in range(1, s + 1):
                allowed[:, j * t:(j + 1) * t] = torch.eye(t, dtype=torch.bool)
            mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
            if drafter.config.layer_windows:
                mask = {"full_attention": mask, "sliding_attention": _windowed(mask, drafter, s, t)}
            step_ids = torch.cat([ids[:, s:], ids.new_zeros(1, s)], dim=1)
            hidden, step_logits = drafter(step_ids, hidden, attention_mask=mask, position_ids=torch.arange(t)[None] + s,
                                          past_key_values=cache, fused=s == 0)
            logits.append(step_logits[0])
    return torch.stack(logits)


def _windowed(mask, drafter, s: int, t: int):
    """Step 0's mask cut to the window (the only step compared where a window cuts in)."""
    assert s == 0
    window = next(w for w in drafter.config.layer_windows if w is not None)
    pos = torch.arange(t)
    return mask.masked_fill((pos[:, None] - pos[None, :] >= window)[None, None], torch.finfo(torch.float32).min)


def speculators_drafters(target, tmp_path: Path) -> dict:
    """Our EAGLE-3 drafters of each kind the speculators export writes."""
    theirs = tmp_path / "speculators_defaults"
    write_speculators_defaults(theirs, target, window=None, seed=6)
    windowed = tmp_path / "speculators_windowed"
    write_speculators_defaults(windowed, target, seed=6)
    return {
        "paper, layers out of order": perturbed(heads.build("eagle3", target, feature_layers=[6, 2, 4],
                                                            draft_vocab_size=48)),
        "two layers": perturbed(heads.build("eagle3", target, num_layers=2, draft_vocab_size=48)),
        "norm_before_residual, whole vocabulary": perturbed(heads.build("eagle3", target, norm_before_residual=True)),
        "speculators defaults, no window": heads.load(theirs, target=target),
        "speculators defaults": heads.load(windowed, target=target),
    }


def test_speculators_loads_every_speculators_export_and_computes_our_logits(peers, target, tmp_path):
    drafters, jobs = speculators_drafters(target, tmp_path), []
    for i, drafter in enumerate(drafters.values()):
        folder = tmp_path / "exports" / f"speculators_{i}"
        export_speculators(drafter, folder)
        jobs.append({"check": "speculators", "checkpoint": folder, "out": tmp_path / f"out_{i}.pt",
                     "inputs": inputs_for(target, drafter.feature_layers, tmp_path / f"inputs_{i}.pt")})
    for (name, drafter), theirs in zip(drafters.items(), peers_run(peers, jobs, tmp_path), strict=True):
        assert theirs["class"] == "Eagle3DraftModel" and theirs["layers"] == sorted(drafter.feature_layers), name
        steps = 1 if drafter.config.layer_windows else STEPS
        torch.testing.assert_close(theirs["logits"][:steps], our_steps(drafter, target, steps), rtol=1e-4, atol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_specforge_warm_starts_from_every_sglang_export_and_computes_our_logits(peers, target, target_dir, tmp_path):
    drafters, jobs = {
        "layers out of order": perturbed(heads.build("eagle3", target, feature_layers=[6, 2, 4], draft_vocab_size=48)),
        "whole vocabulary": perturbed(heads.build("eagle3", target, feature_layers=[2, 4, 5])),
    }, []
    for i, drafter in enumerate(drafters.values()):
        folder = tmp_path / "exports" / f"sglang_{i}"
        export_sglang(drafter, folder)
        jobs.append({"check": "specforge", "checkpoint": folder, "target": target_dir, "out": tmp_path / f"out_{i}.pt",
                     "inputs": inputs_for(target, drafter.feature_layers, tmp_path / f"inputs_{i}.pt")})
    for (name, drafter), theirs in zip(drafters.items(), peers_run(peers, jobs, tmp_path), strict=True):
        assert theirs["class"] == "LlamaForCausalLMEagle3" and theirs["missing"] == ["embed_tokens.weight"], name
        torch.testing.assert_close(theirs["logits"], our_steps(drafter, target, STEPS), rtol=1e-4, atol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_speculators_convert_of_an_eagle_authors_folder_imports_and_runs_exact(peers, target, target_dir, tmp_path):
    write_eagle_authors(tmp_path / "eagle", target)
    converted = tmp_path / "converted"
    run = subprocess.run([str(peers), "-m", "speculators", "convert", str(tmp_path / "eagle"), "--verifier",
                          str(target_dir), "--algorithm", "eagle3", "--output-path", str(converted),
                          "--validate-device", "cpu", "--algorithm-kwargs",
                          json.dumps({"eagle_aux_hidden_state_layer_ids": [2, 4, 5]})],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert heads.imported_format(converted).name == "speculators"
    ours = heads.load(converted, target=target)
    original = heads.load(tmp_path / "eagle", target=target)
    assert list(ours.feature_layers) == list(original.feature_layers) == [2, 4, 5]
    torch.testing.assert_close(our_steps(ours, target, STEPS), our_steps(original, target, STEPS), rtol=1e-3,
                               atol=1e-3)  # their converter keeps the fp16 weights; ours are read as fp32
    expected = target.generate(PROMPT, do_sample=False, max_new_tokens=24, eos_token_id=None, pad_token_id=0)
    spec = SelfSpecModel.from_pretrained(str(converted), target=target)
    assert torch.equal(spec.generate(PROMPT, max_new_tokens=24, eos_token_id=[]), expected)
