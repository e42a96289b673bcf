"""Host reads per decode step: what would stall a GPU's queue, counted on the CPU so a regression shows without one.

Every time the loop reads a tensor's value on the host (`.item()`, `.tolist()`, `bool(t)`, `int(t)`, `.cpu()`,
`.numpy()`, a data-dependent shape such as `nonzero()` or a boolean-mask index), a GPU has to finish all the work
queued before it: the launch queue drains and the step turns launch-bound. The device path's target (issue #49) is
one read per step, of the accepted lengths and tokens, which the host needs anyway (output, eos, the budget).

Copies of host values to the device are counted too (`torch.tensor(values, device=...)`): without `non_blocking`
from pinned memory, torch waits for the device's queue before such a copy, as it does for a read. The device path's
target there is none a step.

Reads are counted with a `TorchFunctionMode` between consecutive calls of the engine's `step_observer`, so each
count covers one whole step (emit, drafter observe, budget, propose, verify, accept, commit) and neither the
prefill nor the set-up of a call.
"""

from __future__ import annotations

import pytest
import torch
from conftest import perturbed_copy, tiny_model
from torch.overrides import TorchFunctionMode

import heads
from infer import SelfSpecModel
from infer.drafters.draft_model import DraftModelDrafter

# Tensor methods and torch functions whose result is a host value, or whose output shape depends on the data
_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__", "numpy", "cpu",
          "nonzero", "argwhere", "equal", "allclose", "unique", "unique_consecutive", "masked_select"}


def _is_read(func, args, kwargs) -> bool:
    name = getattr(func, "__name__", "")
    if name in _READS:
        return True
    if name == "to":  # a copy from an accelerator to the host (on a CPU, `.to(model.device)` is not one)
        where = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, (str, torch.device))]
        return args[0].device.type != "cpu" and any(torch.device(w).type == "cpu" for w in where)
    if name in ("__getitem__", "__setitem__"):  # indexing by a boolean mask: a data-dependent shape
        index = args[1] if len(args) > 1 else None
        parts = index if isinstance(index, tuple) else (index,)
        return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)
    if name == "repeat_interleave":  # without output_size, the output length is read from the repeats
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    return False


def _is_upload(func, args, kwargs) -> bool:
    """A tensor made from host values (a list, a number) straight onto a device."""
    name = getattr(func, "__name__", "")
    return name in ("tensor", "as_tensor") and "device" in kwargs and not isinstance(args[0], torch.Tensor)


class HostReads(TorchFunctionMode):
    """Counts host reads; `step_observer` (an engine option) snapshots the count after every verify step."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.uploads = 0
        self.names: list[str] = []
        self.at_steps: list[int] = []
        self.uploads_at_steps: list[int] = []
        self._names_at: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_read(func, args, kwargs):
            self.count += 1
            self.names.append(getattr(func, "__name__", str(func)))
        self.uploads += _is_upload(func, args, kwargs)
        return func(*args, **kwargs)

    def step_observer(self, tree, acceptance, budget) -> None:
        self.at_steps.append(self.count)
        self.uploads_at_steps.append(self.uploads)
        self._names_at.append(len(self.names))

    def per_step(self) -> list[int]:
        """Reads of each whole step: from one verify's observer call to the next."""
        return [b - a for a, b in zip(self.at_steps, self.at_steps[1:], strict=False)]

    def uploads_per_step(self) -> list[int]:
        return [b - a for a, b in zip(self.uploads_at_steps, self.uploads_at_steps[1:], strict=False)]

    def last_step_names(self) -> list[str]:
        return self.names[self._names_at[-2]:self._names_at[-1]] if len(self._names_at) > 1 else []


def _drafter(kind: str, target):
    if kind in ("none", "ngram", "suffix") or kind.startswith("lookahead"):  # by name: the host-side lookups
        return kind
    if kind.startswith(("draft_model", "early_exit")):  # a separate small LM, the target's first layers
        adaptive = kind.endswith("adaptive")
        model = perturbed_copy(target) if kind.startswith("draft_model") else None
        return DraftModelDrafter(model, num_tokens=4, adaptive=adaptive) if model is not None else kind
    drafter = heads.build(kind, target)
    torch.manual_seed(3)
    return drafter


def count_reads(kind: str, do_sample: bool, max_new_tokens: int = 16, bans: bool = False, **options) -> HostReads:
    target = tiny_model("llama")
    # the device path: the captured step (its static buffers run uncaptured on a CPU), and none of the CPU-only
    # lean forwards or prepacked weights, which read on the host by design
    options = {"static_cache": True, "captured_step": True, "cpu_prepack": False, "lean_verify": False, **options}
    model = SelfSpecModel(target, _drafter(kind, target), **options)
    ids = torch.tensor([[5, 9, 14, 22, 31, 7, 8]])
    sampling = {"do_sample": True, "temperature": 0.8, "top_p": 0.9, "generator": torch.Generator().manual_seed(0)} \
        if do_sample else {"do_sample": False}
    counter = HostReads()
    model.step_observer = counter.step_observer
    with counter:
        if bans:  # token bans, applied to the verified logits at every step
            sampling.update(eos_token_id=[3], min_new_tokens=max_new_tokens, suppress_tokens=[4, 6],
                            begin_suppress_tokens=[7])
        else:
            sampling.update(eos_token_id=[])
        model.generate(ids, max_new_tokens=max_new_tokens, **sampling)
    assert len(counter.per_step()) >= 2, "too few steps to count"
    return counter


