"""Tree calibration (infer/tree_choice.py, infer/tuning/): the choice from acceptance statistics, the acceptance
observed through the engine, greedy equality with calibrated and early-stopping trees, and bad prompt files."""

from __future__ import annotations

import itertools
import json
import math
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

import heads
from heads import calibrate_cli
from heads.card import write_calibration
from infer import SelfSpecModel, policy, tree_choice
from infer.drafters import LookupFirstDrafter
from infer.drafting import TargetStep
from infer.sampling import SamplingParams
from infer.tree import tree_from_paths
from infer.tuning import acceptance, cache, timing
from infer.tuning.candidates import (
    NO_DRAFTS,
    Candidate,
    Prediction,
    best_prediction,
    candidate_trees,
    dynamic_nodes,
    prior_paths,
    ranked_paths,
)

_TARGET: dict = {}


def target():
    if "llama" not in _TARGET:
        _TARGET["llama"] = tiny_model("llama")
    return _TARGET["llama"]


def peaked(drafter):
    """A drafter whose draft distributions are confident on some contexts and not on others (a fresh one's
    are nearly flat)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3, generator=g)
    return drafter


def prompts(count: int = 3, length: int = 8, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (1, length), generator=g) for _ in range(count)]


def predictions(candidates, draft, verify) -> list[Prediction]:
    return [Prediction(c, draft(c), verify(c.nodes)) for c in candidates]


# ---- the choice, on synthetic statistics --------------------------------------------------------------------


def test_static_choice_keeps_the_likeliest_paths():
    paths = prior_paths(4, 40)
    # P(path accepted): 0.7 for the top-1 candidate, 0.2 / rank below it, multiplied along the path
    p = [math.prod(0.7 if r == 0 else 0.2 / r for r in path) for path in paths]
    measured = {"mode": "static", "tree": {"paths": [list(q) for q in paths]}, "p_accept": p}
    candidates = candidate_trees(measured, max_nodes=32)
    assert [c.nodes for c in candidates] == list(range(1, 33))
    likeliest = sorted(p, reverse=True)
    for c in candidates:
        tree_from_paths([tuple(q) for q in c.tree["paths"]])  # ancestor-closed, or this raises
        assert c.expected_accepted == pytest.approx(sum(likeliest[: c.nodes]))
    # Verifying up to 8 nodes costs one unit, more costs three: 8 nodes win, holding the 8 likeliest paths.
    best = best_prediction(predictions(candidates, lambda c: 0.0, lambda n: 1.0 if n <= 8 else 3.0))
    assert best.candidate.nodes == 8
    assert sorted(map(tuple, best.candidate.tree["paths"])) == sorted(ranked_paths(paths, p)[:8])
    assert best.tokens_per_second == pytest.approx(1 + sum(likeliest[:8]))


def test_static_choice_refuses_damaged_statistics():
    with pytest.raises(ValueError, match=r"\[0, 0\] is accepted more often"):
        ranked_paths([[0], [0, 0]], [0.3, 0.5])
    with pytest.raises(ValueError, match="without its parent"):
        ranked_paths([[0], [1, 0]], [0.3, 0.1])


def test_dynamic_choice_picks_depth_and_node_budget():
    # top-2 branching, measured 3 deep; P by score rank among the nodes no deeper than the depth limit
    p_rank = [[0.6, 0.1, 0, 0, 0, 0, 0, 0],
              [0.6, 0.5, 0.1, 0.05, 0, 0, 0, 0],
              [0.6, 0.5, 0.4, 0.1, 0.05, 0, 0, 0]]
    measured = {"mode": "dynamic", "tree": {"mode": "dynamic", "top_k": 2, "depth": 3, "total_tokens": 8},
                "p_rank": p_rank}
    candidates = candidate_trees(measured, max_nodes=8)
    # fewer nodes than levels: the drafter stops at depth total_tokens, so only depth n lists n nodes
    assert sorted((c.tree["depth"], c.nodes) for c in candidates) == sorted(
        (d, n) for d in (1, 2, 3) for n in range(d, min(8, dynamic_nodes(2, d)) + 1))
    for c in candidates:
        assert c.expected_accepted == pytest.approx(sum(p_rank[c.tree["depth"] - 1][: c.nodes]))
    # Drafting costs 0.1 per depth, verifying 1 + 0.1 per node: 3 deep keeping 3 nodes, (1 + 1.5) / 1.6; one
    # node more gains 0.1 token for 0.1 s (2.6 / 1.7), one less loses 0.4 (2.1 / 1.5).
    best = best_prediction(predictions(candidates, lambda c: 0.1 * c.tree["depth"], lambda n: 1 + 0.1 * n))
    assert (best.candidate.tree["depth"], best.candidate.tree["total_tokens"]) == (3, 3)
    assert best.tokens_per_second == pytest.approx(2.5 / 1.6)


def test_ties_go_to_the_smaller_tree():
    small, large = Candidate({"paths": [[0]]}, 1, 0.5), Candidate({"paths": [[0], [1]]}, 2, 0.5)
    assert best_prediction([Prediction(large, 0, 1), Prediction(small, 0, 1)]).candidate is small


def test_the_engines_own_cost_a_step_counts_against_every_tree():
    """A step costs drafting, verifying and the engine's work around them: a fixed cost a step favours the larger
    tree, which pays it for more tokens (without it the 1-node tree wins: 1.4 / 1.0 against 1.6 / 1.2)."""
    small = Prediction(Candidate({"paths": [[0]]}, 1, 0.4), 0.2, 0.8, 0.5)
    large = Prediction(Candidate({"paths": [[0], [0, 0]]}, 2, 0.6), 0.3, 0.9, 0.5)
    assert small.tokens_per_second == pytest.approx(1.4 / 1.5) and large.tokens_per_second == pytest.approx(1.6 / 1.7)
    assert best_prediction([small, large]) is large
    assert best_prediction([replace(small, engine_seconds=0.0), replace(large, engine_seconds=0.0)]).candidate \
        is small.candidate


class _TimedGenerations:
    """Stands in for `SelfSpecModel` in `no_drafts_step`: each generate "takes" the wall time and reports the
    statistics listed for its length."""

    def __init__(self, runs: dict, *args, **kwargs):
        self.runs, self.last_stats = runs, None

    def generate(self, ids, max_new_tokens):
        self.wall, self.last_stats = self.runs[max_new_tokens]


def test_a_step_with_no_drafts_is_split_from_the_difference_of_two_generations(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    short, long = timing.NO_DRAFTS_TOKENS
    runs = {short: (1.0, {"target_seconds": 0.5, "draft_seconds": 0.1, "target_forwards": short}),
            long: (3.0, {"target_seconds": 1.3, "draft_seconds": 0.26, "target_forwards": long})}
    models = []

    def model(*args, **kwargs):
        models.append(_TimedGenerations(runs))
        return models[-1]

    def seconds(fn, device):
        fn()
        return models[-1].wall

    monkeypatch.setattr(timing, "engine", model)
    monkeypatch.setattr(timing, "seconds", seconds)
    step = timing.no_drafts_step(target(), context=16, repeats=2)
    # what each call pays once (the prompt's forward; 0.4 s outside the forward and the drafter) drops out
    steps = long - short
    assert step["engine_seconds"] == pytest.approx(((3.0 - 1.3 - 0.26) - (1.0 - 0.5 - 0.1)) / steps)
    assert step["forward_seconds"] == pytest.approx((1.3 - 0.5) / steps)
    assert step["draft_seconds"] == pytest.approx((0.26 - 0.1) / steps)
    none = tree_choice.predict_no_drafts(target(), context=16, repeats=2)
    assert none.candidate.nodes == 0 and none.tokens_per_second == pytest.approx(steps / (3.0 - 1.0))
    models.clear()
    assert timing.no_drafts_step(target(), context=16, repeats=2) == step and not models  # cached
    runs[long] = runs[short][0], {**runs[short][1]}  # an end-of-sequence token at once: both made as many steps
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "fresh"))
    with pytest.raises(RuntimeError, match="could not be timed"):
        timing.no_drafts_step(target(), context=16, repeats=2)


@pytest.mark.parametrize("drafting_pays", [True, False])
def test_a_calibrated_tree_slower_than_no_drafts_is_named_a_loss(drafting_pays, tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    t = target()
    drafter = heads.build("eagle", t)
    drafter.config.calibration = {"measured": [{"mode": "static", "steps": 1, "mean_accepted": 0.5,
                                                "p_accept": [0.5], "tree": {"mode": "static", "paths": [[0]]}}]}
    tree = Candidate({"mode": "static", "paths": [[0]]}, 1, 0.5)
    monkeypatch.setattr(tree_choice, "predict", lambda *a, **k: [Prediction(tree, 0.2, 1.0, 0.3)])  # 1.5 / 1.5
    none = Prediction(NO_DRAFTS, 0.0, 1.2 if drafting_pays else 0.2, 0.3)  # 1 / 1.5 or 1 / 0.5
    monkeypatch.setattr(tree_choice, "predict_no_drafts", lambda *a, **k: none)
    for _ in range(2):  # measured, then read from the cache
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert tree_choice.calibrated_tree(drafter, t) == tree.tree
        losses = [w for w in caught if "predicted not to pay on this machine" in str(w.message)]
        assert len(losses) == (0 if drafting_pays else 1)
        if not drafting_pays:
            message = str(losses[0].message)
            assert "predicted at 1.0 tokens/s" in message and "alone, at 2.0 (" in message


# ---- acceptance observed through the engine -----------------------------------------------------------------


RECORDED = [("eagle", "dynamic"), ("eagle3", "static"), ("medusa", "static")]


@pytest.mark.parametrize(("kind", "mode"), RECORDED)
def test_recorded_acceptance_agrees_with_accepted_lengths(kind, mode):
    t = target()
    drafter = peaked(heads.build(kind, t))
    tree = acceptance.wide_tree(drafter.config, mode, wide=64, depth=3 if kind != "medusa" else None)
    recorder = acceptance.AcceptanceRecorder(mode, paths=tree.get("paths"), depth=tree.get("depth"))
    model = SelfSpecModel(t, drafter, tree=tree, step_observer=recorder)
    ids = torch.cat(prompts(2, seed=3))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # a left-padded row
    total = 0
    for batch in (ids[:1], ids):
        model.generate(batch, attention_mask=mask[: len(batch)], max_new_tokens=24, eos_token_id=[])
        total += len(model.last_stats["accepted_lengths"])
    assert recorder.accepted[-len(model.last_stats["accepted_lengths"]):] == [
        a - 1 for a in model.last_stats["accepted_lengths"]]
    assert len(recorder.accepted) == total
    stats = recorder.statistics()
    assert 0 < stats["steps"] < total  # the last steps of each row were cut by the budget: not counted
    assert sum(recorder.accepted) > 0
    if mode == "static":
        ranked_paths(tree["paths"], stats["p_accept"])  # a child is never accepted more often than its parent
        assert sum(stats["p_accept"]) == pytest.approx(stats["mean_accepted"], abs=1e-4)
    else:  # with no depth limit, the 64 best-scored nodes are all there are
        assert len(stats["p_rank"]) == tree["depth"]
        assert sum(stats["p_rank"][-1]) == pytest.approx(stats["mean_accepted"], abs=1e-4)
        assert all(sum(a) <= sum(b) + 1e-6 for a, b in itertools.pairwise(stats["p_rank"]))


class FirstStep:
    """A step observer keeping the first verify step of a generation."""

    def __init__(self):
        self.seen = None

    def __call__(self, tree, acc, budget):
        if self.seen is None:
            self.seen = (tree, acc, budget)


def first_step(t, drafter, tree, ids):
    observer = FirstStep()
    SelfSpecModel(t, drafter, tree=tree, step_observer=observer).generate(ids, max_new_tokens=12, eos_token_id=[])
    return observer.seen


@pytest.mark.parametrize(("kind", "mode"), RECORDED)
def test_statistics_of_the_wide_tree_predict_a_smaller_tree_exactly(kind, mode):
    """On the same context, what a smaller tree accepts is what the wide tree's statistics say it would: a
    static tree's nodes are accepted or not whatever else is drafted, and a dynamic tree drafted d deep
    keeping N nodes holds the N best-scored nodes no deeper than d of the wide one. A 16-token vocabulary
    makes a random drafter's candidates land often enough to compare."""
    if "vocab16" not in _TARGET:
        _TARGET["vocab16"] = tiny_model("llama", vocab_size=16)
    t = _TARGET["vocab16"]
    drafter = heads.build(kind, t)
    wide = acceptance.wide_tree(drafter.config, mode, wide=64, depth=4 if kind != "medusa" else None)
    depth = max(len(p) for p in wide["paths"]) if mode == "static" else wide["depth"]
    if mode == "dynamic":
        smaller = [{**wide, "depth": d, "total_tokens": n} for d, n in ((1, 3), (2, 1), (2, 8), (4, 3), (4, 20))]
    else:
        smaller = [{**wide, "paths": [list(p) for p in prior_paths(depth, n, top1=0.8, decay=0.9, spread=0.3)]}
                   for n in (1, 3, 8, 20)]
    g = torch.Generator().manual_seed(11)
    predicted_total = 0
    for _ in range(10):
        ids = torch.randint(3, 16, (1, 8), generator=g)
        recorder = acceptance.AcceptanceRecorder(mode, paths=wide.get("paths"), depth=wide.get("depth"))
        recorder(*first_step(t, drafter, wide, ids))
        assert recorder.steps == 1
        for tree in smaller:
            _, acc, _ = first_step(t, drafter, tree, ids)
            if mode == "dynamic":
                predicted = recorder.hits[tree["depth"] - 1, : tree["total_tokens"]].sum()
            else:
                kept = {tuple(p) for p in tree["paths"]}
                predicted = sum(h for p, h in zip(recorder.paths, recorder.hits.tolist(), strict=True) if p in kept)
            assert int(acc.length) - 1 == predicted
            predicted_total += predicted
    assert predicted_total > 0


