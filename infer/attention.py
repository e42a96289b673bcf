"""Tree attention masks: which cached slots and which nodes of a drafted tree each query may see, as the additive
4D masks transformers' attention layers take (passed through untouched, so no modeling code is patched).

- `attention_layout`: whether a model takes one mask for every layer or one per layer type (full and
  sliding-window attention), and each one's window;
- `tree_attention_mask`: the mask(s) of a block of tree nodes placed after a KV cache's slots
  (`infer.kv.KVState.mask` calls it with the cache's slot table);
- `additive_mask`: a boolean pattern as an additive float mask (the drafters' training masks use it too);
- `prompt_tree`: a left-padded prompt as one causal block of "tree" nodes.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig


def attention_layout(config: PretrainedConfig | None) -> tuple[str, dict[str, int | None]]:
    """How a model consumes masks: one tensor for all layers, or a dict keyed by `config.layer_types`.

    Returns ("tensor", {"all": window}) or ("by_layer_type", {layer_type: window}); window None = full.
    """
    if config is None:
        return "tensor", {"all": None}
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        kinds = set(layer_types)
        unknown = kinds - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(f"layer types {sorted(unknown)} of model_type {config.model_type!r} are not "
                             "supported by tree verification (only full and sliding-window attention)")
        if "sliding_attention" in kinds:
            return "by_layer_type", {"full_attention": None, "sliding_attention": window}
        return "tensor", {"all": None}
    return "tensor", {"all": window}


def tree_attention_mask(query_pos: torch.Tensor, attend: torch.Tensor, dtype: torch.dtype, *, key_pos: torch.Tensor,
                        start: int, windows: dict[str, int | None], layout: str,
                        buffers: dict[tuple, torch.Tensor] | None = None):
    """Additive 4D mask(s) for a block of N queries at positions `query_pos` [B, N], written at slots
    [start, start + N) of a KV cache, each query allowed to see the slots `attend` [B, N, start + N] allows (and
    always itself). `key_pos` [B, W] (W >= start + N) holds the position of every slot, the block's own overwritten
    here with `query_pos`; slots past `attend`'s width (a static cache's room after the block) are never seen.

    `layout` and `windows` are `attention_layout`'s: one mask for every layer ("tensor"), or a dict of masks keyed
    by layer type ("by_layer_type"), a sliding window keeping a query from slots `window` positions back or more.
    `buffers`: masks kept per (name, N) and written in place (a static cache's, so that captured forwards find
    them at the same addresses); None = new tensors."""
    b, n = query_pos.shape
    width = key_pos.shape[1]
    if attend.shape[2] < width:  # the slots after the block are never seen
        full = attend.new_zeros(b, n, width)
        full[:, :, :attend.shape[2]] = attend
        attend = full
    else:
        attend = attend.clone()
    key_pos = key_pos.clone()
    key_pos[:, start:start + n] = query_pos
    # A query always sees itself, so no softmax row is empty (padding queries included).
    slots = start + torch.arange(n, device=attend.device)
    attend[:, torch.arange(n, device=attend.device), slots] = True
    masks = {}
    for name, window in windows.items():
        allowed = attend
        if window is not None:
            allowed = allowed & (query_pos[:, :, None] - key_pos[:, None, :] < window)
        out = buffers.get((name, n)) if buffers is not None else None
        if out is None or out.dtype != dtype or out.shape[0] != b:
            out = torch.empty(b, 1, n, width, dtype=dtype, device=attend.device)
            if buffers is not None:
                buffers[(name, n)] = out
        masks[name] = additive_mask(allowed, dtype, out=out)
    return masks["all"] if layout == "tensor" else masks


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """A boolean attention pattern [B, Q, K] (True = may attend) as the additive [B, 1, Q, K] float mask
    attention layers take: 0 where allowed, the dtype's most negative value elsewhere. With `out`, written
    into that buffer."""
    if out is None:
        out = torch.empty(allowed.shape[0], 1, *allowed.shape[1:], dtype=dtype, device=allowed.device)
    out.zero_()
    return out.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)


def prompt_tree(attention_mask: torch.Tensor):
    """depth, ancestors and node validity that make a left-padded prompt one causal block."""
    # attention_mask: [B, P]
    valid = attention_mask.bool()
    p = valid.shape[1]
    depth = (valid.long().cumsum(1) - 1).clamp(min=0)
    causal = torch.ones(p, p, dtype=torch.bool, device=valid.device).tril()
    ancestors = causal[None] & valid[:, None, :]
    return depth, ancestors, valid
