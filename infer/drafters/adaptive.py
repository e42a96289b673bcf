"""How far to draft: stop a chain where one more draft token no longer pays for itself.

A chain drafter proposes tokens one at a time. Drafting token i costs `c_draft` seconds; it adds one
token to the step only if the target accepts it and every token before it. With `P_i` that cumulative
probability, the step yields E = sum_i P_i + 1 tokens for T = verify + i * c_draft seconds, and one more
token raises E / T exactly when P_{i+1} > c_draft * E / T, i.e. when its chance of being kept beats the
draft cost measured in tokens of the current pace. That is the stopping rule here; it is the continuous
form of transformers' `assistant_confidence_threshold` and of EAGLE-2's expansion by cumulative
confidence (Li et al. 2024b).

The drafter's own probability is not the target's acceptance rate, so it is calibrated online: drafted
tokens are binned by the drafter's confidence, and each bin counts how often the target accepted such a
token whose parent it had accepted, shrunk towards the acceptance rate over all bins while a bin has
few counts. The draft cost is a running average of the wall time between consecutive drafted tokens,
measured apart from a step's whole drafting time: a step's first draft also pays for catching up on
the tokens just committed, a fixed cost per step that one token more or less does not change (counted
per token, it kept chains at one token for good once they got there). A verify step's cost is fitted
online as a + b * drafts, so the marginal cost of a draft token is c_draft + b (on a CPU a wider
verify is not free). Nothing here affects which tokens are emitted,
only how many are proposed, so exactness never depends on it.

The same comparison decides whether to draft at all: once `MEASURED` drafting steps have settled the
calibration, a step drafts only if drafting steps have produced tokens faster than a plain step would
(`worth_drafting`). A drafter that does not pay on this machine (a shallow early exit, say) then costs a
probe step in `PROBE`, not every step, and resumes drafting when probes show its acceptance has come back
(a probe's drafting time, which includes catching up on the skipped tokens, does not count as draft cost).

Under sampling, which tokens come out depends on what was drafted at each step (rejection sampling draws
from the drafts), so draft lengths there must not follow the clock or what earlier calls left, or one seed
would give another sample on every call. A sampled generation therefore gets a fresh `AdaptiveLength` with a
modelled `cost`: a draft token costs that fraction of a verify step (the bytes of weights a draft forward
reads over the target's, `forward_bytes`) and nothing is timed. The same rule then decides from acceptance
alone, which is the same for the same seed.
"""

from __future__ import annotations

import math
import time

import torch

BINS = 20
PROBE = 8  # a drafter that does not pay still drafts one step in PROBE, to notice when it would again
MEASURED = 16  # drafting steps judged before worth_drafting may say no (the calibration settles first)


