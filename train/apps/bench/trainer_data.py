"""The side-by-side trainer benchmark's inputs: one set of rows, and each trainer's features from one forward.

Rows are the target's own answers (a distillation file of OpenAI-messages rows), tokenized once with the
target's chat template by `train.data` (the assistant-only loss mask, truncation at `max_length`), in file
order, until they hold the budget of assistant tokens. selfspec reads the same conversations back from
`rows.jsonl` and tokenizes them to the same ids (checked after its run: it found the feature cache captured here,
whose key hashes the ids); the peers read the ids and masks as written.

Features come from one fp32 forward of the target per row, written in each trainer's layout:

    speculators  <work>/data/speculators: a saved `datasets` table of input_ids, loss_mask, seq_len (what
                 `speculators prepare-data` writes for pre-tokenized rows), token_freq.pt (assistant-token counts,
                 for its draft vocabulary) and hidden_states/hs_<i>.safetensors {token_ids [L], hidden_states
                 [L, 4, H]}: the three auxiliary layers and the last layer's output before the final norm (speculators
                 applies the verifier's norm itself)
    specforge    <work>/data/specforge/data_<i>.ckpt {input_ids [L], loss_mask [L], aux_hidden_state [1, L, 3H],
                 hidden_state [1, L, H]}: the last hidden state after the final norm, as SGLang captures it
    selfspec     its offline feature cache (train.features.FeatureCache) under the key its run computes, so the run
                 finds it built

The auxiliary layers are hidden_states indices (2, N//2, N-3): speculators' default target_layer_ids, specforge's
default aux ids (1, N//2-1, N-4) counted as SGLang counts them (a layer's output), and selfspec's EAGLE-3 default.
The peers store bfloat16 (their default), selfspec float32 (its default).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from heads.eagle3.config import default_feature_layers
from train.data import (
    Conversation,
    DataStats,
    load_rows,
    read_conversations,
    samples_fingerprint,
    tokenize_conversations,
)
from train.features import SHARD_SAMPLES, cache_key, needed_layers
from train.target import target_fingerprint

CHUNK = 64  # conversations tokenized at a time while filling the budget
PEER_DTYPE = torch.bfloat16  # what both peers' own capture paths store
SELFSPEC_FEATURE_DTYPE = "float32"  # TrainConfig.feature_dtype's default
DONE = "done.json"  # written last into a finished layout folder


@dataclass
class Rows:
    """The benchmark's rows: the conversations as read and their samples (ids and loss masks)."""

    conversations: list[Conversation]
    samples: list  # train.data.Sample, one per conversation, in the same order
    assistant_tokens: int
    tokens: int

    @property
    def fingerprint(self) -> str:
        return samples_fingerprint(self.samples)


def prepare_rows(data: str | Path, tokenizer, budget: int, max_length: int) -> Rows:
    """The first rows of `data` (in file order), tokenized and truncated as selfspec's training does, until their
    assistant tokens reach `budget`; the last row kept whole."""
    if budget < 1:
        raise ValueError(f"the budget of assistant tokens must be >= 1, got {budget}")
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2 (a prompt token and a reply token), got {max_length}")
    conversations, _ = read_conversations(load_rows(str(data)))
    kept, samples, seen = [], [], 0
    for start in range(0, len(conversations), CHUNK):
        chunk = conversations[start:start + CHUNK]
        try:
            chunk_samples, _ = tokenize_conversations(chunk, DataStats(), tokenizer, max_length)
        except ValueError as err:
            if "every sample lost all assistant tokens" not in str(err):
                raise
            continue
        by_id = {c.id: c for c in chunk}
        for sample in chunk_samples:
            kept.append(by_id[sample.id])
            samples.append(sample)
            seen += sum(sample.loss_mask)
            if seen >= budget:
                return Rows(kept, samples, seen, sum(len(s.input_ids) for s in samples))
    raise ValueError(f"{data} holds {seen} assistant tokens at max_length={max_length}, fewer than the budget of "
                     f"{budget}; lower the budget or give more rows")


