"""Settling `SelfSpecModel`'s options into the plan the engine runs.

Every option left to "where it pays" is decided here, before the engine exists, by timing this machine where it
must (each timing cached per machine): prepacked weights and the streamed kernel's block sizes, the lean verify
forward (`infer.tuning.plan`), a calibrated tree (`infer.tree_choice.calibrated_tree`), the captured step on a GPU
(`captured_step`), and whether a call of several rows drafts (`BatchDrafting`, asked by the engine at each call of
several rows, timed on the first of each batch size). The engine (`infer.engine.Engine`) runs the resulting `Plan`
and decides nothing.
"""

from __future__ import annotations

from dataclasses import replace

from .options import EngineOptions, Plan
from .tree_choice import calibrated_tree, predict_batch
from .tuning.plan import check_drafter, check_target, plan, prepack_for, target_devices

# A call of several rows drafts only where drafting is predicted this much faster than no drafts: the predictions are
# estimates good to about 10% (docs/calibration.md), and where the two are that close no drafts loses little; at two
# rows on a CPU a prediction a few percent ahead has measured well behind (docs/benchmarks.md, "Batches").
BATCH_MARGIN = 1.1


def settle(target, drafter, options: EngineOptions) -> Plan:
    """The plan for `target` and `drafter` (a name, heads model, draft LM or `infer.Drafter`) under `options`:
    checked first, then `tree="calibrated"` chosen for this machine, then the drafter, kernels and forwards, and
    for a trained drafter with acceptance statistics, `draft_batches=None` predicted per batch size."""
    check_target(target, options)
    check_drafter(drafter)
    prepack = prepack_for(target, options.cpu_prepack)
    tree = options.tree
    if tree == "calibrated" and hasattr(drafter, "as_drafter"):  # as_drafter refuses any other drafter
        tree = calibrated_tree(drafter, target, options.tokenizer, prepack=prepack)
    settled = plan(target, drafter, options, prepack, tree)
    calibration = getattr(getattr(drafter, "config", None), "calibration", None)
    if options.draft_batches is None and hasattr(drafter, "as_drafter") and calibration and calibration.get("measured"):
        drafted = drafter.config.resolve_tree({**drafter.config.tree, **(tree or {})})  # the tree it drafts
        settled = replace(settled, batch_drafting=BatchDrafting(target, drafter, drafted, prepack))
    devices, captured = target_devices(target), captured_step(target, settled.options)
    # the captured step keeps acceptance on the device, as on a GPU (on a CPU it stands in for that path)
    return replace(settled, captured_step=captured,
                   host_acceptance=not captured and bool(devices) and all(d.type == "cpu" for d in devices))


def captured_step(target, options: EngineOptions) -> bool:
    """Whether the step runs captured (`EngineOptions.captured_step`): as asked, else on a target on one CUDA device
    with a static cache (with `compile`, its graphs capture the compiled forward), where launches and host reads, not
    the weights' bytes, bound a step's time. A graph replays one device's work: a target spread over
    devices, or offloaded, is not captured (asking for it is refused)."""
    devices = target_devices(target)
    if options.captured_step is not None:
        if options.captured_step and len(devices) > 1:
            raise ValueError(f"captured_step=True: the target's weights lie on {sorted(map(str, devices))}, and a CUDA "
                             "graph replays one device's work; load the target on one GPU, or pass captured_step=False")
        return options.captured_step
    return bool(options.static_cache) and len(devices) == 1 and next(iter(devices)).type == "cuda"


class BatchDrafting:
    """Whether a call of several rows drafts, per batch size: where `predict_batch` predicts drafting `tree` faster
    than no drafts by more than BATCH_MARGIN. Predicted on the first call of each batch size (timed then, cached per
    machine) and kept; None where the drafter's statistics hold no such tree (nothing to go by: it drafts)."""

    def __init__(self, target, drafter, tree: dict, prepack: bool):
        self.target, self.drafter, self.tree, self.prepack = target, drafter, tree, prepack
        self._choices: dict[int, dict | None] = {}  # one engine's, whose calls run one at a time

    def __call__(self, rows: int) -> dict | None:
        if rows not in self._choices:
            self._choices[rows] = self._predict(rows)
        return self._choices[rows]

    def _predict(self, rows: int) -> dict | None:
        predicted = predict_batch(self.target, self.drafter, self.tree, rows, prepack=self.prepack)
        if predicted is None:
            return None
        drafting, none = (rows * p.tokens_per_second for p in predicted)
        return {"batch": rows, "drafts": drafting > BATCH_MARGIN * none, "why": "predicted", "margin": BATCH_MARGIN,
                "predicted_tokens_per_second": {"drafting": drafting, "no_drafts": none}}