# ---- calibrated trees, end to end ---------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "mode"), RECORDED)
def test_calibrated_tree_keeps_greedy_output_and_is_cached(kind, mode, tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    t = target()
    drafter = peaked(heads.build(kind, t))
    calibration, predicted = tree_choice.calibrate(t, drafter, prompts(), mode=mode, wide=32, max_nodes=16,
                                                   max_new_tokens=16, context=16, repeats=1)
    assert len(predicted) >= 16 and all(p.tokens_per_second > 0 for p in predicted)
    drafter.config.calibration = json.loads(json.dumps(calibration))  # as config.json stores it
    ids = torch.cat(prompts(2, seed=5))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    expected = t.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, eos_token_id=None,
                          pad_token_id=0)
    # measures this machine's costs, then caches the choice; drafting at two rows whatever is predicted there
    model = SelfSpecModel(t, drafter, tree="calibrated", draft_batches=True)
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=[]), expected)
    # the verify curve, the chosen tree and (where the streamed kernel builds) the kernel choice
    assert {p.name.split("-")[0] for p in (tmp_path / "calibration").iterdir()} - {"stream_rows"} == {
        "verify", "no_drafts", "tree"}
    chosen = tree_choice.calibrated_tree(drafter, t)

    def measured_again(*args, **kwargs):
        raise AssertionError("the cached choice was not used")

    monkeypatch.setattr(tree_choice, "verify_costs", measured_again)
    monkeypatch.setattr(tree_choice, "draft_costs", measured_again)
    monkeypatch.setattr(tree_choice, "no_drafts_step", measured_again)
    assert tree_choice.calibrated_tree(drafter, t) == chosen
    assert chosen in [p.candidate.tree for p in predicted]
    again = SelfSpecModel(t, drafter, tree="calibrated", draft_batches=True)
    assert torch.equal(again.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=[]), expected)


