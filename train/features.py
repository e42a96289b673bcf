"""Target features for drafter training: computed online in the loop, or once into an on-disk cache.

A drafter reads some of the target's hidden states (`drafter.feature_layers`, indices into the target's
`output_hidden_states` tuple) and, for soft targets, the target's next-token distribution, which is the
target's lm_head on its last hidden state, so it is recomputed from that layer instead of being stored.

Offline: every sample's layers are computed once and stored as safetensors shards under
`<cache_dir>/<key>/`, where the key hashes the target's identity, the tokenized samples (so the data, the
chat template and max_length) and the layer set. A finished cache is reused across epochs and runs; on a
CPU this is the only practical way to train for several epochs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from heads.losses import target_inputs

from .target import DTYPES

SHARD_SAMPLES = 64  # samples per safetensors shard


@torch.no_grad()
def target_hidden_states(target, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         layers: tuple[int, ...], position_ids: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
    """{layer: [B, T, D]} from one frozen forward of the target's base model (no lm_head, no cache).
    attention_mask: [B, T] padding, or a 4D mask with `position_ids` for packed rows."""
    out = target.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            output_hidden_states=True, use_cache=False)
    return {layer: out.hidden_states[layer] for layer in layers}


def needed_layers(drafter, num_target_layers: int, soft: bool) -> tuple[int, ...]:
    """The drafter's feature layers, plus the last layer when soft targets (its lm_head) are needed."""
    layers = set(drafter.feature_layers)
    if soft:
        layers.add(num_target_layers)
    return tuple(sorted(layers))


def cache_key(target_id: str, samples, layers: tuple[int, ...], dtype: str) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"target": target_id, "layers": list(layers), "dtype": dtype}).encode())
    for s in samples:
        h.update(len(s.input_ids).to_bytes(4, "little"))
        h.update(torch.tensor(s.input_ids, dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()[:20]


class FeatureCache:
    """Read side of a finished cache: `get(indices, width)` -> {layer: [B, width, D]} (zero-padded).

    Each call opens the shards it reads and lets them go after: a shard stays mapped only while it is read, so
    the pages of a cache read once an epoch are not held in the process (an open handle per shard kept every page
    ever read resident, the whole cache by the end of an epoch: 1.9 GB at 281k tokens of SmolLM2's three layers)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        meta = json.loads((self.folder / "meta.json").read_text())
        self.layers = tuple(meta["layers"])
        self.lengths = meta["lengths"]
        self.shard_of = meta["shard_of"]

    def _reader(self):
        """tensor(i, layer) over the shards opened so far in one call."""
        handles = {}

        def tensor(i: int, layer: int) -> torch.Tensor:
            shard = self.shard_of[i]
            if shard not in handles:
                handles[shard] = safe_open(str(self.folder / f"shard-{shard:05d}.safetensors"), framework="pt")
            return handles[shard].get_tensor(f"{i}.{layer}")

        return tensor

    def get(self, indices: list[int], width: int) -> dict[int, torch.Tensor]:
        out, tensor = {}, self._reader()
        for layer in self.layers:
            rows = []
            for i in indices:
                x = tensor(i, layer)
                rows.append(torch.nn.functional.pad(x, (0, 0, 0, width - x.shape[0])))
            out[layer] = torch.stack(rows)
        return out

    def get_packed(self, indices: list[int], places: list[tuple[int, int, int]],
                   shape: tuple[int, int]) -> dict[int, torch.Tensor]:
        """{layer: [R, W, D]} for a packed batch: sample indices[n] at row places[n][0] from column
        places[n][1] (`train.packing.pack_collate`), zeros elsewhere."""
        out, tensor = {}, self._reader()
        for layer in self.layers:
            rows = None
            for i, (r, start, n) in zip(indices, places, strict=True):
                x = tensor(i, layer)
                if rows is None:
                    rows = x.new_zeros(*shape, x.shape[-1])
                rows[r, start:start + n] = x
            out[layer] = rows
        return out

    @classmethod
    def build(cls, target, samples, layers: tuple[int, ...], root: str | Path, key: str, *, dtype: str,
              batch_size: int, pad_id: int, progress: bool = True, description: str = "features") -> FeatureCache:
        """Compute and write the cache at `<root>/<key>` unless a finished one is there; return it."""
        from tqdm.auto import tqdm

        folder = Path(root) / key
        if (folder / "meta.json").is_file():
            return cls(folder)
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=folder.parent))
        device = next(target.parameters()).device
        order = sorted(range(len(samples)), key=lambda i: len(samples[i].input_ids))
        shard_of = [0] * len(samples)
        try:
            pending, shard = {}, 0
            bar = tqdm(total=len(samples), disable=not progress, desc=description)
            for start in range(0, len(order), batch_size):
                chunk = order[start:start + batch_size]
                width = max(len(samples[i].input_ids) for i in chunk)
                ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
                attn = torch.zeros_like(ids)
                for b, i in enumerate(chunk):
                    n = len(samples[i].input_ids)
                    ids[b, :n], attn[b, :n] = torch.tensor(samples[i].input_ids), 1
                hidden = target_hidden_states(target, ids.to(device), attn.to(device), layers)
                for b, i in enumerate(chunk):
                    n = len(samples[i].input_ids)
                    for layer in layers:
                        pending[f"{i}.{layer}"] = hidden[layer][b, :n].to(DTYPES[dtype]).cpu().contiguous()
                    shard_of[i] = shard
                bar.update(len(chunk))
                if len(pending) >= SHARD_SAMPLES * len(layers) or start + batch_size >= len(order):
                    save_file(pending, str(tmp / f"shard-{shard:05d}.safetensors"))
                    pending, shard = {}, shard + 1
            bar.close()
            meta = {"layers": list(layers), "lengths": [len(s.input_ids) for s in samples], "shard_of": shard_of,
                    "dtype": dtype, "samples": len(samples)}
            (tmp / "meta.json").write_text(json.dumps(meta))
            try:
                os.rename(tmp, folder)
            except OSError:
                if not (folder / "meta.json").is_file():  # another process finishing first is fine
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return cls(folder)


class OnlineFeatures:
    """The same interface as FeatureCache, computing the layers with the frozen target for each batch."""

    def __init__(self, target, layers: tuple[int, ...]):
        self.target, self.layers = target, layers

    def batch(self, batch: dict[str, torch.Tensor]) -> dict[int, torch.Tensor]:
        attention = target_inputs(batch, next(self.target.parameters()).dtype)  # block-diagonal when packed
        return target_hidden_states(self.target, batch["input_ids"], layers=self.layers, **attention)


class OfflineFeatures:
    def __init__(self, cache: FeatureCache, device, dtype=torch.float32):
        self.cache, self.device, self.dtype = cache, device, dtype
        self.layers = cache.layers

    def batch(self, batch: dict[str, torch.Tensor]) -> dict[int, torch.Tensor]:
        if "places" in batch:  # packed: each sample's cached rows laid out where the batch holds it
            got = self.cache.get_packed(batch["index"].tolist(), batch["places"].tolist(),
                                        tuple(batch["input_ids"].shape))
        else:
            got = self.cache.get(batch["index"].tolist(), batch["input_ids"].shape[1])
        return {layer: x.to(self.device, self.dtype) for layer, x in got.items()}
