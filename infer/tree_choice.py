"""Trees calibrated to the machine and the drafter: the choice.

A trained drafter's tree is worth what it gains per second: (1 + E[accepted drafts]) / (draft cost + verify
cost) per step. The first factor belongs to the drafter and the data, the second to the machine, so they
are measured apart, each by its own module of `infer.tuning`:

1. acceptance (`infer.tuning.acceptance.measure_acceptance`): the drafter drafts a wide tree on held-out prompts
   (greedy) and an `AcceptanceRecorder` counts which nodes the target accepts. Greedy acceptance does not depend
   on the machine, so the statistics are stored with the drafter (`config.calibration`, written by
   `scripts/calibrate.py --write`).
2. cost (`infer.tuning.timing`: `verify_costs`, `draft_costs`, `no_drafts_step`): one verify forward over 1..64
   drafted nodes plus the root, one drafting step per candidate tree, and a step of generation with no drafts,
   which gives the engine's own work a step around the forward and the drafter, timed on this machine and cached
   per machine (`infer.tuning.cache`).
3. choice (here, from `infer.tuning.candidates`): for every tree of N = 1..64 nodes the statistics predict
   E[accepted], and the one with the highest predicted tokens/s wins (`predict`). Beside it, generation with no
   drafts (`predict_no_drafts`), so the choice says whether drafting pays.
4. prompt lookup first (`infer.tuning.acceptance.measure_lookup_first`): the chosen tree generates the prompts
   alone and with prompt lookup first, timed, interleaved; `--write` records whether lookup first was faster in
   the drafter's `config.lookup_first`, the default `SelfSpecModel` follows.
5. several rows (`predict_batch`): the tree is chosen for one row, but every row of a batch adds its nodes to the
   verify forward, so at a call's batch size its verify and drafting step are timed again beside the root alone;
   `SelfSpecModel` drafts a call of several rows only where that predicts drafting to be faster
   (`infer.policy.BatchDrafting`).

`choose` runs 1-4 for `scripts/calibrate.py` and `make demo`. `SelfSpecModel(target, drafter, tree="calibrated")`
runs 2 and 3 on first use (`calibrated_tree`) and caches the choice, so a drafter calibrated once picks its tree
again on every machine it runs on. A calibrated dynamic tree drafts without the early stop (`min_confidence` 0):
the statistics are of the full tree. Greedy output never depends on the tree; only the speed does.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass

import torch

from .tuning.acceptance import WIDE, measure_acceptance, measure_lookup_first, wide_tree
from .tuning.cache import config_hash, device_name, fingerprint, read_cache, write_cache
from .tuning.candidates import NO_DRAFTS, Candidate, Prediction, best_prediction, candidate_trees
from .tuning.plan import prepack_default
from .tuning.timing import MAX_NODES, batch_costs, draft_costs, fitting_context, no_drafts_step, verify_costs


def predict(target, drafter, calibration: dict, *, max_nodes: int = MAX_NODES, context: int = 256,
            repeats: int = 5, prepack: bool | None = None) -> list[Prediction]:
    """Every candidate tree the stored statistics allow, with this machine's draft and verify cost."""
    candidates = [c for measured in calibration["measured"] for c in candidate_trees(measured, max_nodes)]
    if not candidates:
        raise ValueError("the calibration statistics allow no tree; recalibrate the drafter")
    verify = verify_costs(target, max(c.nodes for c in candidates), context=context, repeats=repeats,
                          prepack=prepack)
    draft = draft_costs(target, drafter, [c.tree for c in candidates], context=context, repeats=repeats,
                        prepack=prepack)
    engine = no_drafts_step(target, context=context, repeats=repeats, prepack=prepack)["engine_seconds"]
    return [Prediction(c, d, verify[c.nodes], engine) for c, d in zip(candidates, draft, strict=True)]


def predict_no_drafts(target, *, context: int = 256, repeats: int = 5, prepack: bool | None = None) -> Prediction:
    """Generation with no drafts on this machine (`infer.tuning.candidates.NO_DRAFTS`: one token a target forward through the
    same engine), its step as `no_drafts_step` times it: what the best tree has to beat for drafting to pay."""
    step = no_drafts_step(target, context=context, repeats=repeats, prepack=prepack)
    return Prediction(NO_DRAFTS, step["draft_seconds"], step["forward_seconds"], step["engine_seconds"])