# ---- several rows: the tree calibrated on one, or no drafts -------------------------------------------------


def calibrated(kind: str = "eagle3", mode: str = "dynamic"):
    """A tiny drafter with acceptance statistics (as `scripts/calibrate.py --write` stores them) and its chosen tree
    saved as its own."""
    t = target()
    drafter = peaked(heads.build(kind, t))
    calibration, predicted = tree_choice.calibrate(t, drafter, prompts(), mode=mode, wide=16, max_nodes=8,
                                                   max_new_tokens=8, context=16, repeats=1)
    drafter.config.calibration = json.loads(json.dumps(calibration))
    drafter.config.tree = drafter.config.resolve_tree({**drafter.config.tree, **best_prediction(predicted).candidate.tree})
    return drafter


def two_rows():
    ids = torch.cat(prompts(2, seed=7))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    expected = target().generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, eos_token_id=None,
                                 pad_token_id=0)
    return ids, mask, expected


def counting_proposals(model: SelfSpecModel) -> list:
    """Every tree the model's own drafter proposes from now on (a no-drafts call proposes none)."""
    proposed = []
    own = model.drafter.primary if isinstance(model.drafter, LookupFirstDrafter) else model.drafter
    propose = own.propose
    own.propose = lambda budget: proposed.append(1) or propose(budget)
    return proposed