class AdaptiveLength:
    """Per-generation state: calibration bins, cost averages and the chains drafted this step."""

    def __init__(self, max_tokens: int, min_tokens: int = 1, decay: float = 0.995, prior: float = 2.0,
                 cost: float | None = None):
        if not 1 <= min_tokens <= max_tokens:
            raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {min_tokens}, {max_tokens}")
        if cost is not None and not (math.isfinite(cost) and cost > 0):
            raise ValueError(f"cost must be a positive fraction of a verify step, got {cost}")
        self.max_tokens, self.min_tokens, self.decay, self.prior = max_tokens, min_tokens, decay, prior
        self.cost = cost  # a draft token's modelled cost in verify steps; None: costs are timed
        self.kept = torch.zeros(BINS, dtype=torch.float64)  # decayed counts of accepted drafts per bin
        self.seen = torch.zeros(BINS, dtype=torch.float64)  # decayed counts of judged drafts per bin
        # costs in seconds, or in verify steps where modelled (the rule only compares them with one another)
        self.draft_cost = cost  # between consecutive drafted tokens (running average)
        self.draft_time = None  # of drafting per step, catch-up included (running average)
        self.step_cost = None if cost is None else 1.0  # per verify step, drafting excluded (running average)
        self.fit = torch.zeros(5, dtype=torch.float64)  # decayed sums 1, n, t, n*n, n*t of (drafts, verify s)
        self.tokens_per_step = None  # tokens emitted per step (running average)
        self._confidence: list[list[float]] = []  # per row, the confidences drafted this step
        self._proposed_at = None
        self.judged_steps = 0  # drafting steps measured so far
        self.idle = 0  # steps skipped since the last drafting step
        self._probe = False  # this step drafts after skipped ones
        self._untimed = False  # this step's drafting included one-off work (a compile): not a draft cost

    def new_generation(self) -> None:
        """Forget a step left half-done (calibration and costs carry over between generations)."""
        self._confidence, self._proposed_at = [], None

    # ------------------------------------------------------------------ during drafting
    def worth_drafting(self) -> bool:
        """Whether this step should draft at all: True while too little is measured, when the steps that
        drafted produced more tokens per second than plain steps would, and for one probe step in PROBE."""
        if self.judged_steps < MEASURED or self.draft_time is None:
            return True
        # a plain step costs at most a verify step with drafts (step_cost): that errs towards drafting, and
        # unlike a fitted intercept it cannot be thrown far off by a few noisy steps
        drafting = self.tokens_per_step / (self.step_cost + self.draft_time)
        if drafting * self.step_cost > 1.0:
            self.idle, self._probe = 0, False
            return True
        self.idle += 1
        self._probe = self.idle % PROBE == 0
        return self._probe

    def start(self, rows: int) -> None:
        """A new step of `rows` chains begins."""
        self._confidence = [[] for _ in range(rows)]
        self._cum = [1.0] * rows
        self._untimed = False
        self._draft_started = time.perf_counter()
        self._first_draft = [0.0] * rows  # per row, when its first and latest drafts were made
        self._last_draft = [0.0] * rows

    def untimed(self) -> None:
        """This step's drafting did one-off work (compiling a graph): its wall time is not a draft cost."""
        self._untimed = True

    def keep_going(self, row: int, confidence: float) -> bool:
        """Record row's newest draft (the drafter's probability for it); True if drafting one more pays."""
        self._confidence[row].append(confidence)
        self._cum[row] *= self.accept_rate(confidence)
        depth = len(self._confidence[row])
        self._last_draft[row] = time.perf_counter()
        if depth == 1:
            self._first_draft[row] = self._last_draft[row]
        if depth < self.min_tokens:
            return True
        if depth >= self.max_tokens:
            return False
        return self._cum[row] > self.threshold()

    def threshold(self) -> float:
        """Cumulative acceptance below which another draft token lowers tokens per second."""
        if self.draft_cost is None or self.step_cost is None or self.tokens_per_step is None:
            return 0.0  # nothing measured yet: draft to max_tokens once
        pace = self.tokens_per_step / (self.step_cost + self.draft_time)
        return (self.draft_cost + self.verify_slope()) * pace

    def verify_slope(self) -> float:
        """Seconds a verify step gains per extra draft token (0 until the drafts per step have varied)."""
        w, n, t, nn, nt = self.fit.tolist()
        if w < 2:
            return 0.0
        var = nn / w - (n / w) ** 2
        if var < 0.5:
            return 0.0
        return max(0.0, (nt / w - (n / w) * (t / w)) / var)

    def accept_rate(self, confidence: float) -> float:
        """Calibrated P(target keeps a draft | its parent was kept) for a drafter confidence."""
        b = min(int(confidence * BINS), BINS - 1)
        overall = float((self.kept.sum() + self.prior * confidence) / (self.seen.sum() + self.prior))
        return float((self.kept[b] + self.prior * overall) / (self.seen[b] + self.prior))

    def drafted(self) -> None:
        """Drafting for this step is over (the engine verifies next)."""
        n = max(len(c) for c in self._confidence) if self._confidence else 0
        self._drafted_now = n
        if self.cost is not None:  # modelled: n draft tokens, then one verify step
            if n:
                self.draft_time = _average(self.draft_time, n * self.cost)
            self._proposed_at = 0.0
            return
        now = time.perf_counter()
        # a probe's drafting includes catching up on the skipped steps' tokens, an untimed step a compile:
        # neither is what drafting costs
        if n and not (self._probe or self._untimed):
            self.draft_time = _average(self.draft_time, now - self._draft_started)
            # per row (rows may draft one after another, as llama.cpp's do), then over the rows
            gaps = [(last - first) / (len(c) - 1)
                    for c, first, last in zip(self._confidence, self._first_draft, self._last_draft, strict=True)
                    if len(c) > 1]
            if gaps:
                self.draft_cost = _average(self.draft_cost, sum(gaps) / len(gaps))
            elif self.draft_cost is None:
                self.draft_cost = now - self._draft_started
        self._proposed_at = now

    # ------------------------------------------------------------------ after verification
    def judged(self, accepted: torch.Tensor) -> None:
        """The target kept `accepted[b]` of row b's drafts: update calibration and costs."""
        if self._proposed_at is None:
            return
        self.judged_steps += 1
        seconds = 1.0 if self.cost is not None else time.perf_counter() - self._proposed_at
        self.step_cost = _average(self.step_cost, seconds)
        self._proposed_at = None
        n = float(self._drafted_now)
        self.fit = self.fit * 0.98 + torch.tensor([1.0, n, seconds, n * n, n * seconds], dtype=torch.float64)
        self.kept *= self.decay
        self.seen *= self.decay
        for row, n_kept in enumerate(accepted.tolist()):
            confs = self._confidence[row] if row < len(self._confidence) else []
            for i, c in enumerate(confs[:n_kept + 1]):  # drafts past the first rejection were not judged
                b = min(int(c * BINS), BINS - 1)
                self.seen[b] += 1
                self.kept[b] += float(i < n_kept)
        self.tokens_per_step = _average(self.tokens_per_step, float(accepted.double().mean()) + 1)

    def select_rows(self, rows: torch.Tensor) -> None:
        if self._confidence:
            keep = [int(r) for r in rows]
            self._confidence = [self._confidence[r] for r in keep]
            self._first_draft = [self._first_draft[r] for r in keep]
            self._last_draft = [self._last_draft[r] for r in keep]


def _average(old: float | None, new: float, weight: float = 0.2) -> float:
    return new if old is None else (1 - weight) * old + weight * new


def forward_bytes(model) -> int:
    """Bytes of weights one forward of `model` reads: each parameter and buffer once, but not the input
    embedding, of which a forward reads one row a token (unless the output layer reads it whole, tied)."""
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    skip = {id(embed.weight)} if embed is not None and getattr(head, "weight", None) is not embed.weight else set()
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()] if id(t) not in skip}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def modelled_cost(draft_bytes: int, target) -> float:
    """A draft token's cost in verify steps, modelled as its bytes over the target's: decoding reads every
    weight once a token, so on any machine the two scale alike."""
    return max(draft_bytes / max(forward_bytes(target), 1), 1e-3)
