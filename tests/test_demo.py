"""The demo's choices (train/apps/demo.py, `make demo`) that do not need the real target: which prompts it trains, calibrates and
benchmarks on, the drafting tree it saves (calibrated where it can be, hand-picked where not), the `none` row
its benchmark sets beside every drafter, and the plain warnings for a drafter that learned too little or does
not pay."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import VOCAB, tiny_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import heads
from infer import SelfSpecModel
from train.apps import demo


def chat_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<user>": 3, "<assistant>": 4,
             **{f"w{i}": i for i in range(5, VOCAB)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", chat_template=(
        "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"))


def test_calibration_prompts_are_neither_trained_nor_benchmarked():
    train, bench_rows = demo.split_prompts(160, 48)
    unused = demo.calibration_prompts(160)
    ids = lambda rows: {q["question_id"] for q in rows}  # noqa: E731
    assert len(unused) == demo.CALIBRATION
    assert not ids(unused) & ids(train) and not ids(unused) & ids(bench_rows)
    last = 480 - demo.HELD_OUT  # the most prompts training may take
    assert len(demo.calibration_prompts(last - 2)) == 2 and demo.calibration_prompts(last) == []


def test_demo_tree_is_calibrated_where_it_can_be(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    target, tokenizer = tiny_model("llama"), chat_tokenizer()
    prompts = [{"turns": [" ".join(f"w{(7 * i + j) % 90 + 5}" for j in range(6))]} for i in range(demo.CALIBRATION)]
    for kind in ("eagle3", "dflash"):
        heads.build(kind, target).save_pretrained(tmp_path / kind)

    demo.choose_tree(target, tokenizer, tmp_path / "eagle3", "calibrated", prompts[:8])
    saved = heads.load(tmp_path / "eagle3")
    printed = capsys.readouterr().out
    assert saved.config.calibration["prompts"] == 8 and "calibrated on 8 unused prompts" in printed
    assert saved.config.tree["total_tokens"] <= 64
    pays = saved.config.calibration["lookup_first"]["pays"]
    assert saved.config.lookup_first is pays and f"which is {'now' if pays else 'not'} the drafter's default" in printed
    ids = torch.tensor([[5, 6, 7, 8]])
    expected = target.generate(ids, do_sample=False, max_new_tokens=10, eos_token_id=None, pad_token_id=0)
    assert torch.equal(SelfSpecModel(target, saved).generate(ids, max_new_tokens=10, eos_token_id=[]), expected)

    # a block drafter's chain, or too few unused prompts: the hand-picked tree, said so
    demo.choose_tree(target, tokenizer, tmp_path / "dflash", "calibrated", prompts)
    assert "not calibrated" in capsys.readouterr().out
    assert heads.load(tmp_path / "dflash").config.tree["top_k"] == 4
    heads.build("eagle3", target).save_pretrained(tmp_path / "few")
    demo.choose_tree(target, tokenizer, tmp_path / "few", "calibrated", prompts[:7])
    assert "lower --num-prompts" in capsys.readouterr().out
    few = heads.load(tmp_path / "few").config
    assert few.calibration is None and (few.tree["depth"], few.tree["total_tokens"]) == (2, 6)
    # a tree given by hand is saved as given
    demo.choose_tree(target, tokenizer, tmp_path / "few", "depth=3,top_k=2,total_tokens=5", prompts)
    assert (heads.load(tmp_path / "few").config.tree["depth"], json.dumps(heads.load(tmp_path / "few").config.tree)
            .count('"total_tokens": 5')) == (3, 1)


def test_training_data_is_the_distilled_answers_then_the_first_shipped_ones(tmp_path):
    distilled = tmp_path / "distill.jsonl"
    distilled.write_text('{"id": "d0", "messages": []}\n{"id": "d1", "messages": []}\n')
    data = demo.add_shipped_answers(distilled, 3, tmp_path / "train.jsonl")
    ids = [json.loads(line)["id"] for line in data.read_text().splitlines()]
    shipped = [json.loads(line)["id"] for line in demo.SHIPPED_ANSWERS.read_text().splitlines()[:3]]
    assert ids == ["d0", "d1", *shipped] and len(set(shipped)) == 3


def test_the_benchmark_shows_none_beside_every_drafter_and_each_drafter_against_it(tmp_path, capsys):
    target, tokenizer = tiny_model("llama"), chat_tokenizer()
    heads.build("eagle3", target).save_pretrained(tmp_path / "drafter")
    questions = [{"question_id": i, "category": "writing", "turns": [f"w{i + 5} w{i + 9} w{i + 12}"]} for i in range(2)]
    result = demo.benchmark(target, tokenizer, tmp_path / "drafter", questions, tmp_path / "bench", max_new_tokens=6)
    assert result["methods"][:4] == ["baseline", "pld", "none", "eagle3"]
    printed, saved = capsys.readouterr().out, (tmp_path / "bench" / "results.md").read_text()
    overall = result["per_category"]["overall"]
    rows = [f"\n| {name} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | {r['speedup_vs_greedy']:.2f}x | "
            f"{r['speedup_vs_none']:.2f}x |\n" for name, r in overall.items()]
    for text in (printed, saved):  # bench's table per category, then the demo's against `none`
        assert "| **overall** | none | 1.00 |" in text and "| vs `none` |" in text
        assert all(row in text for row in rows) and "| none | 1.00 |" in rows[2] and rows[2].endswith("| 1.00x |\n")
    assert overall["eagle3"]["speedup_vs_none"] == pytest.approx(
        overall["eagle3"]["tokens_per_s"] / overall["none"]["tokens_per_s"])


def bench_result(rows: dict[str, tuple[float, float]]) -> dict:
    """A benchmark result with overall (tau, tokens/s) per method, transformers' greedy at 20 tokens/s."""
    overall = {name: {"tau": tau, "tokens_per_s": speed, "speedup_vs_greedy": speed / 20} for name, (tau, speed)
               in {"baseline": (1.0, 20.0), "pld": (1.2, 19.0), **rows}.items()}
    result = {"methods": list(overall), "per_category": {"overall": overall}}
    demo.add_versus_none(result)
    return result