def predicting(monkeypatch, drafting: float, none: float) -> list:
    """`predict_batch` replaced by one that predicts these tokens/s a row; returns the batch sizes it was asked."""
    asked = []

    def predict(target_model, drafter, tree, batch, **kwargs):
        asked.append(batch)
        return Prediction(Candidate(tree, 1, drafting - 1), 0.0, 1.0), Prediction(NO_DRAFTS, 0.0, 1 / none)

    monkeypatch.setattr(policy, "predict_batch", predict)
    return asked


@pytest.mark.parametrize(("drafting", "none", "drafts"), [(1.5, 1.0, True), (1.2, 1.6, False), (1.05, 1.0, False)])
def test_a_batch_drafts_where_drafting_is_predicted_faster_and_the_output_never_changes(drafting, none, drafts,
                                                                                        monkeypatch):
    asked = predicting(monkeypatch, drafting, none)
    model = SelfSpecModel(target(), calibrated())
    proposed = counting_proposals(model)
    ids, mask, expected = two_rows()
    for _ in range(2):  # predicted once per batch size
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=[]), expected)
    assert asked == [2]
    choice = model.last_stats["batch_drafting"]
    assert (choice["batch"], choice["drafts"], choice["why"]) == (2, drafts, "predicted")
    assert choice["margin"] == policy.BATCH_MARGIN > 1.05  # drafting predicted within it: no drafts
    assert choice["predicted_tokens_per_second"] == pytest.approx({"drafting": 2 * drafting, "no_drafts": 2 * none})
    assert bool(proposed) == drafts
    # one row drafts the tree it was calibrated for, with nothing predicted
    proposed.clear()
    one = model.generate(ids[1:], max_new_tokens=12, eos_token_id=[])
    assert torch.equal(one, target().generate(ids[1:], do_sample=False, max_new_tokens=12, eos_token_id=None))
    assert proposed and model.last_stats["batch_drafting"] is None and asked == [2]


