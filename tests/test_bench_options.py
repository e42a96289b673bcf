"""The options A/B (scripts/bench_options.py): its variants parsed or refused before a target is built, and a run on
the tiny random shape timing every variant each round."""

from __future__ import annotations

import json

import pytest

from train.apps.bench.options_ab import main, parse_variant


def test_variants_are_keyword_literals():
    assert parse_variant("") == {}
    assert parse_variant("lean_verify=False, int8_argmax=False") == {"lean_verify": False, "int8_argmax": False}
    assert parse_variant("static_cache=256") == {"static_cache": 256}
    with pytest.raises(ValueError, match="name=value"):
        parse_variant("lean_verify")
    with pytest.raises(ValueError, match="not a Python literal"):
        parse_variant("lean_verify=maybe")


def test_it_times_every_variant_each_round(tmp_path):
    out = tmp_path / "ab.json"
    assert main(["--random-target", "tiny", "--dtype", "float32", "--variant", "lean_verify=False", "--variant", "",
                 "--rounds", "2", "--max-new-tokens", "6", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["runs"]) == {"lean_verify=False", ""}
    assert [run["round"] for run in result["runs"][""]] == [0, 1]
    assert result["runs"]["lean_verify=False"][0]["verify_forward"] == "transformers"
    assert result["runs"][""][0]["verify_forward"] == "lean"
    assert all(run["step_ms"] > 0 and run["floor_ms"] > 0 for runs in result["runs"].values() for run in runs)
    assert result["summary"][""]["same_tokens_as_first_variant"]  # fp32: the lean forward is exact


def test_one_variant_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--random-target", "tiny", "--variant", ""])
    assert "two different --variant" in capsys.readouterr().err
