"""The GPU benchmark's parts that need no GPU: random-weight targets of named shapes (sizes known before anything
is allocated, refused where they do not fit), its bad inputs, and a CPU dry run of the whole suite on the tiny
shape (every row, outputs exact in fp32, the oracle's acceptance as alpha sets it)."""

from __future__ import annotations

import json

import pytest
import torch

from infer import random_target
from infer.drafters.oracle import expected_tokens_per_step
from infer.random_target import SHAPES, build_random_target, parameter_bytes, shape_config
from train.apps import bench
from train.apps.bench import gpu


def test_shapes_are_sized_before_allocation_and_built_as_the_real_models():
    # the published parameter counts, from configs on the meta device (nothing allocated)
    for name, billions in (("llama3-1b", 1.236), ("llama3-8b", 8.030), ("qwen3-8b", 8.191), ("llama3-70b", 70.554)):
        assert parameter_bytes(shape_config(name), torch.bfloat16) / 2e9 == pytest.approx(billions, abs=0.001), name
    model = build_random_target("tiny", dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and model.generation_config.eos_token_id is None
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as 'tiny' and Llama-3.2-1B are
    assert sum(p.numel() * 2 for p in model.parameters()) == parameter_bytes(model.config, torch.bfloat16)
    assert not shape_config("llama3-8b").tie_word_embeddings
    # same seed, same weights: a run's rows and a rerun see one target
    again = build_random_target("tiny", dtype=torch.bfloat16)
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight, again.model.layers[0].mlp.up_proj.weight)


def test_bad_shapes_devices_and_sizes_are_refused_before_loading(monkeypatch, capsys):
    with pytest.raises(ValueError, match="unknown random target shape 'llama9'; the shapes are: tiny, llama3-1b"):
        build_random_target("llama9")
    with pytest.raises(SystemExit):
        bench.main(["--random-target", "llama9"])
    assert "the shapes are: " + ", ".join(SHAPES) in capsys.readouterr().err
    monkeypatch.setattr(random_target, "free_memory_bytes", lambda device: 2_000_000_000)
    with pytest.raises(ValueError, match=r"'llama3-1b' has 2\.5 GB of weights in bfloat16, more than 90% of the 2\.0 GB"):
        build_random_target("llama3-1b", dtype=torch.bfloat16)
    with pytest.raises(SystemExit):  # the rows that need a real target
        bench.main(["--random-target", "tiny", "--drafter", "ngram"])
    assert "--drafter needs a real target" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--out", "x"])
    assert "--questions is required (or --random-target SHAPE" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a GPU")
