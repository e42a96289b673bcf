"""What is written next to every saved drafter: its README.md model card, and the calibrated tree and acceptance
statistics stored in its config (`write_calibration`)."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

from .kinds import REGISTRY


def write_model_card(folder, config, kind: str, title: str | None = None) -> str:
    """Write `folder/README.md` from the drafter's config: base model, kind, training data, metrics.
    `title` names the kind in prose (its registered title); the kind's name when not given."""
    base = config.base_model_name_or_path
    front = ["---", "library_name: selfspec", "pipeline_tag: text-generation",
             "tags:", "- speculative-decoding", f"- {kind}"]
    if base and not os.path.isabs(base) and not os.path.exists(base):
        front.append(f"base_model: {base}")
    if config.training and config.training.get("data"):
        data = config.training["data"]
        front += ["datasets:"] + [f"- {d}" for d in ([data] if isinstance(data, str) else data)]
    front.append("---")

    title = title or kind
    lines = [f"# {title} for {base or 'an unnamed target'}", "",
             f"{title} for self-speculative decoding with selfspec: it drafts tokens that the target model "
             "then verifies, so generation is unchanged (greedy output is token-identical to the target's).",
             "",
             "## Target", "",
             f"- base model: `{base or 'unknown'}`",
             f"- model type: `{config.target_model_type}`, hidden size {config.target_hidden_size}, "
             f"vocab size {config.target_vocab_size}, {config.target_num_layers} layers",
             f"- tokenizer fingerprint: `{config.tokenizer_fingerprint or 'not recorded'}`", "",
             "## Drafting", "", "```json", json.dumps(config.tree, indent=2, default=list), "```", ""]
    lookup = (config.calibration or {}).get("lookup_first")
    if lookup and config.lookup_first is not None:
        speeds = ", ".join(f"{way.replace('_', ' ')} {lookup[way]['tokens_per_second']:.1f} tokens/s"
                           for way in ("alone", "lookup_first"))
        lines += [f"Prompt lookup first is {'on' if config.lookup_first else 'off'} by default (`lookup_first` in "
                  f"config.json): with this tree on {lookup['prompts']} held-out prompts, {speeds} "
                  f"({lookup['device']}, {lookup['threads']} threads). `SelfSpecModel(..., lookup_first=...)` "
                  "overrides it.", ""]
        if "no_drafts" in lookup:  # calibrations written before no drafts was timed lack it
            lines += [f"With no drafts (one token a target forward through the same engine): "
                      f"{lookup['no_drafts']['tokens_per_second']:.1f} tokens/s: drafting "
                      f"{'pays' if lookup['drafting_pays'] else 'does not pay'} on that machine.", ""]
    lines += ["## Training", ""]
    if config.training:
        lines += [f"- {k}: {v}" for k, v in config.training.items()]
    else:
        lines.append("Not trained yet (freshly initialised).")
    lines += ["", "## Measured", ""]
    if config.metrics:
        lines += [f"- {k}: {v}" for k, v in config.metrics.items()]
    else:
        lines.append("No measurements recorded.")
    lines += ["", "## Use", "", "```python", "import heads",
              "from infer import SelfSpecModel", "",
              "drafter = heads.load(\"<this repo or folder>\")",
              f"model = SelfSpecModel(target, drafter)  # target: {base or 'the base model'}",
              "```", ""]
    path = os.path.join(folder, "README.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(front + [""] + lines))
    return path


def write_calibration(folder, drafter, calibration: dict, tree: dict, lookup_first: dict | None = None) -> None:
    """Store the chosen tree and the acceptance statistics (`infer.tree_choice.choose`'s) in the saved drafter at
    `folder`: its config.json (the weights are unchanged) and its model card. Later loads draft with that tree,
    and `tree="calibrated"` chooses again from the statistics on another machine. `lookup_first`, a
    `measure_lookup_first` result, is stored beside the statistics and sets `config.lookup_first`, which
    `SelfSpecModel` follows unless told otherwise."""
    config = drafter.config
    config.tree = config.resolve_tree({**config.tree, **tree})
    if lookup_first is not None:
        calibration = {**calibration, "lookup_first": lookup_first}
        config.lookup_first = bool(lookup_first["pays"])
    config.calibration = calibration
    # the weights in the folder keep their dtype (a drafter stored in fp16 may have been loaded in fp32)
    saved = copy.deepcopy(config)
    existing = Path(folder) / "config.json"
    stored = json.loads(existing.read_text()).get("dtype") if existing.is_file() else None
    saved.dtype = stored or config.dtype
    saved.save_pretrained(folder)
    registered = REGISTRY.get(drafter.kind)
    write_model_card(folder, saved, kind=drafter.kind, title=registered.title if registered else None)