def test_the_counter_sees_reads():
    """The counter has teeth: each kind of read is seen, and tensor arithmetic is not."""
    x = torch.tensor([1, 2, 3])
    with HostReads() as counter:
        y = x * 2 + 1
        torch.where(y > 2, y, 0).argmax()
    assert counter.count == 0
    with HostReads() as counter:
        x[0].item(), x.tolist(), bool(x[0]), int(x[1]), x.nonzero(), x[x > 1], x.cpu()
        [7, 8, 9][x[0]]
        torch.tensor([1, 2], device=x.device), torch.tensor([1, 2])  # an upload; a host tensor
    assert counter.count == 8, counter.names
    assert counter.uploads == 1


# (drafter kind, sampled): the device path's target is one read a step. Sampled steps of deterministic drafts walk
# the tree on the device (`infer.verify.accept_drawn`); sampled drafts with their q (a draft model, DFlash's sampled
# chain) still walk it on the host and are not counted here.
# With `bans`, token bans (suppress_tokens, begin_suppress_tokens, min_new_tokens) apply to every step's logits.
# Prompt lookup, suffix decoding and lookahead run on the host, from what the step's one read brought back (the
# committed tokens, `TargetStep.host_tokens`; lookahead's window: the target's argmax at its scored nodes, in the
# same read); "+lookup" is a trained drafter with prompt lookup first, as the shipped one loads. A draft model (a
# separate LM; the target's first layers) drafts its whole chain on the captured step, an adaptive one too, and learns
# how many tokens each row kept from the same read.
CASES = [("none", False, False), ("eagle3", False, False), ("eagle", False, False), ("medusa", False, False),
         ("dflash", False, False), ("none", True, False), ("eagle3", True, False), ("eagle", True, False),
         ("medusa", True, False), ("none", False, True), ("eagle3", True, True), ("ngram", False, False),
         ("ngram", True, False), ("suffix", False, False), ("lookahead:4,3,4", False, False),
         ("lookahead:4,3,4", True, False), ("eagle3+lookup", False, False),
         ("eagle3+lookup", True, False), ("draft_model", False, False), ("draft_model:adaptive", False, False),
         ("early_exit:1", False, False)]


@pytest.mark.parametrize(("kind", "do_sample", "bans"), CASES)
def test_one_host_read_per_step(kind, do_sample, bans):
    kind, _, lookup = kind.partition("+")
    counter = count_reads(kind, do_sample, bans=bans, **({"lookup_first": True} if lookup else {}))
    steps = counter.per_step()
    assert max(steps) <= 1, f"host reads per step: {steps}; the last step's: {counter.last_step_names()}"
    assert max(counter.uploads_per_step()) == 0, f"host values copied to the device per step: {counter.uploads_per_step()}"


class TorchCalls(TorchFunctionMode):
    """Python-level torch calls (functions and tensor methods), a forward on the captured step's seam
    (`infer.cuda.StepGraphs`) counted as one call: on a GPU it is one graph replay, whatever it runs on a CPU."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.paused = 0
        self.at_steps: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += not self.paused
        return func(*args, **(kwargs or {}))

    def step_observer(self, tree, acceptance, budget) -> None:
        self.at_steps.append(self.count)


# Python-level torch calls per EAGLE-3 step of the tiny Llama (depth 6, top-k 8, 48 nodes) on the captured path, the
# verify forward and the drafter's forwards on the seam: about 1,025 (1,666 while the drafter's six forwards ran
# outside it). Launch overhead a GPU pays per call: a bound with some slack, so a regression shows without a GPU.
EAGLE3_STEP_CALLS = 1100


def test_torch_calls_per_captured_eagle3_step(monkeypatch):
    from infer.cuda import StepGraphs

    counter = TorchCalls()
    forward = StepGraphs._forward

    def one_call(self, *args, **kwargs):  # the forward on the seam: one replay on a GPU
        counter.count += 1
        counter.paused += 1
        try:
            return forward(self, *args, **kwargs)
        finally:
            counter.paused -= 1

    monkeypatch.setattr(StepGraphs, "_forward", one_call)
    target = tiny_model("llama")
    model = SelfSpecModel(target, _drafter("eagle3", target), static_cache=True, captured_step=True,
                          cpu_prepack=False, lean_verify=False)
    model.step_observer = counter.step_observer
    with counter:
        model.generate(torch.tensor([[5, 9, 14, 22, 31, 7, 8]]), max_new_tokens=16, do_sample=False, eos_token_id=[])
    steps = [b - a for a, b in zip(counter.at_steps, counter.at_steps[1:], strict=False)]
    assert len(steps) >= 2 and model.drafter._captured.calls > 0
    assert max(steps) <= EAGLE3_STEP_CALLS, f"torch calls per captured EAGLE-3 step: {steps}"