def write_rows(rows: Rows, folder: Path) -> Path:
    """rows.jsonl: the conversations as selfspec's training reads them (OpenAI messages, the cut flag kept)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "rows.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for c in rows.conversations:
            f.write(json.dumps({"id": c.id, "messages": c.messages, "finished": not c.last_reply_cut},
                               ensure_ascii=False) + "\n")
    return path


def peer_target(source: Path, dest: Path) -> Path:
    """A folder the peers load as the target: the embedded target's files linked, plus the
    model.safetensors.index.json specforge looks its embedding and LM head up in."""
    from safetensors import safe_open

    dest.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        link = dest / f.name
        if f.is_file() and not link.exists():
            os.symlink(f.resolve(), link)
    index = dest / "model.safetensors.index.json"
    if not index.exists():
        with safe_open(str(source / "model.safetensors"), framework="pt") as f:
            keys = sorted(f.keys())
        index.write_text(json.dumps({"metadata": {}, "weight_map": dict.fromkeys(keys, "model.safetensors")}))
    return dest


@dataclass
class Layouts:
    """Where each trainer's features go."""

    speculators: Path
    specforge: Path
    selfspec_root: Path  # feature_cache_dir of selfspec's run
    selfspec_key: str
    selfspec_layers: tuple[int, ...]  # the target layers in selfspec's cache

    @property
    def selfspec(self) -> Path:
        return self.selfspec_root / self.selfspec_key


def layouts(work: Path, target, target_name: str, rows: Rows, soft: bool = False) -> Layouts:
    """The layout folders under `work`; selfspec's cache under the key its training computes for these samples
    (train_heads.make_features: the target's name and fingerprint, the samples' ids, its layers and dtype). With
    `soft` (a variant trained on the target's distribution) the cache holds the last layer too, in a root of its
    own: each root holds the one cache its runs may use."""
    n = target.config.num_hidden_layers
    layers = needed_layers(SimpleNamespace(feature_layers=default_feature_layers(n)), n, soft)  # as training asks
    key = cache_key(f"{target_name}:{target_fingerprint(target)}", rows.samples, layers, SELFSPEC_FEATURE_DTYPE)
    root = work / "features" / ("selfspec+last" if soft else "selfspec")
    return Layouts(work / "data" / "speculators", work / "data" / "specforge", root, key, layers)


def capture(target, rows: Rows, where: Layouts, progress: bool = True) -> dict:
    """Every layout from one forward per row; a layout whose folder is finished for these rows is kept. Returns
    {layout: "captured" | "kept"}."""
    from tqdm.auto import tqdm

    fingerprint = rows.fingerprint
    folders = {"speculators": where.speculators, "specforge": where.specforge, "selfspec": where.selfspec}
    todo = {name for name, folder in folders.items() if not finished(folder, fingerprint)}
    if not todo:
        return dict.fromkeys(folders, "kept")
    for name in todo:
        shutil.rmtree(folders[name], ignore_errors=True)
        folders[name].mkdir(parents=True)
    n = target.config.num_hidden_layers
    aux = default_feature_layers(n)
    writer = SelfspecCacheWriter(where.selfspec, where.selfspec_layers) if "selfspec" in todo else None
    with torch.inference_mode():
        for i, sample in enumerate(tqdm(rows.samples, desc="features", disable=not progress)):
            ids = torch.tensor(sample.input_ids, dtype=torch.long)
            hidden, before_norm = forward_layers(target, ids)
            if "speculators" in todo:
                write_speculators_row(where.speculators, i, ids, [hidden[k] for k in aux] + [before_norm])
            if "specforge" in todo:
                write_specforge_row(where.specforge, i, ids, sample.loss_mask, [hidden[k] for k in aux], hidden[n])
            if writer is not None:
                writer.add(i, {k: hidden[k] for k in where.selfspec_layers})
    if "speculators" in todo:
        write_speculators_table(where.speculators, rows)
        # its validation row: the last row again (see write_speculators_table)
        shutil.copyfile(where.speculators / "hidden_states" / f"hs_{len(rows.samples) - 1}.safetensors",
                        where.speculators / "hidden_states" / f"hs_{len(rows.samples)}.safetensors")
    if writer is not None:
        writer.close(rows)
    for name in todo:
        layers = list(where.selfspec_layers) if name == "selfspec" else aux
        (folders[name] / DONE).write_text(json.dumps({"samples": fingerprint, "layers": layers}))
    return {name: "captured" if name in todo else "kept" for name in folders}


def finished(folder: Path, fingerprint: str) -> bool:
    marker = folder / DONE
    return marker.is_file() and json.loads(marker.read_text()).get("samples") == fingerprint