def test_draft_batches_true_always_drafts_and_false_never_does_at_several_rows(monkeypatch):
    asked = predicting(monkeypatch, 1.0, 9.0)  # no drafts predicted far faster
    drafter = calibrated()
    ids, mask, expected = two_rows()
    always = SelfSpecModel(target(), drafter, draft_batches=True)
    proposed = counting_proposals(always)
    assert torch.equal(always.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=[]), expected)
    assert proposed and always.last_stats["batch_drafting"] is None
    never = SelfSpecModel(target(), drafter, draft_batches=False)
    proposed = counting_proposals(never)
    assert torch.equal(never.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=[]), expected)
    assert not proposed and never.last_stats["batch_drafting"] == {"batch": 2, "drafts": False,
                                                                    "why": "draft_batches=False"}
    assert asked == []
    with pytest.raises(ValueError, match="draft_batches must be True, False or None"):
        SelfSpecModel(target(), drafter, draft_batches="auto")


def test_a_drafter_without_statistics_or_with_a_tree_they_do_not_hold_drafts_every_batch(monkeypatch):
    asked = predicting(monkeypatch, 1.0, 9.0)
    ids, mask, expected = two_rows()
    fresh = SelfSpecModel(target(), peaked(heads.build("eagle3", target())))  # never calibrated: nothing to go by
    proposed = counting_proposals(fresh)
    assert torch.equal(fresh.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=[]), expected)
    assert proposed and asked == [] and fresh.last_stats["batch_drafting"] is None
    drafter = calibrated()
    assert tree_choice.tree_candidate(drafter.config.calibration, drafter.config.tree) is not None
    by_hand = {**drafter.config.tree, "min_confidence": 0.5}  # no candidate of the statistics drafts with an early stop
    assert tree_choice.tree_candidate(drafter.config.calibration, drafter.config.resolve_tree(by_hand)) is None
    monkeypatch.undo()
    model = SelfSpecModel(target(), drafter, tree=by_hand)
    proposed = counting_proposals(model)
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=[]), expected)
    assert proposed and model.last_stats["batch_drafting"] is None


def test_predict_batch_times_both_ways_at_the_batch_size_and_caches_them(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    drafter = calibrated()
    batches = []
    block_costs, draft_costs = timing.block_costs, timing.draft_costs
    monkeypatch.setattr(timing, "block_costs", lambda *a, **k: batches.append(k["batch"]) or block_costs(*a, **k))
    monkeypatch.setattr(timing, "draft_costs", lambda *a, **k: batches.append(k["batch"]) or draft_costs(*a, **k))
    drafting, none = tree_choice.predict_batch(target(), drafter, drafter.config.tree, 3, context=16, repeats=1)
    assert batches == [3, 3]
    candidate = tree_choice.tree_candidate(drafter.config.calibration, drafter.config.tree)
    assert drafting.candidate == candidate and none.candidate == NO_DRAFTS
    assert min(drafting.draft_seconds, drafting.verify_seconds, none.verify_seconds) > 0
    assert drafting.engine_seconds == none.engine_seconds
    again = tree_choice.predict_batch(target(), drafter, drafter.config.tree, 3, context=16, repeats=1)
    assert again == (drafting, none) and batches == [3, 3]  # read from the cache
    tree_choice.predict_batch(target(), drafter, drafter.config.tree, 2, context=16, repeats=1)
    assert batches == [3, 3, 2, 2]  # another batch size is timed anew


def test_two_cpus_of_one_bare_model_name_keep_their_own_costs():
    """A cloud VM's /proc/cpuinfo may name a Zen 3 (AVX2) and a Zen 5 (AVX-512) both "AMD EPYC": their family and model
    numbers keep the cost curves and trees cached for one from being read on the other."""
    zen3 = "processor\t: 0\ncpu family\t: 25\nmodel\t\t: 1\nmodel name\t: AMD EPYC\nflags\t\t: avx2\n"
    zen5 = zen3.replace(": 25", ": 26").replace(": 1\n", ": 2\n")
    names = cache.cpu_name(zen3), cache.cpu_name(zen5)
    assert names == ("AMD EPYC (family 25, model 1)", "AMD EPYC (family 26, model 2)")
    assert cache.cpu_name(zen5 + "processor\t: 1\ncpu family\t: 25\n") == names[1]  # the first CPU's
    assert cache.cpu_name("model name\t: Some CPU\n") == "Some CPU"
    assert cache.cpu_name("Features\t: neon\n") is None  # no model name: device_name falls back to platform
    assert cache.device_name(torch.device("cpu"))


def test_calibrated_tree_needs_statistics_and_a_trained_drafter():
    t = target()
    with pytest.raises(ValueError, match="scripts/calibrate.py"):
        SelfSpecModel(t, heads.build("eagle", t), tree="calibrated")
    with pytest.raises(ValueError, match="trained drafter"):
        SelfSpecModel(t, "ngram", tree="calibrated")
    with pytest.raises(ValueError, match="'calibrated' or None"):
        SelfSpecModel(t, heads.build("eagle", t), tree="fastest")
    with pytest.raises(ValueError, match="DFlash|settings"):
        acceptance.wide_tree(heads.build("dflash", t.config).config)


# ---- early stop of the dynamic tree -------------------------------------------------------------------------


def test_min_confidence_stops_unsure_rows_early():
    t = target()
    drafter = peaked(heads.build("eagle", t))
    ids = torch.randint(3, 96, (4, 6), generator=torch.Generator().manual_seed(0))
    threshold = 0.6
    drafts = drafter.as_drafter(total_tokens=500, min_confidence=threshold)
    drafts.bind(t, SamplingParams(), batch_size=4)
    out = t(ids, output_hidden_states=True)
    drafts.observe(TargetStep(ids, torch.ones_like(ids, dtype=torch.bool),
                              tuple(out.hidden_states[i] for i in drafts.feature_layers), out.logits[:, -1].argmax(-1)))
    tree = drafts.propose(torch.full((4,), 10))
    depth, _ = tree.depth_and_ancestors()
    deepest = []
    for row in range(4):
        valid = tree.valid[row]
        deepest.append(int(depth[row][valid].max()))
        best = [float(tree.scores[row][valid & (depth[row] == d)].max().exp()) for d in range(1, deepest[-1] + 1)]
        assert all(b >= threshold for b in best[:-1])  # a row expands while its best node is likely enough
        assert deepest[-1] == drafts.tree["depth"] or best[-1] < threshold
    assert min(deepest) < drafts.tree["depth"] == max(deepest)  # this drafter is sure of some rows only


@pytest.mark.parametrize("threshold", [0.3, 0.6, 0.95])
def test_min_confidence_keeps_greedy_output(threshold):
    t = target()
    ids = torch.cat(prompts(2, seed=7))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    expected = t.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, eos_token_id=None,
                          pad_token_id=0)
    for kind in ("eagle", "eagle3"):
        drafter = peaked(heads.build(kind, t.config, tree={"min_confidence": threshold}))
        got = SelfSpecModel(t, drafter).generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=[])
        assert torch.equal(got, expected)