def test_cuda_without_a_gpu_says_so(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--random-target", "tiny", "--device", "cuda"])
    assert "this machine has 0 CUDA device(s)" in capsys.readouterr().err
    with pytest.raises(ValueError, match="this machine has 0 CUDA device"):
        build_random_target("tiny", "cuda")


def test_dry_run_of_the_whole_suite_on_the_tiny_shape(tmp_path):
    out = tmp_path / "gpu"
    assert bench.main(["--random-target", "tiny", "--no-compile", "--oracle", "0.9", "--max-new-tokens", "200",
                       "--prompt-tokens", "16", "--repeats", "1", "--threads", "1", "--out", str(out)]) == 0
    result = json.loads((out / "results.json").read_text())
    rows = result["rows"]
    assert list(rows) == ["hf_eager", "hf_static", "none", "none_captured", "none_static", "oracle:0.9",
                          "oracle_tree:0.9", "oracle:0.9+captured", "oracle:0.9+static", "eagle3_tree60",
                          "eagle3_tree60+captured"]  # captured rows before compiled ones
    for name, r in rows.items():
        assert "error" not in r and "skipped" not in r, (name, r)
        assert r["new_tokens"] == 200 and r["tokens_per_s"] > 0 and r["ms_per_step"] > 0, name
        assert r["first_difference_vs_hf"] is None, name  # fp32 on a CPU: every row exact
        assert r["floor_share"] > 0 and "speedup_vs_hf_static" in r
    assert rows["hf_eager"]["tau"] == 1.0 and rows["none"]["tau"] == 1.0
    # every engine run against the floor read just before it (transformers' say nothing of their prefill)
    for name, r in rows.items():
        assert len(r["gb_s_all"]) == len(r["seconds_all"]), name
        if "decode_ms_per_step" in r:
            assert len(r["decode_of_floor_all"]) == len(r["seconds_all"]) and min(r["decode_of_floor_all"]) > 0, name
    assert "decode_of_floor_all" not in rows["hf_eager"]
    assert "decoding step against the floor read just before it, run by run: " in (out / "results.md").read_text()
    # the oracle's acceptance is alpha's: 0.9 in chains of 8 gives 6.13 tokens a step on average
    assert rows["oracle:0.9"]["expected_tau"] == pytest.approx(expected_tokens_per_step(0.9, 8))
    for name in ("oracle:0.9", "oracle:0.9+static", "oracle:0.9+captured"):
        assert rows[name]["accepted_per_step"] == pytest.approx(rows[name]["expected_tau"], abs=1.2), name
        assert rows[name]["followed"] == 0 and rows[name]["fraction_of_ideal"] > 0
        assert rows[name]["decode_fraction_of_ideal"] > 0 and rows[name]["prefill_ms"] > 0
    for name, r in rows.items():  # decoding alone: the prompt's forward and its one token left out
        if "decode_tau" in r:
            assert r["decode_tau"] == pytest.approx((r["new_tokens"] - 1) / (r["target_forwards"] - 1)), name
            assert r["decode_ms_per_step"] * (r["target_forwards"] - 1) < 1000 * max(r["seconds_all"]), name
    assert "decode_tau" not in rows["hf_eager"]  # transformers' generate says nothing of its prefill
    tree = rows["oracle_tree:0.9"]
    assert tree["expected_tau"] == pytest.approx(expected_tokens_per_step(0.9, 6, 8, 60))
    assert tree["accepted_per_step"] == pytest.approx(tree["expected_tau"], abs=1.2)
    widths = result["verify_ms_by_width"]
    assert set(widths) == {"path", "1", "2", "4", "8", "16", "32"} and widths["path"] == rows["none"]["verify_forward"]
    assert rows["none_captured"]["verify_forward"] == "static buffers"  # what ran, per row
    assert rows["hf_eager"]["verify_forward"] == "transformers generate"
    # the floor from the fastest of the readings taken before the rows and before each round
    readings = result["bandwidth_readings_gb_s"]
    assert len(readings) == 1 + result["settings"]["repeats"] and result["bandwidth_gb_s"] == max(readings)
    assert result["memory_floor_ms"] == pytest.approx(1000 * result["step_weight_gb"] / max(readings))
    assert result["bandwidth_source"].startswith(f"measured read bandwidth (CPU), the best of {len(readings)}")
    # each reading the faster of a buffer's and the step's own weights'
    assert len(result["weights_read_gb_s"]) == len(readings)
    assert all(r >= w > 0 for r, w in zip(readings, result["weights_read_gb_s"], strict=True))
    assert result["settings"]["tree"] == gpu.EAGLE2_TREE and result["settings"]["compile"] is False
    md = (out / "results.md").read_text()
    assert "| oracle_tree:0.9 |" in md and "verify forward by width" in md


def test_rows_past_the_budget_are_skipped_and_said_so(tmp_path):
    out = tmp_path / "late"
    assert bench.main(["--random-target", "tiny", "--no-compile", "--budget-seconds", "1e-9", "--out", str(out),
                       "--bandwidth-gbs", "4800", "--threads", "1"]) == 0
    result = json.loads((out / "results.json").read_text())
    assert all("past the 1e-09 s budget" in r["skipped"] for r in result["rows"].values())
    assert "skipped" in result["verify_ms_by_width"]
    assert result["bandwidth_gb_s"] == 4800 and result["bandwidth_source"] == "--bandwidth-gbs"
    # the floor is the weights' bytes at that bandwidth
    assert result["memory_floor_ms"] == pytest.approx(1000 * result["step_weight_gb"] / 4800)


def test_an_oracle_row_settles_on_what_the_target_emits_with_it():
    """Where the answer it was given is not what the target emits (bf16 near-ties on a GPU), the row's untimed
    runs move its answer to the target's, so its timed runs draft the right tokens and follow nothing; each row
    keeps its own answer."""
    from infer.drafters.oracle import OracleDrafter

    target = build_random_target("tiny")
    ids = torch.randint(5, 500, (1, 12), generator=torch.Generator().manual_seed(3))
    settings = gpu.Settings(new_tokens=48, repeats=1)
    truth = target.generate(ids, max_new_tokens=48, do_sample=False)[0, 12:].tolist()
    answers = {"none": truth[:10] + [(truth[10] + 1) % 512] + truth[11:]}
    rows = [gpu.engine_row(target, ids, f"oracle{i}", "", settings, lambda: OracleDrafter(0.9, 8, follow=True),
                           answers) for i in range(2)]
    runs = [row.setup()[0] for row in rows]
    for key in answers:  # whatever the shared answers hold later reaches no row set up before
        answers[key] = [0] * 48
    for run in runs:
        new, stats = run()
        assert new == truth and stats["followed"] == 0
    with pytest.raises(RuntimeError, match="neither row ran"):
        gpu.engine_row(target, ids, "oracle", "", settings, lambda: OracleDrafter(0.9, 8), {}).setup()


def test_a_row_that_errors_makes_the_exit_code_nonzero(tmp_path, monkeypatch, capsys):
    """A row's error is recorded and the other rows still run, but the command does not exit 0."""
    def broken():
        raise RuntimeError("out of memory")

    monkeypatch.setattr(gpu, "suite", lambda target, ids, settings, answers: [
        gpu.hf_row(target, ids, "hf_eager", "transformers", settings), gpu.Row("broken", "a row that fails", broken)])
    monkeypatch.setattr(gpu, "verify_by_width", lambda target, context, repeats: {})
    out = tmp_path / "gpu"
    assert bench.main(["--random-target", "tiny", "--no-compile", "--max-new-tokens", "4", "--prompt-tokens", "8",
                       "--repeats", "1", "--threads", "1", "--out", str(out)]) == 1
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert rows["broken"]["error"] == "RuntimeError: out of memory" and rows["hf_eager"]["tokens_per_s"] > 0
    assert "1 row(s) failed: broken (their errors are in results.json); exit code 1" in capsys.readouterr().err


def test_a_row_whose_capture_or_compile_fell_back_is_an_error():
    cpu = torch.device("cpu")
    gpu.check_path({"static_cache": True, "captured_step": True}, {"verify_forward": "static buffers"}, cpu)
    with pytest.raises(RuntimeError, match="asked for the cuda graphs verify forward, ran 'transformers'"):
        gpu.check_path({"captured_step": True}, {"verify_forward": "transformers",
                                                 "verify_fallback": "capturing failed: X"}, torch.device("cuda"))
    with pytest.raises(RuntimeError, match="asked for the compiled verify forward, ran 'lean'"):
        gpu.check_path({"static_cache": True, "compile": True}, {"verify_forward": "lean"}, cpu)
    gpu.check_path({}, {"verify_forward": "lean"}, cpu)  # nothing asked, anything goes


def test_a_steps_bytes_leave_out_an_untied_input_embedding():
    tied = build_random_target("tiny")
    every = sum(p.numel() * p.element_size() for p in tied.parameters())
    assert gpu.step_bytes(tied) == every  # the head reads the embedding
    from transformers import LlamaConfig, LlamaForCausalLM

    untied = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    every = sum(p.numel() * p.element_size() for p in untied.parameters())
    assert gpu.step_bytes(untied) == every - 512 * 64 * 4
    assert all(p is not untied.get_input_embeddings().weight for p in gpu.step_weights(untied))
    # the step's own weights read as they lie: bf16 as fp32 pairs, an odd count or another dtype as it is
    assert gpu.weights_read_gb_s([torch.ones(64, 64, dtype=torch.bfloat16), torch.ones(7, dtype=torch.bfloat16),
                                  torch.ones(5)], passes=1) > 0
