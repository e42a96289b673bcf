"""Bad inputs to inference: one table of (what a user does, the error it must get, words the message holds).

Each row builds what it needs from the tiny llama fixture and must fail with that error type and a
message that names the problem (and, where there is one, the fix). The training side has its own table in
test_bad_inputs_train.py.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from transformers import GenerationConfig

from heads import calibrate_cli, publish
from infer import DraftModelDrafter, LookupFirstDrafter, NgramDrafter, SelfSpecModel
from infer.drafters.adaptive import AdaptiveLength
from train.apps import bench, serve

IDS = torch.tensor([[5, 9, 14, 5, 9, 20]])
# the modules behind the scripts a row's command line runs
COMMANDS = {"bench": bench, "serve": serve, "calibrate": calibrate_cli}


def questions(tmp: Path, text: str) -> Path:
    path = tmp / "q.jsonl"
    path.write_text(text)
    return path


def damaged_drafter(tmp: Path, target) -> Path:
    from safetensors.torch import load_file, save_file

    import heads

    folder = tmp / "drafter"
    heads.build("medusa", target).save_pretrained(folder)
    weights = load_file(folder / "model.safetensors")
    first = next(iter(weights))
    weights[first] = torch.full_like(weights[first], float("nan"))
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def cli(name: str, *argv) -> None:
    """A script's command line; what it refuses (argparse's exit 2, or a nonzero return) is raised as a
    ValueError holding what it printed."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = COMMANDS[name].main([str(a) for a in argv])
        except SystemExit as stop:
            code = stop.code
    if code:
        raise ValueError(err.getvalue())


def bench_cli(tmp: Path, *argv) -> None:
    """scripts/bench.py on a question file of one question and a target that is not there (never loaded), writing
    into tmp/out unless the row gives its own --out."""
    cli("bench", "--questions", questions(tmp, '{"question_id": 1, "category": "a", "turns": ["x"]}\n'),
        "--target", tmp / "no-target", "--out", tmp / "out", *argv)


def earlier_bench(tmp: Path, records: str, settings: dict | None = None, finished: bool = False) -> Path:
    """tmp/out as a benchmark left it: its records.jsonl and (unless None) the settings they were measured with."""
    import json

    out = tmp / "out"
    out.mkdir()
    (out / "records.jsonl").write_text(records)
    if settings is not None:
        (out / "records.settings.json").write_text(json.dumps({"settings": settings, "finished": finished}))
    return out


RECORD = '{"question_id": 1, "turn": 1, "results": {}}\n'


def saved_drafter(tmp: Path, target) -> Path:
    import heads

    heads.build("medusa", target).save_pretrained(tmp / "drafter")
    return tmp / "drafter"


def drafter_of_a_saved_target(tmp: Path) -> str:
    """A drafter folder recording a target folder and the char tokenizer's fingerprint."""
    from train_fixtures import char_tokenizer, save_tiny_target
    from transformers import AutoModelForCausalLM

    import heads

    folder = save_tiny_target(tmp / "target")
    heads.build("medusa", AutoModelForCausalLM.from_pretrained(folder), tokenizer=char_tokenizer()).save_pretrained(
        tmp / "drafter")
    return str(tmp / "drafter")


def other_tokenizer():
    from train_fixtures import character_tokenizer

    return character_tokenizer(["<pad>", "<s>", "</s>", "<unk>"], "abc", None)


def user_folder(tmp: Path) -> Path:
    (tmp / "mine").mkdir()
    (tmp / "mine" / "config.json").write_text("{}")
    return tmp / "mine"


def bench_result(tmp: Path, text: str) -> Path:
    path = tmp / "results.json"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


def nan_target():
    """The tiny llama with one NaN in a weight (a damaged checkpoint loaded without complaint)."""
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    return model


def gen(target, ids=IDS, **kwargs):
    return SelfSpecModel(target, "ngram").generate(ids, **kwargs)