def forward_layers(target, ids: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """One row's hidden_states ([L, H] each, index 0 the embeddings, the last after the final norm) and the last
    layer's output before the norm."""
    # ids: [L]
    seen = {}
    handle = target.model.layers[-1].register_forward_hook(
        lambda module, args, out: seen.__setitem__("out", out[0] if isinstance(out, tuple) else out))
    try:
        out = target.model(input_ids=ids[None], output_hidden_states=True, use_cache=False)
    finally:
        handle.remove()
    hidden = tuple(h[0] for h in out.hidden_states)
    return hidden, seen["out"][0]


def write_speculators_row(folder: Path, i: int, ids: torch.Tensor, layers: list[torch.Tensor]) -> None:
    from safetensors.torch import save_file

    (folder / "hidden_states").mkdir(exist_ok=True)
    save_file({"token_ids": ids.contiguous(), "hidden_states": torch.stack(layers, dim=1).to(PEER_DTYPE).contiguous()},
              str(folder / "hidden_states" / f"hs_{i}.safetensors"))


def write_specforge_row(folder: Path, i: int, ids: torch.Tensor, mask: list[int], aux: list[torch.Tensor],
                        last: torch.Tensor) -> None:
    # zero-padded names: specforge lists its feature files sorted by name
    torch.save({"input_ids": ids.clone(), "loss_mask": torch.tensor(mask, dtype=torch.long),
                "aux_hidden_state": torch.cat(aux, dim=-1)[None].to(PEER_DTYPE).clone(),
                "hidden_state": last[None].to(PEER_DTYPE).clone()}, folder / f"data_{i:07d}.ckpt")


def write_speculators_table(folder: Path, rows: Rows) -> None:
    """The rows as `speculators prepare-data` saves pre-tokenized ones, and their assistant-token counts.

    speculators always holds the end of its table out for validation (train_data_ratio in (0, 1)): the last row
    is written twice, and `speculators_train_ratio` puts the split between the two, so it trains on every row
    once, as the others do, and validates on one it has seen."""
    import datasets

    samples = [*rows.samples, rows.samples[-1]]
    table = datasets.Dataset.from_dict({"input_ids": [s.input_ids for s in samples],
                                        "loss_mask": [s.loss_mask for s in samples],
                                        "seq_len": [len(s.input_ids) for s in samples]})
    table.with_format("torch").save_to_disk(str(folder))
    counts: dict[int, int] = {}
    for s in rows.samples:
        for token, keep in zip(s.input_ids, s.loss_mask, strict=True):
            if keep:
                counts[token] = counts.get(token, 0) + 1
    torch.save(counts, folder / "token_freq.pt")


def speculators_train_ratio(rows: int) -> float:
    """The train_data_ratio whose split (int(table rows * ratio)) ends at the duplicated last row."""
    return (rows + 0.5) / (rows + 1)


class SelfspecCacheWriter:
    """Writes train.features.FeatureCache's format: shards of SHARD_SAMPLES samples, `<i>.<layer>` tensors, then
    meta.json, which marks the cache finished for the reader."""

    def __init__(self, folder: Path, layers: list[int]):
        self.folder, self.layers = folder, list(layers)
        self.pending: dict[str, torch.Tensor] = {}
        self.shard_of: list[int] = []
        self.shard = 0

    def add(self, i: int, hidden: dict[int, torch.Tensor]) -> None:
        for layer in self.layers:
            self.pending[f"{i}.{layer}"] = hidden[layer].float().contiguous().clone()
        self.shard_of.append(self.shard)
        if len(self.shard_of) % SHARD_SAMPLES == 0:
            self.flush()

    def flush(self) -> None:
        from safetensors.torch import save_file

        if self.pending:
            save_file(self.pending, str(self.folder / f"shard-{self.shard:05d}.safetensors"))
            self.pending, self.shard = {}, self.shard + 1

    def close(self, rows: Rows) -> None:
        self.flush()
        meta = {"layers": sorted(self.layers), "lengths": [len(s.input_ids) for s in rows.samples],
                "shard_of": self.shard_of, "dtype": SELFSPEC_FEATURE_DTYPE, "samples": len(rows.samples)}
        (self.folder / "meta.json").write_text(json.dumps(meta))
