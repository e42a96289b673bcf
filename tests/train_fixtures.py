"""Offline helpers for the training tests: a character-level chat tokenizer and small datasets on disk.

The tokenizer's ids fit the tiny targets of conftest.py (vocab 96; pad 0, bos 1, eos 2): one token per
character, plus `<|im_start|>`/`<|im_end|>`, and a ChatML template set in code.
"""

from __future__ import annotations

import json
import string

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
CHARS = string.ascii_lowercase + string.ascii_uppercase[:12] + string.digits + " \n.,?!'"


def char_tokenizer(chat_template: str | None = CHATML) -> PreTrainedTokenizerFast:
    tok = character_tokenizer(SPECIALS, CHARS, chat_template)
    assert len(tok) <= 96
    return tok


def character_tokenizer(specials: list[str], chars: str, chat_template: str | None) -> PreTrainedTokenizerFast:
    """One token per character of `chars`, after `specials` (ChatML's markers among them)."""
    vocab = {tok: i for i, tok in enumerate(specials + list(chars))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<|im_start|>",
                                  eos_token="<|im_end|>", unk_token="<unk>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = chat_template
    return tok


# Short conversations in a tiny vocabulary, so that a few dozen steps show learning.
PROMPTS = ["add one and two", "say hi", "count to five", "name a color", "what is up", "spell cat",
           "give a fruit", "pick a day", "say yes", "say no", "a big number", "a small word"]
REPLIES = ["three", "hi there", "one two three four five", "blue", "not much", "c a t", "apple", "monday",
           "yes", "no", "one million", "it"]


def conversations(n: int = 48) -> list[list[dict]]:
    out = []
    for i in range(n):
        k = i % len(PROMPTS)
        out.append([{"role": "user", "content": PROMPTS[k]},
                    {"role": "assistant", "content": f"{REPLIES[k]} and {REPLIES[(k + 1) % len(REPLIES)]}."}])
    return out


def write_messages(path, convs) -> str:
    with open(path, "w") as f:
        for i, c in enumerate(convs):
            f.write(json.dumps({"id": f"c{i}", "messages": c}) + "\n")
    return str(path)


def write_sharegpt(path, convs) -> str:
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    rows = [{"id": f"c{i}", "conversations": [{"from": names[m["role"]], "value": m["content"]} for m in c]}
            for i, c in enumerate(convs)]
    with open(path, "w") as f:
        json.dump(rows, f)
    return str(path)


def write_alpaca(path, convs) -> str:
    rows = [{"instruction": c[0]["content"], "input": "", "output": c[1]["content"]} for c in convs]
    with open(path, "w") as f:
        json.dump(rows, f)
    return str(path)


def save_tiny_target(folder, model_type: str = "llama", **overrides) -> str:
    """A tiny random target plus the char tokenizer, saved as an ordinary transformers folder."""
    from conftest import tiny_model

    model = tiny_model(model_type, **overrides)
    model.save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return str(folder)


def tiny_chat_target():
    """A tiny random Llama target and the char tokenizer, for tests that generate with a chat template."""
    from conftest import tiny_model

    return tiny_model("llama"), char_tokenizer()


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]
