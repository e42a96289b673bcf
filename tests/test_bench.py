"""The benchmark (train/apps/bench/, `python scripts/bench.py`) on a tiny target: output structure, greedy-equality
checking, CLI exit codes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, tiny_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from train.apps import bench
from train.apps.bench import harness, methods

SPECIALS = ["<pad>", "<s>", "</s>", "<user>", "<assistant>", "<unk>"]
CHAT = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", unk_token="<unk>",
                                   chat_template=CHAT)


def tiny_target():
    """A tiny target that never stops early (no eos), so every run emits exactly max_new_tokens."""
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture
def questions_file(tmp_path) -> Path:
    rows = [{"question_id": 1, "category": "alpha", "turns": ["w10 w11 w12 w10 w11", "w20 w21"]},
            {"question_id": 2, "category": "beta", "turns": ["w30 w31 w32 w33 w30 w31 w32"]}]
    path = tmp_path / "questions.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def broken_method(target) -> bench.Method:
    """Greedy, except the third new token is replaced: the equality check must catch it."""
    honest = bench.hf_method(target, "broken")

    def run(ids, max_new_tokens):
        out, stats = honest.run(ids, max_new_tokens)
        out = out.clone()
        out[0, ids.shape[1] + 2] = (out[0, ids.shape[1] + 2] + 1) % VOCAB
        return out, stats

    return bench.Method("broken", run)


def test_run_bench_structure_and_greedy_check(questions_file, tmp_path):
    target, tokenizer = tiny_target(), tiny_tokenizer()
    questions = bench.load_questions(questions_file)
    methods = [bench.hf_method(target, bench.BASELINE),
               bench.hf_method(target, bench.PLD, prompt_lookup_num_tokens=4),
               bench.engine_method(target, "ngram", "ngram"),
               broken_method(target)]
    result = bench.run_bench(target, tokenizer, questions, methods, max_new_tokens=12, repeats=2, turns=2,
                             progress=False)

    assert result["methods"] == ["baseline", "pld", "ngram", "broken"]
    # question 1 has two turns, question 2 one: three generations.
    assert [(r["question_id"], r["turn"]) for r in result["questions"]] == [(1, 1), (1, 2), (2, 1)]
    assert result["questions"][1]["prompt_tokens"] > result["questions"][0]["prompt_tokens"]  # history included
    for rec in result["questions"]:
        for name, r in rec["results"].items():
            assert len(r["seconds_all"]) == 2 and r["seconds"] > 0
            assert r["new_tokens"] == 12 and r["target_forwards"] >= 1
            assert r["matches_baseline"] == (name != "broken")
        assert rec["results"]["baseline"]["target_forwards"] == rec["results"]["baseline"]["new_tokens"]
        assert sum(rec["results"]["ngram"]["accepted_lengths"]) + 1 == rec["results"]["ngram"]["new_tokens"]

    assert {m["method"] for m in result["mismatches"]} == {"broken"}
    assert all(m["first_differing_token"] == 2 for m in result["mismatches"])
    table = result["per_category"]
    assert set(table) == {"alpha", "beta", "turn 1", "turn 2", "overall"}  # two turns: a group each
    assert [table[t]["ngram"]["questions"] for t in ("turn 1", "turn 2")] == [2, 1]
    for cat in table:
        assert table[cat]["baseline"]["tau"] == 1.0
        assert table[cat]["baseline"]["speedup_vs_greedy"] == pytest.approx(1.0)
        assert table[cat]["pld"]["speedup_vs_pld"] == pytest.approx(1.0)
        assert table[cat]["broken"]["mismatches"] == table[cat]["broken"]["questions"]
        assert table[cat]["ngram"]["mismatches"] == 0

    paths = bench.write_outputs(result, tmp_path / "out")
    assert json.loads(paths["json"].read_text())["mismatches"] == result["mismatches"]
    md = paths["markdown"].read_text()
    assert md.startswith("| category | method | tau | tokens/s | speedup vs greedy | speedup vs PLD |")
    assert "| **overall** | ngram |" in md and "differ from the baseline" in md
    assert paths["speedup"].stat().st_size > 0 and paths["accepted_lengths"].stat().st_size > 0


def test_cli_strict_exit_code(questions_file, tmp_path, monkeypatch):
    folder = tmp_path / "tiny"
    tiny_target().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    argv = ["--target", str(folder), "--questions", str(questions_file), "--drafter", "ngram",
            "--max-new-tokens", "8", "--out", str(tmp_path / "cli"), "--threads", "1", "--strict", "--no-plots"]
    assert bench.main(argv) == 0
    result = json.loads((tmp_path / "cli" / "results.json").read_text())
    assert result["environment"]["torch_threads"] == 1
    assert result["methods"] == ["baseline", "pld", "ngram"]

    # The same run with an engine that emits a wrong token must fail under --strict.
    monkeypatch.setattr(methods, "engine_method",
                        lambda target, drafter, name, *options, **settings: broken_method(target))
    assert bench.main(argv) == 1


def test_sampled_runs_time_sampling_from_one_seed_and_compare_no_outputs(questions_file, tmp_path):
    folder = tmp_path / "tiny"
    tiny_target().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    argv = ["--target", str(folder), "--questions", str(questions_file), "--drafter", "ngram", "--no-pld",
            "--max-new-tokens", "8", "--out", str(tmp_path / "sampled"), "--threads", "1", "--strict", "--no-plots",
            "--sample", "--temperature", "1.3", "--top-p", "0.8", "--seed", "5"]
    assert bench.main(argv) == 0
    result = json.loads((tmp_path / "sampled" / "results.json").read_text())
    assert result["settings"]["greedy"] is False
    assert result["settings"]["sampling"] == {"do_sample": True, "temperature": 1.3, "top_p": 0.8, "top_k": 0,
                                              "seed": 5}
    assert all(r["matches_baseline"] is None for rec in result["questions"] for r in rec["results"].values())
    assert result["mismatches"] == [] and result["per_category"]["overall"]["ngram"]["mismatches"] == 0
    md = (tmp_path / "sampled" / "results.md").read_text()
    assert "speedup vs transformers sampling" in md and "sampled (temperature 1.3, top-p 0.8, top-k 0, seed 5" in md
    # every method's run starts from the seed: transformers' sampling twice gives the same tokens, another seed others
    target, tokenizer = tiny_target(), tiny_tokenizer()
    sampling = {"do_sample": True, "temperature": 1.3, "top_p": 0.8, "top_k": 0}
    methods = [bench.hf_method(target, bench.BASELINE, sampling), bench.hf_method(target, "again", sampling)]
    ids = bench.render(tokenizer, [{"role": "user", "content": "w10 w11 w12"}])
    counter = bench.ForwardCounter(target)
    _, outputs = bench.time_methods(methods, ids, 24, 1, counter, set(), seed=5)
    assert outputs["baseline"] == outputs["again"]
    _, other = bench.time_methods(methods, ids, 24, 1, counter, set(), seed=6)
    assert other["baseline"] != outputs["baseline"]
    with pytest.raises(SystemExit):  # the greedy-only rows
        bench.main(argv + ["--oracle", "0.5"])


def test_resume_measures_only_what_an_interrupted_run_left(questions_file, tmp_path, monkeypatch):
    folder = tmp_path / "tiny"
    tiny_target().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    out = tmp_path / "resumed"
    argv = ["--target", str(folder), "--questions", str(questions_file), "--drafter", "ngram", "--turns", "2",
            "--max-new-tokens", "8", "--out", str(out), "--threads", "1", "--no-plots"]
    assert bench.main(argv) == 0
    full = json.loads((out / "results.json").read_text())
    records = (out / "records.jsonl").read_text().splitlines()
    assert len(records) == 3  # question 1's two turns, question 2's one

    # interrupted after question 1's first turn: the resumed run times only the other two, and rebuilds
    # turn 2's history (the baseline's untimed reply), so its prompt is the full run's
    (out / "records.jsonl").write_text(records[0] + "\n")
    timed = []
    real = harness.time_methods
    monkeypatch.setattr(harness, "time_methods", lambda methods, ids, *rest, **options: timed.append(ids.shape[1])
                        or real(methods, ids, *rest, **options))
    assert bench.main([*argv, "--resume"]) == 0
    resumed = json.loads((out / "results.json").read_text())
    assert len(timed) == 2
    keys = [(r["question_id"], r["turn"], r["prompt_tokens"]) for r in resumed["questions"]]
    assert sorted(keys) == sorted((r["question_id"], r["turn"], r["prompt_tokens"]) for r in full["questions"])
    assert resumed["questions"][0]["results"] == json.loads(records[0])["results"]  # kept, not re-timed
    assert resumed["environment"]["resumed"]["records_measured_before"] == 1
    assert resumed["per_category"]["overall"]["ngram"]["questions"] == 3
    assert len((out / "records.jsonl").read_text().splitlines()) == 3

    # other methods than the records': refused, and a stateful method cannot resume at all
    with pytest.raises(ValueError, match="same methods"):
        bench.main([*argv[:4], "--no-pld", *argv[4:], "--resume"])
    with pytest.raises(ValueError, match="start the run again"):
        bench.run_bench(tiny_target(), tiny_tokenizer(), bench.load_questions(questions_file),
                        [bench.hf_method(tiny_target(), bench.BASELINE),
                         bench.engine_method(tiny_target(), "suffix", "suffix")],
                        done=[json.loads(records[0])], progress=False)


def test_resume_after_a_kill_cut_the_last_record_measures_that_turn_again(tmp_path):
    """A kill while a record was written leaves a cut last line: --resume keeps the whole records, drops the cut
    one from the file (the next record would be glued onto it) and goes on; before, json raised its own error."""
    out = tmp_path / "out"
    out.mkdir()
    record = json.dumps({"question_id": 1, "turn": 1, "results": {}}) + "\n"
    (out / "records.jsonl").write_text(record + '{"question_id": 2, "turn": 1, "resu')
    (tmp_path / "q.jsonl").write_text(json.dumps({"question_id": 1, "category": "a", "turns": ["x"]}) + "\n")
    with pytest.raises(FileNotFoundError, match="no such folder"):  # the records were read; the target is not there
        bench.main(["--questions", str(tmp_path / "q.jsonl"), "--target", str(tmp_path / "none"), "--out", str(out),
                    "--resume"])
    assert (out / "records.jsonl").read_text() == record


def test_load_questions_validates_and_filters(tmp_path, questions_file):
    assert [q["question_id"] for q in bench.load_questions(questions_file, categories=["beta"])] == [2]
    assert len(bench.load_questions(questions_file, limit=1)) == 1
    assert [q["question_id"] for q in bench.load_questions(questions_file, per_category=1)] == [1, 2]
    with pytest.raises(ValueError, match="not in"):
        bench.load_questions(questions_file, categories=["gamma"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question_id": 1, "prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match="lacks"):
        bench.load_questions(bad)


def test_new_tokens_stop_at_eos():
    out = torch.tensor([[5, 6, 7, 2, 0, 0]])
    assert bench.new_tokens(out, 2, {2}) == [7, 2]


def test_push_to_hub_dry_run_puts_measurements_on_the_card(tmp_path, capsys):
    import heads
    from heads import publish

    run = tmp_path / "run"
    heads.build("medusa", tiny_target()).save_pretrained(run / "drafter")
    row = {"questions": 2, "tau": 1.8, "tokens_per_s": 20.0, "speedup_vs_greedy": 1.5, "speedup_vs_pld": 1.2,
           "mismatches": 0}
    (run / "bench").mkdir()
    (run / "bench" / "results.json").write_text(json.dumps({
        "methods": ["baseline", "pld", "ngram", "medusa"], "per_category": {"overall": {"medusa": row}},
        "settings": {"max_new_tokens": 64}, "environment": {"cpu": "test cpu", "torch_threads": 2}}))
    staged = tmp_path / "staged"
    assert publish.main([str(run), "--repo-id", "me/x", "--dry-run", "--stage-dir", str(staged)]) == 0
    card = (staged / "README.md").read_text()
    assert "measured_speedup_vs_transformers_greedy: 1.5" in card and "test cpu" in card
    assert {"config.json", "model.safetensors", "README.md"} <= {p.name for p in staged.iterdir()}
    assert not (run / "drafter" / "README.md").read_text().count("measured_tau")  # source left untouched
    with pytest.raises(FileNotFoundError, match="no saved drafter"):
        publish.find_drafter(tmp_path / "nothing")


def test_saved_drafter_with_tree_override(questions_file, tmp_path):
    import heads

    target, tokenizer = tiny_target(), tiny_tokenizer()
    heads.build("eagle", target).save_pretrained(tmp_path / "eagle")
    name, drafter = bench.load_drafter(str(tmp_path / "eagle"), target, bench.parse_tree("depth=2,top_k=2,total_tokens=4"))
    assert name == "eagle:eagle"
    assert (drafter.config.tree["depth"], drafter.config.tree["total_tokens"]) == (2, 4)
    lookup = bench.drafter_method(str(tmp_path / "eagle") + "+lookup", target)
    assert lookup.name == "eagle:eagle+lookup"
    for spec in ("early_exit:1+compile+lookup", "early_exit:1+lookup+compile"):  # either order
        assert bench.drafter_method(spec, target).name == "early_exit:1" + spec.partition("1")[2]
    fp32_heads = bench.drafter_method(str(tmp_path / "eagle") + "+lookup+fp32argmax+fp32draft", target)
    assert fp32_heads.name == "eagle:eagle+lookup+fp32argmax+fp32draft"
    ids = torch.tensor([[3, 4, 5, 3, 4, 5]])
    assert lookup.run(ids, 4)[1]["int8_argmax"] is True and fp32_heads.run(ids, 4)[1]["int8_argmax"] is False
    methods = [bench.hf_method(target, bench.BASELINE), bench.engine_method(target, drafter, name), lookup,
               fp32_heads]
    result = bench.run_bench(target, tokenizer, bench.load_questions(questions_file), methods, max_new_tokens=8,
                             progress=False, warmup=False)
    assert result["mismatches"] == []  # an untrained drafter is slow, never wrong
    assert all(a <= 3 for rec in result["questions"] for a in rec["results"][name]["accepted_lengths"])
    with pytest.raises(ValueError, match="unknown tree settings"):
        bench.load_drafter(str(tmp_path / "eagle"), target, {"width": 3})
    with pytest.raises(ValueError, match="key=value"):
        bench.parse_tree("depth")


def test_second_turns_and_repeated_workloads(questions_file):
    target, tokenizer = tiny_target(), tiny_tokenizer()
    questions = bench.load_questions(questions_file)
    methods = [bench.hf_method(target, bench.BASELINE), bench.engine_method(target, "suffix", "suffix")]
    second = bench.run_bench(target, tokenizer, questions, methods, max_new_tokens=10, turns=2, timed_from_turn=2,
                             progress=False)
    # only question 1 has a second turn; its first turn is history, not a record
    assert [(r["question_id"], r["turn"]) for r in second["questions"]] == [(1, 2)]
    both = bench.run_bench(target, tokenizer, questions, methods[:1], max_new_tokens=10, turns=2, progress=False)
    assert second["questions"][0]["prompt_tokens"] == both["questions"][1]["prompt_tokens"]  # same history

    methods = [bench.hf_method(target, bench.BASELINE), bench.engine_method(target, "suffix", "suffix")]
    repeated = bench.run_bench(target, tokenizer, questions, methods, max_new_tokens=12, passes=2, progress=False)
    assert [(r["pass"], r["question_id"]) for r in repeated["questions"]] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert repeated["mismatches"] == []
    table = repeated["per_category"]
    assert {"pass 1", "pass 2", "overall"} <= set(table)
    # the second pass drafts the first pass's answers (the warm-up's answer was forgotten)
    assert table["pass 2"]["suffix"]["tau"] > table["pass 1"]["suffix"]["tau"]
    assert "2 passes over the questions" in bench.to_markdown(repeated)
    # turn 1, turn 2 and the repeated pass in one run: a group per turn and pass
    both = bench.run_bench(target, tokenizer, questions, methods, max_new_tokens=8, turns=2, passes=2, progress=False)
    table = both["per_category"]
    assert {"turn 1, pass 1", "turn 2, pass 1", "turn 1, pass 2", "turn 2, pass 2"} <= set(table)
    assert table["turn 2, pass 1"][bench.BASELINE]["questions"] == 1  # only question 1 has a second turn
    assert table["turn 1, pass 1"][bench.BASELINE]["questions"] == 2
    with pytest.raises(ValueError, match="timed_from_turn"):
        bench.run_bench(target, tokenizer, questions, methods, turns=1, timed_from_turn=2, progress=False)


def test_acceptance_by_position_from_either_engine():
    # selfspec: steps emitting 3, 1 and 2 tokens accepted positions {0, 1}, {} and {0}
    assert bench.acceptance_by_position([{"accepted_lengths": [3, 1]}, {"accepted_lengths": [2]}]) == [2 / 3, 1 / 3]
    # vLLM: per-position counters over its drafts, summed over questions
    vllm = [{"drafts": 4, "accepted_by_position": [3, 1, 0]}, {"drafts": 6, "accepted_by_position": [5, 2, 1]}]
    assert bench.acceptance_by_position(vllm) == [0.8, 0.3, 0.1]
    assert bench.acceptance_by_position([{"new_tokens": 5}]) == []  # plain decoding drafts nothing


def test_vllm_rows_a_method_with_its_own_forwards_and_counters(questions_file):
    """A stand-in for a vLLM row (greedy ids, its own forward count and per-position counters, as
    vllm_method returns them): tau and acceptance come from those, not from the local target's hook."""
    target, tokenizer = tiny_target(), tiny_tokenizer()
    honest = bench.hf_method(target, "honest")

    def run(ids, max_new_tokens):
        out, _ = honest.run(ids, max_new_tokens)
        return out, {"target_forwards": 4, "drafts": 3, "accepted_by_position": [3, 2]}

    methods = [bench.hf_method(target, bench.BASELINE), bench.Method("vllm-ngram", run, engine="vllm")]
    result = bench.run_bench(target, tokenizer, bench.load_questions(questions_file), methods, max_new_tokens=8,
                             progress=False, warmup=False)
    row = result["per_category"]["overall"]["vllm-ngram"]
    assert row["tau"] == 16 / 8  # 2 questions x 8 tokens over 2 x 4 forwards
    assert row["acceptance_by_position"] == [1.0, 4 / 6]
    assert result["engines"]["vllm-ngram"] == "vllm" and not result["mismatches"]
    assert "| vllm-ngram | 1.00 | 0.67 |" in bench.to_markdown(result)