def tree_candidate(calibration: dict, tree: dict) -> Candidate | None:
    """The candidate of a drafter's stored statistics (`config.calibration`) that drafts `tree`, its resolved
    tree settings; None where the statistics predict no such tree (one set by hand, say)."""
    for measured in calibration.get("measured") or []:
        for candidate in candidate_trees(measured, calibration.get("max_nodes", MAX_NODES)):
            if all(tree.get(key) == value for key, value in candidate.tree.items()):
                return candidate
    return None


def predict_batch(target, drafter, tree: dict, batch: int, *, context: int = 256, repeats: int = 3,
                  prepack: bool | None = None) -> tuple[Prediction, Prediction] | None:
    """`drafter` (a heads model) drafting `tree` and generation with no drafts, each step of `batch` rows on this
    machine, predicted per row: (drafting, no drafts), or None where its statistics do not hold this tree.

    A tree calibrated on one row costs more at several: every row's nodes go through the verify forward, which
    on a CPU costs nearly as much again for each row (docs/benchmarks.md, "Batches"), while each row still gains
    only its own accepted drafts. So the verify of the root alone and of the tree, and the drafting step, are timed
    at `batch` rows (`infer.tuning.timing.batch_costs`, cached); the acceptance is the stored one (a row's
    acceptance does not depend on its neighbours) and the engine's own work a step `no_drafts_step`'s at one row."""
    candidate = tree_candidate(drafter.config.calibration or {}, tree)
    if candidate is None:
        return None
    prepack = prepack_default(target, prepack)
    context = fitting_context(target, context, candidate.nodes + 1)
    cached = batch_costs(target, drafter, candidate.tree, candidate.nodes, batch, context=context, repeats=repeats,
                         prepack=prepack)
    step = no_drafts_step(target, context=context, repeats=repeats, prepack=prepack)
    drafting = Prediction(candidate, cached["draft_seconds"], cached["verify_seconds"], step["engine_seconds"])
    none = Prediction(NO_DRAFTS, step["draft_seconds"], cached["no_drafts_verify_seconds"], step["engine_seconds"])
    return drafting, none


def calibrate(target, drafter, prompts: list[torch.Tensor], *, mode: str | None = None,
              top_k: list[int] | None = None, depth: int | None = None, wide: int = WIDE,
              max_nodes: int = MAX_NODES, max_new_tokens: int = 64, context: int = 256, repeats: int = 5,
              tokenizer=None, prepack: bool | None = None) -> tuple[dict, list[Prediction]]:
    """Measure `drafter`'s acceptance on `prompts` ([1, T] ids each, held out from its training data) with a
    wide tree (once per `top_k` for a dynamic tree), then this machine's costs; returns the statistics for
    `config.calibration` and the prediction for every candidate tree (`infer.tuning.candidates.best_prediction` picks)."""
    if not 1 <= max_nodes <= wide:
        raise ValueError(f"max_nodes must be in 1..wide={wide} (candidate trees are subsets of the measured "
                         f"one), got {max_nodes}")
    if not prompts:
        raise ValueError("calibration needs at least one held-out prompt")
    trees = [wide_tree(drafter.config, mode, wide=wide, depth=depth, top_k=k) for k in (top_k or [None])]
    trees = list({json.dumps(t, sort_keys=True): t for t in trees}.values())  # a static tree ignores top_k
    measured = [measure_acceptance(target, drafter, prompts, tree, max_new_tokens=max_new_tokens,
                                   max_nodes=max_nodes, tokenizer=tokenizer, prepack=prepack) for tree in trees]
    calibration = {"measured": measured, "prompts": len(prompts), "max_new_tokens": max_new_tokens,
                   "max_nodes": max_nodes}
    return calibration, predict(target, drafter, calibration, max_nodes=max_nodes, context=context,
                                repeats=repeats, prepack=prepack)


@dataclass
class Choice:
    """What calibrating a drafter found (`choose`): the statistics for `config.calibration`, every candidate
    tree's prediction, the fastest of them, generation with no drafts predicted from the same machine, and that
    tree timed alone and with prompt lookup first (`measure_lookup_first`'s result; None when not measured)."""

    calibration: dict
    predictions: list[Prediction]
    best: Prediction
    no_drafts: Prediction  # `predict_no_drafts`: what the best tree is predicted to beat
    lookup_first: dict | None

    @property
    def tree(self) -> dict:
        return self.best.candidate.tree