# ---- what a dynamic tree drafts --------------------------------------------------------------------------


@pytest.mark.parametrize("total", [1, 3, 6, 40])
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_dynamic_tree_drafts_only_what_total_tokens_can_keep(kind, total, monkeypatch):
    from heads.eagle.drafter import EagleDrafter

    t = target()
    ids = torch.randint(3, 96, (4, 6), generator=torch.Generator().manual_seed(1))
    out = t(ids, output_hidden_states=True)

    def draft(frontier_size):
        monkeypatch.setattr(EagleDrafter, "_frontier_size", frontier_size)
        drafts = peaked(heads.build(kind, t.config)).as_drafter(depth=4, top_k=4, total_tokens=total)
        drafts.bind(t, SamplingParams(), batch_size=4)
        drafts.observe(TargetStep(ids, torch.ones_like(ids, dtype=torch.bool),
                                  tuple(out.hidden_states[i] for i in drafts.feature_layers),
                                  out.logits[:, -1].argmax(-1)))
        rows = []
        step = drafts._draft_step
        monkeypatch.setattr(drafts, "_draft_step", lambda tokens, *a: rows.append(tokens.shape[1]) or step(tokens, *a))
        return drafts.propose(torch.full((4,), 10)), rows

    capped = EagleDrafter._frontier_size
    tree, rows = draft(capped)
    every, all_rows = draft(lambda self, d, candidates: min(self.tree["top_k"], candidates))  # EAGLE-2 as published
    for name in ("tokens", "parents", "valid"):
        assert torch.equal(getattr(tree, name), getattr(every, name)), name
    torch.testing.assert_close(tree.scores, every.scores)
    assert all_rows == [4, 4, 4]  # top-4 expanded at depths 1-3
    assert rows == {1: [], 3: [2, 1], 6: [4, 4, 3], 40: [4, 4, 4]}[total]


def test_draft_costs_times_each_drafting_shape(monkeypatch):
    # Since the frontier depends on total_tokens, two dynamic trees alike but for it may draft different rows:
    # each shape is timed, and trees of one shape share the timing.
    from heads.eagle.drafter import EagleDrafter

    t = target()
    drafter = heads.build("eagle", t)
    trees = [{"mode": "dynamic", "depth": 3, "top_k": 4, "total_tokens": n, "min_confidence": 0.0}
             for n in (2, 3, 40, 64)]
    assert [drafter.as_drafter(**tree).pass_rows() for tree in trees] == [(1,), (2, 1), (4, 4), (4, 4)]
    timed = {}  # id -> the drafter itself: held, so a freed drafter's id cannot come back for the next one
    propose = EagleDrafter.propose

    def counted(self, budget):
        timed.setdefault(id(self), self)
        return propose(self, budget)

    monkeypatch.setattr(EagleDrafter, "propose", counted)
    costs = timing.draft_costs(t, drafter, trees, context=16, repeats=1, prepack=False)
    assert len(timed) == 3 and costs[2] == costs[3] and len(set(costs[:3])) == 3