def test_vllm_row_names_and_bad_drafters(tmp_path):
    assert bench.vllm_speculation("plain") == ("vllm", None)
    name, config = bench.vllm_speculation("ngram")
    assert name == "vllm-ngram" and config["method"] == "ngram"
    with pytest.raises(ValueError, match="--vllm nowhere: nowhere is not a folder"):
        bench.vllm_speculation("nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="is not a selfspec drafter"):
        bench.vllm_speculation(str(tmp_path / "empty"))


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_rows_on_the_embedded_target(tmp_path):
    """vLLM's CPU build, plain and with its n-gram drafting, beside transformers' greedy on two MT-bench-like
    prompts: vLLM's greedy output equals transformers' here (fp32 both), and its n-gram counters count."""
    from train.vllm_engine import default_vllm_python

    if not default_vllm_python().exists():
        pytest.skip(f"no vLLM environment at {default_vllm_python()}: run `make vllm` (CI's .ci/run does)")
    rows = [{"question_id": 1, "category": "extraction", "turns": [
        "Repeat this list exactly, one item per line: apples, pears, plums, apples, pears, plums, apples, pears."]},
        {"question_id": 2, "category": "writing", "turns": ["Write two sentences about the sea."]}]
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    code = bench.main(["--questions", str(questions), "--no-pld", "--threads", "2", "--max-new-tokens", "48",
                       "--vllm", "plain", "--vllm", "ngram", "--out", str(out), "--no-plots", "--strict"])
    result = json.loads((out / "results.json").read_text())
    assert code == 0
    assert result["methods"] == ["baseline", "vllm", "vllm-ngram"]
    overall = result["per_category"]["overall"]
    assert overall["vllm"]["tau"] == 1.0
    assert overall["vllm-ngram"]["acceptance_by_position"], "vLLM's n-gram counters recorded nothing"
    print(f"\nvLLM rows: mismatches {result['mismatches']}, n-gram tau {overall['vllm-ngram']['tau']:.2f}")
    # sampled: vLLM draws with the settings and the torch seed the run set, so the same seed draws the same tokens
    sampling = {"do_sample": True, "temperature": 1.0, "top_p": 0.95, "top_k": 0}
    method = bench.vllm_method("plain", "smollm2-135m-instruct", "float32", 2, tmp_path, sampling)
    ids = torch.tensor([[1, 9690, 198, 2683, 457, 253, 1234, 30, 2, 198, 1, 520, 9531, 198]])
    draws = []
    try:
        for seed in (3, 3, 4):
            torch.manual_seed(seed)
            draws.append(method.run(ids, 24)[0])
    finally:
        method.close()
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])


def test_plots_without_matplotlib_are_skipped_with_a_line_and_the_results_kept(questions_file, tmp_path, monkeypatch,
                                                                               capsys):
    folder = tmp_path / "tiny"
    tiny_target().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an install without it: importing it fails
    out = tmp_path / "run"
    assert bench.main(["--target", str(folder), "--questions", str(questions_file), "--no-pld", "--limit", "1",
                       "--max-new-tokens", "4", "--out", str(out), "--threads", "1"]) == 0
    assert json.loads((out / "results.json").read_text())["methods"] == ["baseline"]
    assert (out / "results.md").exists() and not (out / "speedup.png").exists()
    printed = capsys.readouterr()
    assert "plots skipped: matplotlib is not installed (pip install matplotlib to draw them, or pass --no-plots)" \
        in printed.err
    assert "| **overall** | baseline |" in printed.out and "wrote " in printed.out  # the run's report still printed