ROWS = [
    # ---- building a SelfSpecModel
    ("target is not a model", lambda t: SelfSpecModel("llama", "ngram"), TypeError, "target must be a transformers causal LM"),
    ("unknown drafter name", lambda t: SelfSpecModel(t, "hydra"), ValueError, "unknown drafter 'hydra'; the named drafters are: ngram[:<longest n-gram>], gguf"),
    ("drafter of a wrong type", lambda t: SelfSpecModel(t, 3), TypeError, "cannot draft with a int"),
    ("a drafter class, not a drafter", lambda t: SelfSpecModel(t, __import__("heads").Eagle3Model), TypeError, "drafter is the class Eagle3Model, not a drafter: pass an instance"),
    ("a misspelt drafter name", lambda t: SelfSpecModel(t, "ngrm"), ValueError, "unknown drafter 'ngrm' (did you mean 'ngram'?); the named drafters are"),
    ("int8 drafter over a target holding a NaN", lambda t: SelfSpecModel(nan_target(), "int8").generate(IDS, max_new_tokens=4), ValueError, "the target's weight model.layers.0.mlp.down_proj.weight holds NaN or infinite values, so the 'int8' drafter"),
    ("early_exit without a layer count", lambda t: SelfSpecModel(t, "early_exit"), ValueError, "write early_exit:<layers>"),
    ("early_exit with a word", lambda t: SelfSpecModel(t, "early_exit:half"), ValueError, "write early_exit:<layers>"),
    ("early_exit at the layer count", lambda t: SelfSpecModel(t, "early_exit:4"), ValueError, "must keep between 1 and 3 of the target's 4 layers"),
    ("early_exit of zero layers", lambda t: SelfSpecModel(t, "early_exit:0"), ValueError, "must keep between 1 and 3"),
    ("bf16 with an argument", lambda t: SelfSpecModel(t, "bf16:fast"), ValueError, "'bf16' takes no argument"),
    ("int8 with an argument", lambda t: SelfSpecModel(t, "int8:4"), ValueError, "'int8' takes no argument"),
    ("none with an argument", lambda t: SelfSpecModel(t, "none:3"), ValueError, "'none' takes no argument"),
    ("ngram with a word", lambda t: SelfSpecModel(t, "ngram:long"), ValueError, "write ngram or ngram:<longest n-gram>"),
    ("ngram of zero tokens", lambda t: SelfSpecModel(t, "ngram:0"), ValueError, "a whole number >= 1"),
    ("a drafter name ending in ':'", lambda t: SelfSpecModel(t, "bf16:"), ValueError, "has nothing after ':'; write bf16"),
    ("gguf file missing, with ~", lambda t: SelfSpecModel(t, "gguf:~/no-such-selfspec.gguf"), FileNotFoundError, "no GGUF file at /"),
    ("int4 with an argument", lambda t: SelfSpecModel(t, "int4:g64"), ValueError, "'int4' takes no argument"),
    ("layerskip with a word", lambda t: SelfSpecModel(t, "layerskip:half"), ValueError, "write layerskip (chosen per request) or layerskip:<fraction"),
    ("layerskip skipping everything", lambda t: SelfSpecModel(t, "layerskip:1"), ValueError, "a fraction in (0, 1)"),
    ("layerskip skipping no layer", lambda t: SelfSpecModel(t, "layerskip:0.05"), ValueError, "must skip at least one"),
    ("lookahead with two settings", lambda t: SelfSpecModel(t, "lookahead:5,4"), ValueError, "write lookahead or lookahead:<window>,<ngram>,<guesses>"),
    ("lookahead window of zero", lambda t: SelfSpecModel(t, "lookahead:0,4,5"), ValueError, "lookahead setting window must be in 1..128, got 0"),
    ("lookahead unigram", lambda t: SelfSpecModel(t, "lookahead:5,1,5"), ValueError, "lookahead setting ngram must be in 2..16, got 1"),
    ("lookahead guess set too large", lambda t: SelfSpecModel(t, "lookahead:5,4,500"), ValueError, "lookahead setting guesses must be in 1..128, got 500"),
    ("gguf file missing", lambda t: SelfSpecModel(t, "gguf:/nonexistent/model.gguf"), (FileNotFoundError, ImportError), "/nonexistent/model.gguf"),
    ("draft model with another vocabulary", lambda t: SelfSpecModel(t, tiny_model("llama", vocab_size=50)), ValueError, "must share the target's tokenizer"),
    ("n-gram sizes reversed", lambda t: NgramDrafter(max_ngram=1, min_ngram=2), ValueError, "min_ngram <= max_ngram"),
    ("n-gram drafting nothing", lambda t: NgramDrafter(num_tokens=0), ValueError, "num_tokens must be >= 1"),
    ("draft model drafting nothing", lambda t: DraftModelDrafter(tiny_model("llama"), num_tokens=0), ValueError, "num_tokens must be >= 1"),
    ("adaptive length of zero", lambda t: AdaptiveLength(max_tokens=0), ValueError, "1 <= min_tokens <= max_tokens"),
    ("typical_acceptance as text", lambda t: SelfSpecModel(t, "ngram", typical_acceptance="false"), ValueError, "typical_acceptance must be True or False, got 'false'"),
    ("compile as text", lambda t: SelfSpecModel(t, "ngram", compile="false"), ValueError, "compile must be True or False"),
    ("lookup_first as text", lambda t: SelfSpecModel(t, "ngram", lookup_first="false"), ValueError, "lookup_first must be True, False or None"),
    ("cpu_prepack as text", lambda t: SelfSpecModel(t, "ngram", cpu_prepack="false"), ValueError, "cpu_prepack must be True, False or None"),
    ("cpu_prepack as a number", lambda t: SelfSpecModel(t, "ngram", cpu_prepack=0), ValueError, "cpu_prepack must be True, False or None"),
    ("lean_verify as text", lambda t: SelfSpecModel(t, "ngram", lean_verify="false"), ValueError, "lean_verify must be True, False or None"),
    ("int8_drafter as text", lambda t: SelfSpecModel(t, "ngram", int8_drafter="no"), ValueError, "int8_drafter must be True or False"),
    ("freeze_gc as text", lambda t: SelfSpecModel(t, "ngram", freeze_gc="no"), ValueError, "freeze_gc must be True or False"),
    ("draft_batches as a number", lambda t: SelfSpecModel(t, "ngram", draft_batches=1), ValueError, "draft_batches must be True, False or None"),
    ("static cache past the context", lambda t: SelfSpecModel(t, "ngram", static_cache=10**9), ValueError, "more than the target's context of 256 positions can use"),
    ("static cache as a float", lambda t: SelfSpecModel(t, "ngram", static_cache=512.0), ValueError, "static_cache must be True, False, None or a number of tokens"),
    ("tree as a number", lambda t: SelfSpecModel(t, "ngram", tree=5), ValueError, "tree must be a dict of tree settings"),
    ("step_observer not callable", lambda t: SelfSpecModel(t, "ngram", step_observer="print"), ValueError, "step_observer must be a function"),
    ("tokenizer as a name", lambda t: SelfSpecModel(t, "ngram", tokenizer="gpt2"), ValueError, "tokenizer must be the target's tokenizer"),
    ("from_pretrained with a flag as text, before loading", lambda t: SelfSpecModel.from_pretrained("/nonexistent/drafter", compile="no"), ValueError, "compile must be True or False"),
    ("from_pretrained with a number for the drafter", lambda t: SelfSpecModel.from_pretrained(7, target=t), TypeError, "drafter_path_or_hub_id must be a folder or a hub id"),
    ("from_pretrained with a name for the target", lambda t: SelfSpecModel.from_pretrained("/nonexistent/drafter", target="gpt2"), TypeError, "target must be a transformers causal LM"),
    ("from_pretrained with a tokenizer not the drafter's, its target loaded", lambda t, tmp: SelfSpecModel.from_pretrained(drafter_of_a_saved_target(tmp), tokenizer=other_tokenizer()), ValueError, "tokenizer fingerprint: drafter trained with"),
    ("lookup min_match past its n-gram size", lambda t: LookupFirstDrafter(NgramDrafter(), min_match=9), ValueError, "min_match must be in 1..3"),
    # ---- prompts
    ("input_ids as a list", lambda t: gen(t, ids=[[5, 9]], max_new_tokens=4), TypeError, "input_ids must be a LongTensor"),
    ("input_ids as floats", lambda t: gen(t, ids=IDS.float(), max_new_tokens=4), TypeError, "input_ids must be a LongTensor"),
    ("empty prompt", lambda t: gen(t, ids=IDS[:, :0], max_new_tokens=4), ValueError, "non-empty prompt"),
    ("mask of another shape", lambda t: gen(t, attention_mask=torch.ones(1, 3), max_new_tokens=4), ValueError, "attention_mask shape"),
    ("right padding", lambda t: gen(t, attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0]]), max_new_tokens=4), ValueError, "left-padded"),
    ("mask as a list", lambda t: gen(t, attention_mask=[[1] * 6], max_new_tokens=4), TypeError, "attention_mask must be a tensor"),
    ("mask of counts", lambda t: gen(t, attention_mask=torch.full((1, 6), 2), max_new_tokens=4), ValueError, "attention_mask must hold only 0 (padding) and 1"),
    ("mask of halves", lambda t: gen(t, attention_mask=torch.full((1, 6), 0.5), max_new_tokens=4), ValueError, "attention_mask must hold only 0 (padding) and 1 (token), got values such as 0.5"),
    ("input_ids on the meta device", lambda t: gen(t, ids=IDS.to("meta"), max_new_tokens=4), ValueError, "input_ids are on the meta device, which holds no values"),
    ("mask on the meta device", lambda t: gen(t, attention_mask=torch.ones(1, 6, dtype=torch.long, device="meta"), max_new_tokens=4), ValueError, "attention_mask is on the meta device"),
    ("all-padding row", lambda t: gen(t, attention_mask=torch.zeros(1, 6, dtype=torch.long), max_new_tokens=4), ValueError, "empty"),
    ("ids outside the vocabulary", lambda t: gen(t, ids=torch.tensor([[5, 999]]), max_new_tokens=4), ValueError, "outside the target's vocabulary"),
    ("prompt filling the context", lambda t: gen(t, ids=torch.full((1, 256), 5), max_new_tokens=4), ValueError, "leaves no room in the target's context of 256"),
    # ---- lengths and sampling settings
    ("no max_new_tokens", lambda t: gen(t), ValueError, "pass max_new_tokens"),
    ("max_new_tokens zero", lambda t: gen(t, max_new_tokens=0), ValueError, "max_new_tokens must be a positive int"),
    ("max_new_tokens negative", lambda t: gen(t, max_new_tokens=-3), ValueError, "max_new_tokens must be a positive int"),
    ("max_new_tokens a float", lambda t: gen(t, max_new_tokens=2.5), TypeError, "max_new_tokens must be an integer"),
    ("max_new_tokens a bool", lambda t: gen(t, max_new_tokens=True), TypeError, "max_new_tokens must be an integer"),
    ("max_new_tokens a float tensor", lambda t: gen(t, max_new_tokens=torch.tensor(4.0)), TypeError, "max_new_tokens must be an integer"),
    ("do_sample as a string", lambda t: gen(t, max_new_tokens=4, do_sample="False"), TypeError, "do_sample must be True or False"),
    ("top_k a float", lambda t: gen(t, max_new_tokens=4, do_sample=True, top_k=2.5), TypeError, "top_k must be an integer"),
    ("top_k negative", lambda t: gen(t, max_new_tokens=4, do_sample=True, top_k=-1), ValueError, "top_k must be an int >= 0"),
    ("temperature zero when sampling", lambda t: gen(t, max_new_tokens=4, do_sample=True, temperature=0.0), ValueError, "temperature must be > 0"),
    ("temperature as text", lambda t: gen(t, max_new_tokens=4, do_sample=True, temperature="0.7"), TypeError, "temperature must be a number"),
    ("temperature infinite", lambda t: gen(t, max_new_tokens=4, do_sample=True, temperature=float("inf")), ValueError, "temperature must be > 0 and finite"),
    ("top_p as text", lambda t: gen(t, max_new_tokens=4, do_sample=True, top_p="0.9"), TypeError, "top_p must be a number"),
    ("min_new_tokens negative", lambda t: gen(t, max_new_tokens=4, min_new_tokens=-3), ValueError, "min_new_tokens must be >= 0"),
    ("top_p above one", lambda t: gen(t, max_new_tokens=4, do_sample=True, top_p=1.5), ValueError, "top_p must be in (0, 1]"),
    ("top_p zero", lambda t: gen(t, max_new_tokens=4, do_sample=True, top_p=0.0), ValueError, "top_p must be in (0, 1]"),
    # ---- token ids
    ("negative pad", lambda t: gen(t, max_new_tokens=4, pad_token_id=-5), ValueError, "pad_token_id [-5] outside the target's vocabulary"),
    ("two pads", lambda t: gen(t, max_new_tokens=4, pad_token_id=[0, 1]), ValueError, "pad_token_id must be one token id"),
    ("eos outside the vocabulary", lambda t: gen(t, max_new_tokens=4, eos_token_id=1000), ValueError, "eos_token_id [1000] outside"),
    ("eos as text", lambda t: gen(t, max_new_tokens=4, eos_token_id="</s>"), TypeError, "eos_token_id must be an integer"),
    ("suppressed token outside the vocabulary", lambda t: gen(t, generation_config=GenerationConfig(max_new_tokens=4, suppress_tokens=[500])), ValueError, "suppress_tokens [500] outside"),
    # ---- generation configs we cannot reproduce exactly
    ("generation_config as a dict", lambda t: gen(t, max_new_tokens=4, generation_config={"top_k": 4}), TypeError, "generation_config must be a GenerationConfig"),
    ("repetition penalty", lambda t: gen(t, generation_config=GenerationConfig(max_new_tokens=4, repetition_penalty=1.3)), ValueError, "repetition_penalty"),
    ("no-repeat n-grams", lambda t: gen(t, generation_config=GenerationConfig(max_new_tokens=4, no_repeat_ngram_size=2)), ValueError, "no_repeat_ngram_size"),
    ("beam search", lambda t: gen(t, generation_config=GenerationConfig(max_new_tokens=4, num_beams=2)), ValueError, "num_beams"),
    ("several sampled sequences as keywords", lambda t: gen(t, max_new_tokens=4, do_sample=True, num_return_sequences=2), ValueError, "the call sets {'num_return_sequences': 2}; SelfSpecModel applies"),
    ("several sequences per prompt", lambda t: gen(t, generation_config=GenerationConfig(max_new_tokens=4, num_return_sequences=2, do_sample=True)), ValueError, "num_return_sequences"),
    ("multi-token bad words", lambda t: gen(t, generation_config=GenerationConfig(max_new_tokens=4, bad_words_ids=[[5, 9]])), ValueError, "bad_words_ids with sequences of more than one token"),
    ("min_p", lambda t: gen(t, generation_config=GenerationConfig(max_new_tokens=4, min_p=0.1, do_sample=True)), ValueError, "min_p"),
    ("typical_p", lambda t: gen(t, generation_config=GenerationConfig(max_new_tokens=4, typical_p=0.5, do_sample=True)), ValueError, "typical_p"),
    ("forced eos", lambda t: gen(t, generation_config=GenerationConfig(max_new_tokens=4, forced_eos_token_id=2)), ValueError, "forced_eos_token_id"),
    ("bad words as a flat list", lambda t: gen(t, max_new_tokens=4, bad_words_ids=[5, 9]), TypeError, "bad_words_ids must be a list of token-id lists"),
    ("bad word outside the vocabulary", lambda t: gen(t, max_new_tokens=4, bad_words_ids=[[500]]), ValueError, "bad_words_ids [500] outside"),
    ("scores asked for", lambda t: gen(t, generation_config=GenerationConfig(max_new_tokens=4, output_scores=True)), ValueError, "'output_scores': True}; SelfSpecModel.generate returns the token ids only"),
    ("a dict asked for", lambda t: gen(t, max_new_tokens=4, return_dict_in_generate=True), ValueError, "return_dict_in_generate"),
    ("logits asked for", lambda t: gen(t, max_new_tokens=4, output_logits=True), ValueError, "output_logits"),
    ("a time limit", lambda t: gen(t, max_new_tokens=4, max_time=2.0), ValueError, "'max_time': 2.0}"),
    ("repetition penalty as a keyword", lambda t: gen(t, max_new_tokens=4, repetition_penalty=1.3), ValueError, "repetition_penalty"),
    ("a keyword generate does not know", lambda t: gen(t, max_new_tokens=4, max_new_token=4), TypeError, "generate got max_new_token: neither an argument"),
    ("a logits processor", lambda t: gen(t, max_new_tokens=4, logits_processor=[]), TypeError, "generate got logits_processor"),
    ("stop strings", lambda t: gen(t, generation_config=GenerationConfig(max_new_tokens=4, stop_strings=["."])), ValueError, "stop_strings"),
    # ---- call plumbing
    ("streamer without put/end", lambda t: gen(t, max_new_tokens=4, streamer=object()), TypeError, "streamer must have put() and end()"),
    ("generator as a seed", lambda t: gen(t, max_new_tokens=4, do_sample=True, generator=123), TypeError, "generator must be a torch.Generator"),
    ("streamer with a batch", lambda t: SelfSpecModel(t, "ngram").generate(IDS.repeat(2, 1), max_new_tokens=4, streamer=_Sink()), ValueError, "streamer supports batch size 1"),
    # ---- files: saved drafters, benchmark questions and results
    ("drafter file with damaged weights", lambda t, tmp: __import__("heads").load(damaged_drafter(tmp, t)), ValueError, "holds non-finite weights"),
    ("question file missing", lambda t, tmp: bench.load_questions(tmp / "none.jsonl"), FileNotFoundError, "no question file at"),
    ("question file with a broken second line", lambda t, tmp: bench.load_questions(questions(tmp, '{"question_id": 1, "category": "a", "turns": ["x"]}\n{"question_id": 2,\n')), ValueError, "q.jsonl:2: not valid JSON"),
    ("question file as a JSON array", lambda t, tmp: bench.load_questions(questions(tmp, '[{"question_id": 1, "category": "a", "turns": ["x"]}]\n')), ValueError, "each line must be one question object, got a JSON list"),
    ("question file as a multi-line JSON array", lambda t, tmp: bench.load_questions(questions(tmp, '[\n{"question_id": 1}\n]\n')), ValueError, "a JSON array?"),
    ("question without turns", lambda t, tmp: bench.load_questions(questions(tmp, '{"question_id": 1, "category": "a"}\n')), ValueError, "question lacks ['turns']"),
    ("bench results that are not JSON", lambda t, tmp: publish.measured_metrics(bench_result(tmp, "{oops"), None), ValueError, "is not valid JSON"),
    ("bench results of another shape", lambda t, tmp: publish.measured_metrics(bench_result(tmp, '{"methods": []}'), None), ValueError, "is not a scripts/bench.py results.json"),
    # ---- script flags: refused by name before any model loads
    ("bench: a misspelt drafter name", lambda t, tmp: bench_cli(tmp, "--drafter", "ngarm"), ValueError, "no drafter named 'ngarm' (did you mean 'ngram'?); the named drafters are: ngram"),
    ("bench: a drafter name that is no folder", lambda t, tmp: bench_cli(tmp, "--drafter", "ngrm"), ValueError, "--drafter 'ngrm': no such local folder (/"),
    ("bench: --out a file", lambda t, tmp: bench_cli(tmp, "--out", tmp / "q.jsonl"), ValueError, "q.jsonl is a file; give a folder for results.json"),
    ("bench: --out under a file", lambda t, tmp: bench_cli(tmp, "--out", tmp / "q.jsonl" / "run"), ValueError, "q.jsonl, which is a file, not a folder"),
    ("bench: --random-target --out a file", lambda t, tmp: cli("bench", "--random-target", "tiny", "--out", questions(tmp, "")), ValueError, "q.jsonl is a file"),
    ("bench: an Apple GPU", lambda t, tmp: bench_cli(tmp, "--device", "mps"), ValueError, "argument --device: mps: the benchmark runs on the CPU or a CUDA GPU, not on mps devices"),
    ("bench: a prompt past the random target's context", lambda t, tmp: cli("bench", "--random-target", "tiny", "--prompt-tokens", "100000", "--out", tmp / "o"), ValueError, "--prompt-tokens 100000 + --max-new-tokens 128 do not fit the 2048-position context of the 'tiny' shape"),
    ("bench: no repeats", lambda t, tmp: bench_cli(tmp, "--repeats", "0"), ValueError, "argument --repeats: must be a whole number >= 1, got 0"),
    ("bench: no new tokens", lambda t, tmp: bench_cli(tmp, "--max-new-tokens", "0"), ValueError, "argument --max-new-tokens: must be a whole number >= 1"),
    ("bench: a negative limit", lambda t, tmp: bench_cli(tmp, "--limit", "-1"), ValueError, "argument --limit: must be a whole number >= 0"),
    ("bench: prompt lookup of no tokens", lambda t, tmp: bench_cli(tmp, "--pld-tokens", "0"), ValueError, "argument --pld-tokens: must be a whole number >= 1"),
    ("bench: negative threads", lambda t, tmp: bench_cli(tmp, "--threads", "-1"), ValueError, "argument --threads: must be a whole number >= 0"),
    ("bench: temperature NaN", lambda t, tmp: bench_cli(tmp, "--sample", "--temperature", "nan"), ValueError, "argument --temperature: must be a finite number > 0, got nan"),
    ("bench: top-p above one", lambda t, tmp: bench_cli(tmp, "--sample", "--top-p", "1.5"), ValueError, "argument --top-p: must be a finite number in (0, 1]"),
    ("bench: oracle alpha above one", lambda t, tmp: bench_cli(tmp, "--oracle", "1.5"), ValueError, "argument --oracle: must be a finite number in [0, 1]"),
    ("bench: a device torch does not know", lambda t, tmp: bench_cli(tmp, "--device", "gpu0"), ValueError, "argument --device: 'gpu0' is not a torch device"),
    ("bench: --temperature without --sample", lambda t, tmp: bench_cli(tmp, "--temperature", "0.3"), ValueError, "--temperature without --sample: add --sample to time sampled generation"),
    ("bench: --seed without --sample", lambda t, tmp: bench_cli(tmp, "--seed", "3"), ValueError, "--seed without --sample"),
    ("bench: --tree with no trained drafter", lambda t, tmp: bench_cli(tmp, "--drafter", "ngram", "--tree", "depth=3"), ValueError, "--tree depth=3 sets trained drafters' trees, but no --drafter is a trained drafter (ngram)"),
    ("bench: --second-turns on questions of one turn", lambda t, tmp: bench_cli(tmp, "--second-turns"), ValueError, "--second-turns times second turns, but none of the 1 questions selected has one"),
    ("bench: a new run over an unfinished run's records", lambda t, tmp: (earlier_bench(tmp, RECORD), bench_cli(tmp)), ValueError, "holds 1 records of a run that did not finish"),
    ("bench: --resume with another --max-new-tokens", lambda t, tmp: (earlier_bench(tmp, RECORD, {"max_new_tokens": 4}), bench_cli(tmp, "--resume", "--max-new-tokens", "8")), ValueError, "was measured with other settings (max_new_tokens 4 -> 8)"),
    ("bench: --resume adding --sample", lambda t, tmp: (earlier_bench(tmp, RECORD, {"sampling": None}), bench_cli(tmp, "--resume", "--sample")), ValueError, "was measured with other settings (sampling None -> {'temperature': 0.7"),
    ("bench: --resume onto another target", lambda t, tmp: (earlier_bench(tmp, RECORD, {"target": "other"}), bench_cli(tmp, "--resume")), ValueError, "was measured with other settings (target 'other' -> '"),
    ("bench: --resume on a records line that is not JSON", lambda t, tmp: (earlier_bench(tmp, "garbage\n" + RECORD), bench_cli(tmp, "--resume")), ValueError, "records.jsonl: line 1 is not JSON, so the records cannot be resumed"),
    ("bench: --resume on records of something else", lambda t, tmp: (earlier_bench(tmp, '{"id": 1}\n'), bench_cli(tmp, "--resume")), ValueError, "records.jsonl: line 1 is not a record of a benchmark run"),
    ("serve: port zero", lambda t, tmp: cli("serve", tmp / "drafter", "--dry-run", "--port", "0"), ValueError, "argument --port: must be in 1..65535, got 0"),
    ("serve: no speculative tokens", lambda t, tmp: cli("serve", "ngram", "--target", "x", "--dry-run", "--num-speculative-tokens", "0"), ValueError, "argument --num-speculative-tokens: must be >= 1"),
    ("serve: start-up timeout NaN", lambda t, tmp: cli("serve", "ngram", "--target", "x", "--dry-run", "--startup-timeout", "nan"), ValueError, "argument --startup-timeout: must be a finite number of seconds > 0"),
    ("serve: export into a folder of the user's", lambda t, tmp: cli("serve", saved_drafter(tmp, t), "--target", "x", "--dry-run", "--export-dir", user_folder(tmp)), ValueError, "is not empty (config.json) and holds no earlier export"),
    ("calibrate: no repeats", lambda t, tmp: cli("calibrate", "--drafter", tmp, "--prompts", tmp / "p.jsonl", "--repeats", "0"), ValueError, "argument --repeats: must be >= 1, got 0"),
    ("calibrate: context of no tokens", lambda t, tmp: cli("calibrate", "--drafter", tmp, "--prompts", tmp / "p.jsonl", "--context", "0"), ValueError, "argument --context: must be >= 1"),
    ("calibrate: more nodes than measured", lambda t, tmp: cli("calibrate", "--drafter", tmp, "--prompts", tmp / "p.jsonl", "--wide", "8", "--max-nodes", "9"), ValueError, "argument --max-nodes: must be <= --wide (8)"),
    ("push_to_hub: bench file missing", lambda t, tmp: publish.main([str(saved_drafter(tmp, t)), "--repo-id", "me/x", "--dry-run", "--bench", str(tmp / "none.json")]), FileNotFoundError, "--bench "),
    ("push_to_hub: staging into a folder of the user's", lambda t, tmp: publish.main([str(saved_drafter(tmp, t)), "--repo-id", "me/x", "--dry-run", "--stage-dir", str(user_folder(tmp))]), ValueError, "holds no earlier staging of a drafter"),
]


