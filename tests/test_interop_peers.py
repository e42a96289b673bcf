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
  drafts, with generation exact;
- the EAGLE authors' EAGLE-1/2 model (eagle-llm 1.2.1), FasterDecoding's Medusa heads (medusa-llm 0.1) and z-lab's
  DFlash model (dflash 0.1.0), which `make peers` installs beside them, load the fixtures of tests/
  foreign_checkpoints.py as their own loaders do and draft what selfspec drafts from them (z-lab's first block
  through its generation loop's own helpers). eagle-llm 1.2.1 predates EAGLE-3 and rotates at base 10000 without q/k/v biases, so the EAGLE-3
  fixtures and the EAGLE-1 layouts with rope_theta or qkv_bias (EAGLE-LLaMA3-Instruct-8B's, their Qwen2 drafters')
  follow their repository's source (SafeAILab/EAGLE eagle/model/cnets.py and cnets1.py at commit cb7e084), as
  tests/test_import_formats.py computes them; its Vicuna layout runs here.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from foreign_checkpoints import (
    write_dflash_zlab,
    write_eagle1_authors,
    write_eagle_authors,
    write_medusa_fd,
    write_speculators_defaults,
)
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
    """The 8-layer tiny Llama saved as a folder with a word-level tokenizer of its vocabulary: the peers read the
    verifier's config and embedding from it (and Medusa's model its tokenizer)."""
    from foreign_checkpoints import target_model
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("peers") / "target"
    model = target_model()
    model.save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0"))).save_pretrained(folder)
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


def first_tree(drafter, target, **tree):
    """Our drafter's first proposal below the prompt's root."""
    from infer.drafting import TargetStep
    from infer.sampling import SamplingParams

    proposer = drafter.as_drafter(**tree)
    proposer.bind(target, SamplingParams(), batch_size=1)
    with torch.no_grad():
        out = target(PROMPT, output_hidden_states=True)
        root = out.logits[0, -1].argmax()
        proposer.observe(TargetStep(tokens=PROMPT, valid=torch.ones_like(PROMPT, dtype=torch.bool),
                                    hidden=tuple(out.hidden_states[i] for i in proposer.feature_layers),
                                    next_tokens=root[None]))
        return proposer, proposer.propose(torch.tensor([16]))


def test_the_authors_model_code_loads_our_fixtures_and_drafts_what_we_draft(peers, target, target_dir, tmp_path):
    """eagle-llm's EAGLE-1/2 model in each published layout, medusa-llm's heads, z-lab's DFlash model and loop."""
    with torch.no_grad():
        out = target(PROMPT, output_hidden_states=True)
    ids = torch.cat([PROMPT[:, 1:], out.logits[:, -1:].argmax(-1)], dim=1)
    torch.save({"features": out.hidden_states[-1], "input_ids": ids, "steps": STEPS, "prompt": PROMPT},
               tmp_path / "inputs.pt")
    layouts = ("vicuna",)  # eagle-llm 1.2.1 reads neither rope_theta nor qkv_bias (peer_checks.eagle1_chain)
    for layout in layouts:
        write_eagle1_authors(tmp_path / f"eagle1_{layout}", target, layout=layout)
    write_medusa_fd(tmp_path / "medusa", target, num_layers=2, pt=True)
    write_dflash_zlab(tmp_path / "dflash", target)
    jobs = [{"check": "eagle1", "checkpoint": tmp_path / f"eagle1_{layout}"} for layout in layouts]
    jobs += [{"check": "medusa", "checkpoint": tmp_path / "medusa"}, {"check": "dflash", "checkpoint": tmp_path / "dflash"}]
    for i, job in enumerate(jobs):
        job.update(target=target_dir, inputs=tmp_path / "inputs.pt", out=tmp_path / f"out_{i}.pt")
    results = peers_run(peers, jobs, tmp_path)
    for layout, theirs in zip(layouts, results, strict=False):
        # their loader matches every tensor but the embedding copy, which the target's replaces in both
        assert theirs["missing"] == [] and theirs["unexpected"] == [], (layout, theirs)
        ours = heads.load(tmp_path / f"eagle1_{layout}", target=target)
        _, tree = first_tree(ours, target, top_k=1, depth=STEPS, total_tokens=STEPS)
        assert tree.tokens[0, 1:STEPS + 1].tolist() == theirs["chain"], layout
    medusa, dflash = results[-2:]
    assert medusa["missing"] == [] and medusa["unexpected"] == []
    ours = heads.load(tmp_path / "medusa", target=target).attach(target)
    with torch.no_grad():
        our_logits = ours(out.hidden_states[-1])
    torch.testing.assert_close(torch.stack(list(our_logits))[:, 0] if isinstance(our_logits, (list, tuple))
                               else our_logits[:, 0], medusa["logits"], rtol=1e-4, atol=1e-4)
    ours = heads.load(tmp_path / "dflash", target=target)
    assert sorted(i - 1 for i in ours.feature_layers) == sorted(dflash["layers"])
    _, tree = first_tree(ours, target)
    assert tree.tokens[0, 1:].tolist() == dflash["first_block"]
