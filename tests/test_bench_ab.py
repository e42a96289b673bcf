"""The A/B benchmark's summary (train/apps/bench/ab.py): medians per revision, the change, and whether both
revisions generated the same tokens."""

from __future__ import annotations

from train.apps.bench import ab


def _run(revision: str, drafter: str, tokens_per_s: float, outputs: str = "same") -> dict:
    return {"revision": revision, "drafter": drafter, "tokens_per_s": tokens_per_s, "tau": 1.5, "outputs": outputs}


def test_the_summary_is_the_median_of_each_revisions_runs():
    runs = [_run("base", "none", 100.0), _run("head", "none", 90.0), _run("head", "none", 110.0),
            _run("base", "none", 104.0), _run("base", "none", 96.0), _run("head", "none", 105.0)]
    (row,) = ab.summary(runs, ["none"])
    assert row["base_tokens_per_s"] == 100.0 and row["head_tokens_per_s"] == 105.0
    assert row["change"] == 0.05 and row["same_tokens"]
    assert row["base_runs"] == [100.0, 104.0, 96.0] and row["head_runs"] == [90.0, 110.0, 105.0]


def test_different_tokens_are_reported_and_fail_the_run():
    runs = [_run("base", "d", 100.0), _run("head", "d", 100.0, outputs="other")]
    (row,) = ab.summary(runs, ["d"])
    assert not row["same_tokens"]


def test_a_revision_that_is_no_commit_is_refused(tmp_path):
    import pytest

    with pytest.raises(SystemExit, match="git rev-parse"):
        ab.checkout("no-such-revision-anywhere", tmp_path)
