"""Run in the peers' own environment (`make peers`: .venv-peers, speculators 0.9.0 and SpecForge 0.2.0), never in
selfspec's: load a checkpoint with the peer's own code and compute its draft logits, for
tests/test_interop_peers.py to compare with selfspec's. Nothing here imports selfspec.

    python tests/peer_checks.py <jobs.json>

jobs.json lists the checks to run in this one process (importing the peers takes most of the time), each
{"check": "speculators", "checkpoint", "inputs", "out"} or {"check": "specforge", "checkpoint", "target", "inputs",
"out"}, or {"check": "eagle1" | "medusa" | "dflash", "checkpoint", "target", "inputs", "out"} (the EAGLE authors',
FasterDecoding's and z-lab's own model code from PyPI: eagle-llm 1.2.1, medusa-llm 0.1, dflash 0.1.0). An inputs
file holds `features` [1, T, 3D] (the target layers concatenated in ascending order, as vLLM and
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


def eagle1_chain(checkpoint: str, target_dir: str, inputs: dict) -> dict:
    """The EAGLE authors' EAGLE-1/2 model (PyPI eagle-llm 1.2.1, `eagle.model.cnets.Model`, what its `EaModel`
    builds: fc's bias as the config's `bias`, default true), its state loaded as `EaModel` loads it (strict=False, the
    keys it matched recorded), over the prompt and then a greedy chain fed back through its own KV cache, the
    target's lm_head on its output as their drafting does. That release rotates at base 10000 whatever the config's
    rope_theta and has no q/k/v biases (their repository's cnets1.py reads both since): only their Vicuna-layout
    drafters compute the same in it."""
    import json

    from eagle.model.cnets import Model
    from eagle.model.configs import EConfig
    from transformers import AutoModelForCausalLM

    bias = json.loads(open(f"{checkpoint}/config.json", encoding="utf-8").read()).get("bias", True)
    config = EConfig.from_pretrained(checkpoint)
    # transformers 5 reads a config without RoPE scaling as {"rope_type": "default", ...}, where the transformers 4 their
    # code was written for read None: give it what it reads (it rotates at base 10000 either way)
    if (config.rope_scaling or {}).get("rope_type") == "default":
        config.rope_scaling = None
    model = Model(config, bias=bias).float().eval()
    result = model.load_state_dict(torch.load(f"{checkpoint}/pytorch_model.bin"), strict=False)
    head = AutoModelForCausalLM.from_pretrained(target_dir).lm_head
    chain = []
    with torch.no_grad():
        out, cache = model(inputs["features"], input_ids=inputs["input_ids"], use_cache=True)
        for _ in range(inputs["steps"]):
            chain.append(int(head(out[:, -1]).argmax()))
            out, cache = model(out[:, -1:], input_ids=torch.tensor([chain[-1:]]), past_key_values=cache,
                               use_cache=True)
    return {"chain": chain, "missing": list(result.missing_keys), "unexpected": list(result.unexpected_keys)}


def medusa_logits(checkpoint: str, target_dir: str, inputs: dict) -> dict:
    """FasterDecoding's Medusa heads (PyPI medusa-llm 0.1, `medusa.model.medusa_model.MedusaModel` over the target, as
    its `from_pretrained` builds them from the config), `medusa_lm_head.pt` loaded as it loads it (strict=False, the
    keys it matched recorded), then its forward: each head's logits from the target's last hidden state."""
    from medusa.model.medusa_model import MedusaConfig, MedusaModel
    from transformers import AutoModelForCausalLM

    config = MedusaConfig.from_pretrained(checkpoint)
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    model = MedusaModel(target, config.medusa_num_heads, config.medusa_num_layers, target_dir)
    result = model.medusa_head.load_state_dict(torch.load(f"{checkpoint}/medusa_lm_head.pt"), strict=False)
    with torch.no_grad():
        logits = model(input_ids=inputs["prompt"])
    return {"logits": logits[:, 0], "missing": list(result.missing_keys), "unexpected": list(result.unexpected_keys)}


def dflash_block(checkpoint: str, target_dir: str, inputs: dict) -> dict:
    """z-lab's DFlash model (PyPI dflash 0.1.0, `dflash.model.DFlashDraftModel`, built from the checkpoint's config and
    its state loaded strictly) drafting the first block after the prompt as its `dflash_generate` does, with its own
    helpers: the context features (`extract_context_feature`), the block [root, mask_token_id, ...] embedded by
    `_raw_input_embeddings`, its forward at positions 0..T+block-1, `compute_logits` through the target's head. (Its
    loop itself needs a transformers newer than the peers' 5.8.1: `DynamicCache.activate_past_recording`.)"""
    from dflash.model import DFlashDraftModel, _output_head, _raw_input_embeddings, extract_context_feature
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    model = DFlashDraftModel(AutoConfig.from_pretrained(checkpoint)).float().eval()
    model.load_state_dict(load_file(f"{checkpoint}/model.safetensors"), strict=True)
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    prompt, size = inputs["prompt"], model.block_size
    with torch.no_grad():
        out = target(prompt, output_hidden_states=True)
        block = torch.full((1, size), model.mask_token_id)
        block[0, 0] = out.logits[0, -1].argmax()
        context = extract_context_feature(out.hidden_states, model.target_layer_ids)
        hidden = model(target_hidden=context, noise_embedding=_raw_input_embeddings(target, block),
                       position_ids=torch.arange(prompt.shape[1] + size)[None])[:, 1 - size:, :]
        drafted = model.compute_logits(hidden, _output_head(target)).argmax(-1)[0]
    return {"first_block": drafted.tolist(), "layers": list(model.target_layer_ids)}


CHECKS = {"eagle1": eagle1_chain, "medusa": medusa_logits, "dflash": dflash_block}


def main(argv: list[str]) -> None:
    import json

    for job in json.loads(open(argv[0], encoding="utf-8").read()):
        inputs = torch.load(job["inputs"])
        if job["check"] == "speculators":
            out = speculators_logits(job["checkpoint"], inputs)
        elif job["check"] == "specforge":
            out = specforge_logits(job["checkpoint"], job["target"], inputs)
        elif job["check"] in CHECKS:
            out = CHECKS[job["check"]](job["checkpoint"], job["target"], inputs)
        else:
            raise SystemExit(f"unknown check {job['check']!r}; see the docstring")
        torch.save(out, job["out"])


if __name__ == "__main__":
    main(sys.argv[1:])