def test_a_drafter_that_does_not_pay_over_none_is_named_plainly(capsys):
    # the slow machine's 11-step drafter: 3.65x transformers' greedy at tau 1.07, all of it the forward's
    result = bench_result({"none": (1.0, 75.0), "eagle3": (1.07, 73.0), "eagle3+lookup": (1.3, 80.0),
                           "shipped:x": (1.05, 76.0), "shipped:x+lookup": (1.6, 90.0)})
    verdicts = demo.drafting_verdicts(result)
    assert [v.split()[0] for v in verdicts] == ["eagle3", "shipped:x"]
    assert "slower than no drafts (0.97x `none`)" in verdicts[0] and "3.65x over transformers" in verdicts[0]
    assert "rarely accepted (tau 1.05)" in verdicts[1] and "not drafting" in verdicts[1]
    assert "| eagle3+lookup | 1.30 | 80.0 | 4.00x | 1.07x |" in demo.versus_none(result)
    assert demo.drafting_verdicts(bench_result({"none": (1.0, 75.0), "eagle3": (1.4, 90.0)})) == []
    demo.report_verdict([None, *verdicts], benchmarked=True)  # repeated at the end of the demo's output
    closing = capsys.readouterr().out.split("=== verdict ===")[1]
    assert closing.count("WARNING: ") == 2 and "WARNING: eagle3 does not pay here" in closing


def test_an_undertrained_drafter_and_a_short_budget_are_named_plainly(tmp_path):
    drafter = heads.build("eagle3", tiny_model("llama"))
    drafter.config.training = {"steps": 11}
    drafter.config.metrics = {"step0/top1": 0.09, "step0/top3": 0.2}
    drafter.save_pretrained(tmp_path / "weak")
    assert "undertrained: after 11 steps its first guess is right 0.09" in demo.training_verdict(tmp_path / "weak")
    drafter.config.metrics = {"step0/top1": 0.31, "step0/top3": 0.45}
    drafter.save_pretrained(tmp_path / "trained")
    assert demo.training_verdict(tmp_path / "trained") is None
    drafter.config.metrics = None  # never evaluated: nothing says it learned
    drafter.save_pretrained(tmp_path / "unknown")
    assert "no held-out step0/top1" in demo.training_verdict(tmp_path / "unknown")

    plan = {"minutes": 6, "fits_steps": 20, "planned_steps": demo.MIN_TRAIN_STEPS, "over_budget_seconds": 130.0}
    assert "fitted only 20 steps" in demo.budget_verdict(plan) and "2.2 min past" in demo.budget_verdict(plan)
    assert demo.budget_verdict({**plan, "fits_steps": 300, "planned_steps": 300}) is None


def test_a_calibration_that_measured_drafting_slower_than_no_drafts_says_so():
    slow = {"alone": 40.0, "lookup_first": 42.0, "no_drafts": 45.0}
    assert "no faster than no drafts (42.0 against 45.0" in demo.calibration_verdict(slow, 16)
    assert demo.calibration_verdict({**slow, "lookup_first": 46.0}, 16) is None
