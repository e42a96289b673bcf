"""EAGLE-3 layer styles at equal budget: a Llama layer at the target's sizes against the target's own layer.

For each architecture, a small random target (with a character tokenizer and a chat template) answers a fixed
set of prompts greedily; drafters of both styles are trained on those answers with the same steps, data and
seed, then measured on prompts held out from training: the held-out estimate training reports (est_accept_len,
step-0 top-1) and the mean accepted length of greedy speculative decoding (SelfSpecModel, chain of 3). Runs in
a few minutes on a CPU; the table in docs/export.md ("Layer style") is its output.

    .venv/bin/python scripts/compare_layer_styles.py --archs qwen3 gemma3_text --seeds 0 1 2 --steps 150
"""

from __future__ import annotations

import argparse
import json
import string
import tempfile
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHARS = string.ascii_lowercase + string.ascii_uppercase[:12] + string.digits + " \n.,?!'"
WORDS = ["add", "one", "two", "say", "hi", "count", "name", "color", "what", "is", "up", "spell", "cat", "give",
         "fruit", "pick", "day", "yes", "no", "big", "number", "small", "word", "red", "blue", "tell", "me", "a"]


def char_tokenizer() -> transformers.PreTrainedTokenizerFast:
    specials = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + list(CHARS))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<|im_start|>",
                                               eos_token="<|im_end|>", unk_token="<unk>")
    tok.chat_template = CHATML
    return tok


def tiny_target(model_type: str, folder: Path, seed: int = 0) -> str:
    """A random 4-layer target, width 64, vocab 96 (the tokenizer's), peaked next-token distributions."""
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.5,
                 bos_token_id=1, eos_token_id=2, pad_token_id=0, vocab_size=96)
    if model_type.startswith("gemma"):
        shape["sliding_window"] = 32
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(model_type, **shape)
    attn = "eager" if model_type == "gemma2" else "sdpa"
    transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval().save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return str(folder)


def prompts(n: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    return [" ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (int(torch.randint(2, 6, (1,), generator=g)),),
                                                          generator=g)) for _ in range(n)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", nargs="+", default=["qwen3", "gemma3_text"])
    parser.add_argument("--drafter", default="eagle3", help="the drafter kind whose layer styles are compared")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="training seeds per style")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--train-prompts", type=int, default=96)
    parser.add_argument("--test-prompts", type=int, default=16)
    return parser


def main(argv=None) -> int:
    import datasets

    from train.regenerate import regenerate

    args = build_parser().parse_args(argv)
    rows_out = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for arch in args.archs:
            target_dir = tiny_target(arch, root / arch)
            model = transformers.AutoModelForCausalLM.from_pretrained(target_dir).eval()
            tokenizer = char_tokenizer()
            train_rows = datasets.Dataset.from_list([{"id": str(i), "messages": [{"role": "user", "content": p}]}
                                                     for i, p in enumerate(prompts(args.train_prompts, 0))])
            data = root / f"{arch}.jsonl"
            regenerate(model, tokenizer, train_rows, data, max_new_tokens=48, batch_size=16, progress=False)
            held_out = prompts(args.test_prompts, 1)
            for style in ("llama", "target"):
                for seed in args.seeds:
                    row = {"arch": arch, "style": style, "seed": seed,
                           **train_and_measure(args, model, tokenizer, root / arch, data, style, seed, held_out)}
                    print(json.dumps(row), flush=True)
                    rows_out.append(row)
    print(summary(rows_out, args.archs))
    return 0


def train_and_measure(args, model, tokenizer, target_dir: Path, data: Path, style: str, seed: int,
                      held_out: list[str]) -> dict:
    """One drafter (`args.drafter`, `args.steps`) of `style` trained on `data`, with the held-out estimate training
    reports and its mean accepted length drafting a chain of 3 on `held_out`. Its run goes beside `target_dir`."""
    import heads
    from infer import SelfSpecModel
    from train.config import load_config
    from train.train_heads import train

    arch, root = target_dir.name, target_dir.parent
    result = train(load_config(None, {
        "target": str(target_dir), "drafter": args.drafter, "data": str(data), "seed": seed,
        "output_dir": str(root / f"{arch}-{style}-{seed}"), "features": "offline",
        "feature_cache_dir": str(root / f"{arch}-features"),
        "max_steps": args.steps, "batch_size": 8, "lr": 3e-3, "warmup_steps": 5,
        "eval_fraction": 0.1, "ttt_steps": 2, "progress_bar": False, "log_every": 0,
        "drafter_options": {"layer_style": style}}))
    drafter = heads.load(result["drafter_dir"])
    engine = SelfSpecModel(model, drafter, tokenizer=tokenizer, tree={"mode": "static", "paths": [[0], [0, 0], [0, 0, 0]]})
    accepted = []
    for p in held_out:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        engine.generate(ids, max_new_tokens=48)
        accepted += engine.last_stats["accepted_lengths"]
    metrics = drafter.config.metrics or {}
    return {"layer": type(drafter.layers[0]).__name__, "params": sum(p.numel() for p in drafter.parameters()),
            "est_accept_len": round(metrics.get("est_accept_len", float("nan")), 3),
            "step0_top1": round(metrics.get("step0/top1", float("nan")), 3),
            "accepted_len": round(sum(accepted) / len(accepted), 3)}


def summary(rows: list[dict], archs: list[str]) -> str:
    """One markdown row per architecture and style: the mean over seeds, and half the spread."""
    lines = []
    for arch in archs:
        for style in ("llama", "target"):
            sel = [r for r in rows if r["arch"] == arch and r["style"] == style]
            mean = {k: sum(r[k] for r in sel) / len(sel) for k in ("est_accept_len", "step0_top1", "accepted_len")}
            spread = {k: max(r[k] for r in sel) - min(r[k] for r in sel) for k in mean}
            lines.append(f"| {arch} | {style} | {sel[0]['layer']} | {sel[0]['params']} | "
                         + " | ".join(f"{mean[k]:.3f} (±{spread[k] / 2:.3f})" for k in mean) + " |")
    return "\n".join(lines)