@pytest.mark.parametrize(("tree", "message"), [
    ({"min_confidence": 1.5}, r"min_confidence must be a number in \[0, 1\)"),
    ({"min_confidence": -0.1}, "min_confidence must be"),
    ({"min_confidence": "high"}, "min_confidence must be"),
    ({"mode": "static", "min_confidence": 0.5}, "mode='dynamic' or min_confidence=0"),
])
def test_min_confidence_is_validated(tree, message):
    with pytest.raises(ValueError, match=message):
        heads.build("eagle", target().config, tree=tree)


# ---- bad prompt files ---------------------------------------------------------------------------------------


def test_prompt_files(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('"plain text"\n\n{"question_id": 1, "category": "x", "turns": ["first", "second"]}\n'
                    '{"prompt": "p"}\n{"instruction": "do", "input": "this"}\n')
    assert acceptance.load_prompts(good) == ["plain text", "first", "p", "do\n\nthis"]
    array = tmp_path / "array.json"
    array.write_text(json.dumps(["a", {"prompt": "b"}]))
    assert acceptance.load_prompts(array) == ["a", "b"]


@pytest.mark.parametrize(("name", "text", "message"), [
    ("empty.jsonl", "", r"empty\.jsonl holds no prompts \(the file is empty\); write one prompt per line"),
    ("blank.jsonl", "\n  \n", "holds no prompts"),
    ("broken.jsonl", '"fine"\n{"prompt": "cut\n', r"broken\.jsonl: line 2 is not valid JSON .*fix or remove that line"),
    ("fields.jsonl", '{"prompt": "a"}\n{"text": "b"}\n', r"fields\.jsonl: line 2: an object without any of"),
    ("number.jsonl", "7\n", r"number\.jsonl: line 1: a JSON int, not a prompt"),
    ("turns.jsonl", '{"turns": []}\n', r"turns\.jsonl: line 1: 'turns' must hold text"),
    ("blank_prompt.jsonl", '"  "\n', r"blank_prompt\.jsonl: line 1: the prompt is empty"),
    ("broken.json", '[\n"a",\n"b"\n', r"broken\.json: line 4 is not valid JSON"),
    ("element.json", '["a", 3]', r"element\.json: element 1 of the array: a JSON int"),
])
def test_bad_prompt_files_name_the_file_and_line(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        acceptance.load_prompts(path)


def test_missing_prompt_file_fails_before_loading_models(tmp_path):
    missing = tmp_path / "held_out.jsonl"
    with pytest.raises(FileNotFoundError, match=rf"no prompt file at {missing}; pass --prompts"):
        calibrate_cli.main(["--drafter", str(tmp_path / "no_drafter"), "--prompts", str(missing)])


def saved_target(folder: Path):
    """The tiny target saved in `folder` with a word-level tokenizer over its ids w3..w95."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 96)}},
                                       unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t = target()
    t.save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>").save_pretrained(folder)
    return t


def test_script_writes_the_tree_that_calibrated_models_use(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    t = saved_target(tmp_path / "target")
    heads.build("eagle", t).save_pretrained(tmp_path / "drafter")
    prompts_file = tmp_path / "held_out.jsonl"
    prompts_file.write_text("".join(json.dumps(" ".join(f"w{(7 * i + j) % 90 + 3}" for j in range(6))) + "\n"
                                    for i in range(3)))
    calibrate_cli.main(["--drafter", str(tmp_path / "drafter"), "--prompts", str(prompts_file), "--target",
                             str(tmp_path / "target"), "--wide", "32", "--max-nodes", "8", "--max-new-tokens", "12",
                             "--context", "16", "--repeats", "1", "--threads", "1", "--write"])
    printed = capsys.readouterr().out
    assert "| N | E_acc | verify ms | draft ms | predicted tokens/s | tree |" in printed and "**best**" in printed
    assert "| 0 | 0.000 |" in printed and "| no drafts |" in printed and "no drafts predicted" in printed
    saved = heads.load(tmp_path / "drafter")
    assert saved.config.calibration["measured"][0]["mode"] == "dynamic"
    chosen = saved.config.tree
    assert chosen["total_tokens"] <= 8 and f"dynamic, depth {chosen['depth']}" in printed
    ids = torch.tensor([[5, 6, 7, 8]])
    expected = t.generate(ids, do_sample=False, max_new_tokens=10, eos_token_id=None, pad_token_id=0)
    model = SelfSpecModel(t, saved, tree="calibrated")
    assert torch.equal(model.generate(ids, max_new_tokens=10, eos_token_id=[]), expected)
    lookup = saved.config.calibration["lookup_first"]
    assert saved.config.resolve_tree(lookup["tree"]) == chosen and lookup["prompts"] == 3
    assert saved.config.lookup_first is lookup["pays"]
    assert ("lookup first pays" if lookup["pays"] else "lookup first does not pay") in printed
    assert ("drafting pays" if lookup["drafting_pays"] else "drafting does not pay on this machine") in printed
    card = (tmp_path / "drafter" / "README.md").read_text()
    assert f"no drafts (one token a target forward through the same engine): {lookup['no_drafts']['tokens_per_second']:.1f}" in card
    assert isinstance(model.drafter, LookupFirstDrafter) is lookup["pays"]


def test_script_can_leave_lookup_first_unmeasured(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    heads.build("eagle3", saved_target(tmp_path / "target")).save_pretrained(tmp_path / "drafter")
    prompts_file = tmp_path / "held_out.jsonl"
    prompts_file.write_text(json.dumps("w5 w6 w7 w8 w9 w10") + "\n")
    calibrate_cli.main(["--drafter", str(tmp_path / "drafter"), "--prompts", str(prompts_file), "--target",
                             str(tmp_path / "target"), "--wide", "32", "--max-nodes", "8", "--max-new-tokens", "12",
                             "--context", "16", "--repeats", "1", "--threads", "1", "--no-lookup-first", "--write"])
    assert "lookup first" not in capsys.readouterr().out
    saved = heads.load(tmp_path / "drafter")
    assert saved.config.lookup_first is None and "lookup_first" not in saved.config.calibration


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_lookup_first_is_measured_both_ways_on_the_same_output(kind, monkeypatch):
    t = target()
    drafter = peaked(heads.build(kind, t))
    ids = prompts(3)
    steps = []
    propose = LookupFirstDrafter.propose
    monkeypatch.setattr(LookupFirstDrafter, "propose", lambda self, budget: steps.append(1) or propose(self, budget))
    result = acceptance.measure_lookup_first(t, drafter, ids, drafter.config.tree, max_new_tokens=12)
    alone, first, none = result["alone"], result["lookup_first"], result["no_drafts"]
    assert alone["new_tokens"] == first["new_tokens"] == none["new_tokens"] == 3 * 12  # greedy: the same tokens
    assert len(steps) >= first["target_forwards"] - 3  # every drafting step of that way went through lookup
    assert none["target_forwards"] == none["new_tokens"]  # no drafts: one token a forward, the prefill's included
    for entry in (alone, first, none):
        assert entry["tokens_per_second"] == entry["new_tokens"] / entry["seconds"]
    assert result["pays"] is (first["tokens_per_second"] > alone["tokens_per_second"])
    drafting = max(alone["tokens_per_second"], first["tokens_per_second"])
    assert result["drafting_pays"] is (drafting > none["tokens_per_second"])
    with pytest.raises(ValueError, match="at least one held-out prompt"):
        acceptance.measure_lookup_first(t, drafter, [], drafter.config.tree)


def test_the_drafters_lookup_first_is_the_default_the_user_can_override(tmp_path):
    t = target()
    drafter = heads.build("eagle3", t)
    assert not isinstance(SelfSpecModel(t, drafter).drafter, LookupFirstDrafter)  # unset: off
    drafter.config.lookup_first = True
    drafter.save_pretrained(tmp_path / "drafter")
    saved = heads.load(tmp_path / "drafter")
    assert isinstance(SelfSpecModel(t, saved).drafter, LookupFirstDrafter)
    assert not isinstance(SelfSpecModel(t, saved, lookup_first=False).drafter, LookupFirstDrafter)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8]])
    expected = t.generate(ids, do_sample=False, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    assert torch.equal(SelfSpecModel(t, saved).generate(ids, max_new_tokens=12, eos_token_id=[]), expected)


def test_a_shallow_chosen_tree_does_not_narrow_the_next_measurement():
    t = target()
    config = heads.build("eagle3", t).config
    config.tree = {**config.tree, "mode": "dynamic", "depth": 1}  # what --write chose on a machine
    config.calibration = {"measured": [{"mode": "dynamic", "tree": {**config.tree, "depth": 3}}]}
    assert acceptance.wide_tree(config)["depth"] == 3  # measured as deep as before
    assert acceptance.wide_tree(config, depth=2)["depth"] == 2  # unless asked
    config.calibration = None
    assert acceptance.wide_tree(config)["depth"] == 1


def test_writing_keeps_the_stored_weights_dtype(tmp_path):
    t = target()
    heads.build("eagle3", t).half().save_pretrained(tmp_path / "drafter")
    drafter = heads.load(tmp_path / "drafter", dtype=torch.float32)  # as a shipped drafter loads by name
    lookup = {"pays": True, "alone": {"tokens_per_second": 40.0}, "lookup_first": {"tokens_per_second": 44.0},
              "prompts": 16, "device": "a CPU", "threads": 2}
    write_calibration(tmp_path / "drafter", drafter, {"measured": []}, {"depth": 2}, lookup)
    stored = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert stored["dtype"] == "float16" and stored["lookup_first"] is True and stored["tree"]["depth"] == 2
    card = (tmp_path / "drafter" / "README.md").read_text()
    assert "Prompt lookup first is on by default" in card and "lookup first 44.0 tokens/s" in card
    assert drafter.config.lookup_first is True and drafter.config.tree["depth"] == 2  # in memory too
    assert heads.load(tmp_path / "drafter").dtype == torch.float16