class _Sink:
    def put(self, value):
        pass

    def end(self):
        pass


@pytest.mark.parametrize("case,make,error,fragment", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_gets_a_clear_error(target, tmp_path, case, make, error, fragment):
    with pytest.raises(error) as info:
        make(target, tmp_path) if make.__code__.co_argcount == 2 else make(target)
    assert fragment in str(info.value), f"{case}: {info.value}"


def test_table_is_large_enough():
    assert len(ROWS) >= 50


def test_a_mistyped_relative_target_is_said_to_be_no_folder_before_what_the_hub_said(tmp_path, monkeypatch):
    """`runs/no_such_target` could be a hub id; with no such folder here that is said first, then the hub's answer
    (offline: that it could not be reached), never the hub's answer alone."""
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no such folder: 'runs/no_such_target' \(the target; looked for "
                                                r"/.*, and as a hub id: "):
        cli("bench", "--questions", questions(tmp_path, '{"question_id": 1, "category": "a", "turns": ["x"]}\n'),
            "--target", "runs/no_such_target")


def test_a_generator_on_another_device_than_the_target_is_refused_with_the_fix():
    """A CPU generator for a CUDA target failed inside the first sampled step (torch.rand refuses it there); checked
    here with the devices given, since this machine may have no GPU."""
    from infer.request import check_generator

    check_generator(None, torch.device("cuda"))
    check_generator(torch.Generator(), torch.device("cpu"))
    with pytest.raises(ValueError, match=r"pass torch.Generator\(device='cuda:0'\)"):
        check_generator(torch.Generator(), torch.device("cuda:0"))
