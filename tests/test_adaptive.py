"""The adaptive draft length's rule for drafting at all: a drafter whose steps are slower than plain ones
stops drafting but for a probe step in PROBE, and one that pays keeps drafting. Driven with a fake clock,
so the costs are exact."""

from __future__ import annotations

import pytest
import torch

from infer.drafters import adaptive
from infer.drafters.adaptive import MEASURED, PROBE, AdaptiveLength


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_steps(length: AdaptiveLength, clock: Clock, steps: int, *, draft_s: float, verify_s: float,
              confidence: float, accepted: int) -> list[bool]:
    """`steps` engine steps of one row: each drafts (when worth it) 3 tokens at `draft_s` each, then a
    verify of `verify_s` keeps `accepted` of them. Returns worth_drafting's answer per step."""
    answers = []
    for _ in range(steps):
        drafting = length.worth_drafting()
        answers.append(drafting)
        if drafting:
            length.start(1)
            for _ in range(3):
                clock.now += draft_s
                if not length.keep_going(0, confidence):
                    break
            length.drafted()
        clock.now += verify_s
        length.judged(torch.tensor([accepted if drafting else 0]))
    return answers


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(adaptive.time, "perf_counter", fake)
    return fake


def test_a_drafter_that_does_not_pay_only_probes(clock):
    # a draft token costs 60% of a verify and is never kept: drafting steps are slower than plain ones
    length = AdaptiveLength(max_tokens=3)
    answers = run_steps(length, clock, MEASURED + 4 * PROBE, draft_s=0.06, verify_s=0.1, confidence=0.9,
                        accepted=0)
    assert all(answers[:MEASURED])  # measured first
    later = answers[MEASURED:]
    assert sum(later) == len(later) // PROBE  # then one probe step in PROBE
    assert later[PROBE - 1] and not any(later[:PROBE - 1])


def test_a_drafter_that_pays_keeps_drafting(clock):
    # cheap drafts, two of three kept: 3 tokens per 0.13 s against 1 per 0.1 s
    length = AdaptiveLength(max_tokens=3)
    answers = run_steps(length, clock, 40, draft_s=0.01, verify_s=0.1, confidence=0.9, accepted=2)
    assert all(answers)


def test_drafting_resumes_when_a_probe_finds_acceptance_back(clock):
    length = AdaptiveLength(max_tokens=3)
    idle = run_steps(length, clock, MEASURED + 2 * PROBE, draft_s=0.03, verify_s=0.1, confidence=0.9, accepted=0)
    assert sum(idle[-PROBE:]) == 1  # it had stopped drafting
    # the drafter's guesses start being kept: the probes measure it and drafting comes back for good
    answers = run_steps(length, clock, 6 * PROBE, draft_s=0.03, verify_s=0.1, confidence=0.9, accepted=3)
    assert all(answers[-PROBE:])


def test_an_untimed_step_is_not_a_draft_cost(clock):
    # the first step compiles the draft forward (60 s); a paying drafter must not be judged by it
    length = AdaptiveLength(max_tokens=3)
    length.worth_drafting()
    length.start(1)
    length.untimed()
    clock.now += 60.0
    length.keep_going(0, 0.9)
    length.drafted()
    clock.now += 0.1
    length.judged(torch.tensor([1]))
    answers = run_steps(length, clock, MEASURED + 2 * PROBE, draft_s=0.01, verify_s=0.1, confidence=0.9,
                        accepted=2)
    assert all(answers)
    assert length.draft_cost == pytest.approx(0.01)


def test_catching_up_is_not_counted_per_draft_token(clock):
    # each step's first draft also catches up on the committed tokens (50 ms); later drafts cost 5 ms. The
    # target rejects everything for 20 steps, which cuts chains to one token and stops drafting, then keeps
    # everything: counted per token, a one-token chain costs 50 ms a draft and drafting never came back
    length = AdaptiveLength(max_tokens=8)
    depths = []
    for step in range(300):
        if not length.worth_drafting():
            clock.now += 0.03
            length.judged(torch.tensor([0]))
            depths.append(0)
            continue
        length.start(1)
        clock.now += 0.05
        depth = 1
        while length.keep_going(0, 0.99):
            clock.now += 0.005
            depth += 1
        length.drafted()
        clock.now += 0.03
        length.judged(torch.tensor([depth if step >= 20 else 0]))
        depths.append(depth)
    assert length.draft_cost == pytest.approx(0.005)
    assert depths[-100:] == [8] * 100


def test_rows_drafted_one_after_another_are_timed_per_row(clock):
    # llama.cpp drafts row 0's chain, then row 1's, each after its own 50 ms catch-up: a draft still costs 5 ms
    length = AdaptiveLength(max_tokens=4)
    length.start(2)
    for row in range(2):
        clock.now += 0.05
        for _ in range(4):
            length.keep_going(row, 0.9)
            clock.now += 0.005
    length.drafted()
    assert length.draft_cost == pytest.approx(0.005)
    assert length.draft_time == pytest.approx(0.14)
