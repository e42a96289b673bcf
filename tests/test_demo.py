"""scripts/demo.py's choices that do not need the real target: which prompts it trains, calibrates and
benchmarks on, and the drafting tree it saves (calibrated where it can be, hand-picked where not)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch
from conftest import VOCAB, tiny_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import heads
from infer.engine import SelfSpecModel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))  # demo.py imports bench.py from its folder, as when run
_spec = importlib.util.spec_from_file_location("demo", ROOT / "scripts" / "demo.py")
demo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(demo)


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
    distilled.write_text('{"id": "d0"}\n{"id": "d1"}\n')
    data = demo.add_shipped_answers(distilled, 3, tmp_path / "train.jsonl")
    ids = [json.loads(line)["id"] for line in data.read_text().splitlines()]
    shipped = [json.loads(line)["id"] for line in demo.SHIPPED_ANSWERS.read_text().splitlines()[:3]]
    assert ids == ["d0", "d1", *shipped] and len(set(shipped)) == 3
