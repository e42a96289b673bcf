"""Run in the peers' own environment (`make peers`: .venv-peers, speculators 0.9.0 and SpecForge 0.2.0), never in
selfspec's: load a checkpoint with the peer's own code and compute its draft logits, for
tests/test_interop_peers.py to compare with selfspec's. Nothing here imports selfspec.

    python tests/peer_checks.py <jobs.json>

jobs.json lists the checks to run in this one process (importing the peers takes most of the time), each
{"check": "speculators", "checkpoint", "inputs", "out"} or {"check": "specforge", "checkpoint", "target", "inputs",
"out"}. An inputs file holds `features` [1, T, 3D] (the target layers concatenated in ascending order, as vLLM and
SGLang capture them), `input_ids` [1, T] (token t + 1 at position t) and `steps` (training-time-test steps: step s
reads token t + 1 + s at position t with the previous step's output hidden state, attending to the prompt up to t
and its own earlier steps, as a draft chain does). Each out file gets `logits` [steps, T, draft vocab] and what was
loaded.
"""

from __future__ import annotations

import sys

import torch


def speculators_logits(checkpoint: str, inputs: dict) -> dict:
    """speculators' `SpeculatorModel.from_pretrained` (eager attention: its default, flex attention, needs a
    compiler), the verifier's embedding loaded over the random one a checkpoint without `embed_tokens` leaves, then
    its own forward (`Eagle3DraftModel.forward`), its lm_head's outputs recorded at each step."""
    from speculators import SpeculatorModel, SpeculatorModelConfig

    config = SpeculatorModelConfig.from_pretrained(checkpoint)
    config.transformer_layer_config._attn_implementation = "eager"
    model = SpeculatorModel.from_pretrained(checkpoint, config=config).eval()
    model._load_verifier_weights(overwrite_embed_tokens=True)
    logits = []
    model.lm_head.register_forward_hook(lambda module, args, out: logits.append(out.detach()[0]))
    ids, steps = inputs["input_ids"], inputs["steps"]
    with torch.no_grad():
        model(hidden_states=inputs["features"], input_ids=ids, document_ids=torch.zeros_like(ids),
              position_ids=torch.arange(ids.shape[1])[None], ttt_steps=steps)
    return {"logits": torch.stack(logits), "class": type(model).__name__,
            "layers": list(model.config.eagle_aux_hidden_state_layer_ids)}


def specforge_logits(checkpoint: str, target: str, inputs: dict) -> dict:
    """SpecForge's EAGLE-3 training model built from the checkpoint's config (`AutoDraftModel.from_config`), warm-started
    from its weights by SpecForge's own `warm_start_draft_model` (which refuses unexpected or missing draft tensors;
    the embedding is the target's, loaded by `load_embedding`), then its training-time-test steps (`backbone` with a
    hidden-state cache, `compute_logits`)."""
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig
    from specforge.modeling.draft.llama3_eagle import prepare_decoder_attention_mask
    from specforge.training.model_loading import warm_start_draft_model

    config = AutoDraftModelConfig.from_file(f"{checkpoint}/config.json")
    model = AutoDraftModel.from_config(config, attention_backend="sdpa").float().eval()
    report = warm_start_draft_model(model, checkpoint, draft_config=config, strategy="ddp",
                                    allow_missing_embedding=True)
    model.load_embedding(target)
    ids, steps = inputs["input_ids"], inputs["steps"]
    t = ids.shape[1]
    positions = torch.arange(t)[None]
    with torch.no_grad():
        hidden = model.project_hidden_states(inputs["features"])
        mask = prepare_decoder_attention_mask(torch.ones_like(ids, dtype=torch.bool), ids.shape, hidden, 0)
        cache, logits = [[], []], []
        for s in range(steps):
            step_ids = torch.cat([ids[:, s:], ids.new_zeros(1, s)], dim=1)
            hidden = model.backbone(model.embed_input_ids(step_ids), hidden, cache, mask, positions, use_cache=False)
            logits.append(model.compute_logits(hidden)[0])
    return {"logits": torch.stack(logits), "class": type(model).__name__, "missing": list(report.missing_keys)}


def main(argv: list[str]) -> None:
    import json

    for job in json.loads(open(argv[0], encoding="utf-8").read()):
        inputs = torch.load(job["inputs"])
        if job["check"] == "speculators":
            out = speculators_logits(job["checkpoint"], inputs)
        elif job["check"] == "specforge":
            out = specforge_logits(job["checkpoint"], job["target"], inputs)
        else:
            raise SystemExit(f"unknown check {job['check']!r}; see the docstring")
        torch.save(out, job["out"])


if __name__ == "__main__":
    main(sys.argv[1:])
