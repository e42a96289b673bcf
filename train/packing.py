"""Packed rows: several samples per row, so a micro-batch of mixed lengths is not padded to its longest.

A micro-batch's samples (the same ones `data.collate` would pad, one per row) are placed greedily, longest
first, into the first row with room for them (first-fit decreasing), rows holding at most `capacity` tokens
(max_length). Nothing crosses a sample's boundary:

- `position_ids` restart at 0 with every sample, as each sample's own row would number them;
- `segment_ids` number the samples of a row 1, 2, ... (0 on padding); the frozen target gets a 4D
  block-diagonal causal mask built from them (`heads.losses.target_inputs`), and every objective masks its
  attention and its shifted labels with them (`heads.losses.same_sample`, `unrolled_attention_mask`);
- `places` [N, 3] holds each sample's (row, first column, length), from which offline features are laid out
  and DFlash draws its anchors per sample.

Loss masks are the samples' own. Every objective averages its loss per predicted token over the whole batch,
so a packed batch gives the loss and gradients of the same samples one per row (tests/test_packing.py).

`python -m train.packing` measures trained tokens per second, packed against one sample per row, on a small
random Llama on CPU (docs/data.md, "Packed sequences").
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch


def first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Rows of positions into `lengths`: longest first, each into the first row it fits in."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(capacity - lengths[i])
    return rows


def pack_collate(samples: list, indices: list[int], pad_id: int, capacity: int) -> dict[str, torch.Tensor]:
    """A packed batch: input_ids, attention_mask, loss_mask, position_ids, segment_ids [R, W] (W the fullest
    row's tokens), the samples' indices [N] and `places` [N, 3] (row, start, length), both in the order given:
    sample n is the n-th row of the unpacked batch, which is how DFlash draws the same anchors in both."""
    lengths = [len(s.input_ids) for s in samples]
    if max(lengths) > capacity:
        raise ValueError(f"a sample of {max(lengths)} tokens does not fit a packed row of max_length={capacity} "
                         "tokens; samples are truncated to max_length, so tokenize them with the same max_length")
    rows = first_fit(lengths, capacity)
    width = max(sum(lengths[i] for i in row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    loss = torch.zeros_like(ids, dtype=torch.bool)
    pos, seg = torch.zeros_like(ids), torch.zeros_like(ids)
    places = [(0, 0, 0)] * len(samples)
    for r, row in enumerate(rows):
        col = 0
        for j, i in enumerate(row):
            n = lengths[i]
            ids[r, col:col + n] = torch.tensor(samples[i].input_ids)
            loss[r, col:col + n] = torch.tensor(samples[i].loss_mask, dtype=torch.bool)
            attn[r, col:col + n] = 1
            pos[r, col:col + n] = torch.arange(n)
            seg[r, col:col + n] = j + 1
            places[i] = (r, col, n)
            col += n
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss, "position_ids": pos, "segment_ids": seg,
            "index": torch.tensor(indices, dtype=torch.long), "places": torch.tensor(places, dtype=torch.long)}


def mixed_samples(count: int, shortest: int, longest: int, vocab: int, seed: int = 0) -> list:
    """Random samples of log-uniform lengths in [shortest, longest] (chat data's many short and few long
    conversations), the first quarter of each a prompt and the rest trained."""
    from train.data import Sample

    rng = random.Random(seed)
    out = []
    for i in range(count):
        n = round(shortest * (longest / shortest) ** rng.random())
        ids = [rng.randrange(3, vocab) for _ in range(n)]
        out.append(Sample(str(i), ids, [0] * (n // 4) + [1] * (n - n // 4)))
    return out


def throughput(drafter_kind: str, batch_size: int = 16, max_length: int = 1024, batches: int = 4,
               hidden_size: int = 256, layers: int = 4, seed: int = 0) -> dict:
    """Trained tokens (non-padding) per second of one training step (the frozen target's forward, the
    objective's forward and backward, an optimizer step), packed and one sample per row, on the same
    batches of mixed-length samples; a random Llama of `hidden_size` and `layers` on CPU."""
    import transformers

    import heads
    from train.config import load_config
    from train.data import collate
    from train.features import OnlineFeatures, needed_layers
    from train.objectives import build_objective

    torch.manual_seed(seed)
    target_config = transformers.LlamaConfig(vocab_size=2048, hidden_size=hidden_size,
                                             intermediate_size=4 * hidden_size, num_hidden_layers=layers,
                                             num_attention_heads=max(1, hidden_size // 64),
                                             max_position_embeddings=max_length)
    target = transformers.AutoModelForCausalLM.from_config(target_config, attn_implementation="sdpa").eval()
    config = load_config(None, {"target": "unused", "data": "unused", "drafter": drafter_kind, "ttt_steps": 2})
    drafter = heads.build(drafter_kind, target)
    objective = build_objective(drafter, config).train()
    optimizer = torch.optim.AdamW([p for p in objective.parameters() if p.requires_grad], lr=1e-4)
    features = OnlineFeatures(target, needed_layers(drafter, layers, soft=False))
    samples = mixed_samples(batch_size * batches, 32, max_length, target_config.vocab_size, seed)
    groups = [list(range(k, k + batch_size)) for k in range(0, len(samples), batch_size)]
    layouts = {"unpacked": lambda s, i: collate(s, i, 0), "packed": lambda s, i: pack_collate(s, i, 0, max_length)}
    totals = {name: [0, 0.0, 0] for name in layouts}  # tokens, seconds, cells
    # The layouts take turns batch by batch, so a change in the machine's load weighs on both alike; the
    # first batch runs once more first, untimed (allocator warm-up).
    for k, group in enumerate([groups[0], *groups]):
        for name, make in layouts.items():
            batch = make([samples[i] for i in group], group)
            tic = time.perf_counter()
            loss, _ = objective(batch, {i: x.float() for i, x in features.batch(batch).items()})
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if k:
                acc = totals[name]
                acc[0] += int(batch["attention_mask"].sum())
                acc[1] += time.perf_counter() - tic
                acc[2] += batch["input_ids"].numel()
    out = {name: {"tokens_per_second": round(t / s, 1), "padding": round(1 - t / c, 3)}
           for name, (t, s, c) in totals.items()}
    out["ratio"] = round(out["packed"]["tokens_per_second"] / out["unpacked"]["tokens_per_second"], 2)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Packed against unpacked training throughput on CPU.")
    parser.add_argument("--drafter", default="eagle3")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--max_length", type=int, default=1024)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(json.dumps(throughput(args.drafter, args.batch_size, args.max_length, args.batches, args.hidden_size,
                                args.layers), indent=1))


if __name__ == "__main__":
    main()