def choose(target, drafter, prompts: list[torch.Tensor], *, lookup_first: bool = True, max_new_tokens: int = 64,
           tokenizer=None, prepack: bool | None = None, **options) -> Choice:
    """Steps 1-4 of this module for `drafter` on held-out `prompts`: `calibrate` (its keyword `options` too),
    the tree with the highest predicted tokens/s, and, with `lookup_first`, that tree timed alone and with
    prompt lookup first. `scripts/calibrate.py` and `make demo` calibrate through this, and store the choice with
    `heads.card.write_calibration`."""
    calibration, predictions = calibrate(target, drafter, prompts, max_new_tokens=max_new_tokens,
                                         tokenizer=tokenizer, prepack=prepack, **options)
    best = best_prediction(predictions)
    none = predict_no_drafts(target, prepack=prepack, **{k: options[k] for k in ("context", "repeats") if k in options})
    lookup = measure_lookup_first(target, drafter, prompts, best.candidate.tree, max_new_tokens=max_new_tokens,
                                  tokenizer=tokenizer, prepack=prepack) if lookup_first else None
    return Choice(calibration, predictions, best, none, lookup)


def calibrated_tree(drafter, target, tokenizer=None, *, prepack: bool | None = None, max_nodes: int | None = None,
                    context: int = 256, repeats: int = 3) -> dict:
    """The tree settings that maximize predicted tokens/s for `drafter` (a heads model) on this machine, from
    the acceptance statistics stored with it (`scripts/calibrate.py --write`) and this machine's costs.
    `max_nodes`, the largest tree considered, defaults to the one the statistics were calibrated with.

    The first call for a target, device, torch thread count and drafter measures the costs, `repeats` times
    each after a warm-up: a verify forward over each of 1..`max_nodes` + 1 tokens after a `context`-token
    prefix (the curve is shared by every drafter of the target), and one drafting step per candidate tree
    (`max_nodes` static trees, or one per depth for a dynamic tree). That is 4 x 65 target forwards and up to
    4 x 64 drafting steps at the defaults: well under a second for the tiny test models, and by an estimate from
    its forward's cost, half a minute or so for SmolLM2-135M on 2 CPU cores. The choice is
    then cached (`$SELFSPEC_CACHE/calibration`), and later calls read one small JSON file. Where generation with
    no drafts is predicted faster than the best tree (`predict_no_drafts`), every call warns: the tree is still
    returned, and the caller decides whether to draft."""
    calibration = drafter.config.calibration
    if not calibration or not calibration.get("measured"):
        raise ValueError("tree='calibrated' chooses the tree from the drafter's acceptance statistics on held-out "
                         "prompts, and this drafter has none: run scripts/calibrate.py --drafter <its folder> "
                         "--prompts <held-out prompts> --write once, or leave tree= unset for its saved tree")
    max_nodes = max_nodes or calibration.get("max_nodes", MAX_NODES)
    drafter.attach(target, tokenizer)
    prepack = prepack_default(target, prepack)
    fields = {"target": fingerprint(target), "drafter": config_hash(drafter.config),
              "device": device_name(target.device), "threads": torch.get_num_threads(), "context": context,
              "prepack": prepack, "max_nodes": max_nodes, "caches": "evicted",
              "prediction": "draft + verify + engine"}
    cached = read_cache("tree", fields)
    if cached is None:
        best = best_prediction(predict(target, drafter, calibration, max_nodes=max_nodes, context=context,
                                       repeats=repeats, prepack=prepack))
        none = predict_no_drafts(target, context=context, repeats=repeats, prepack=prepack)
        cached = {"tree": best.candidate.tree, "nodes": best.candidate.nodes, "tokens_per_second": best.tokens_per_second,
                  "no_drafts_tokens_per_second": none.tokens_per_second}
        write_cache("tree", fields, cached)
    if cached["no_drafts_tokens_per_second"] > cached["tokens_per_second"]:
        warnings.warn(f"drafting with this drafter is predicted not to pay on this machine ({fields['device']}, {fields['threads']} "
                      f"threads): its best tree is predicted at {cached['tokens_per_second']:.1f} tokens/s and "
                      f"generation with no drafts, SelfSpecModel(target) alone, at "
                      f"{cached['no_drafts_tokens_per_second']:.1f} (infer.tree_choice.predict_no_drafts: estimates good to "
                      "about 10%; scripts/calibrate.py times both on held-out prompts). A drafter whose drafts are "
                      "accepted more often would change that", stacklevel=4)  # SelfSpecModel's caller
    return cached["tree"]


