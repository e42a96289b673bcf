"""The target's (or a drafter's) KV cache with per-row bookkeeping, driven through the model's own forward.

We never patch modeling code. Every forward gets an explicit 4D additive attention mask, `position_ids`
and `cache_position`; transformers passes a 4D mask through untouched. That lets one cache hold rows
that accept different numbers of tokens per step: a row's rejected or unused slots stay in the tensor as
holes (`valid` False) that no later query attends to, and positions are counted over valid slots only.
With batch size 1 no hole ever appears.

The cache's keys and values live in buffers with room to spare (`RoomyLayer`): a step writes its block in
place and a commit gathers the kept path in place, where transformers' `DynamicCache` would copy the whole
cache with `torch.cat` on every forward of every layer (SmolLM2-135M at 300 tokens: 14 MB a forward,
3.5 ms of a 25 ms draft forward on this CPU).
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import Cache, DynamicLayer


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


class RoomyLayer(DynamicLayer):
    """A `DynamicLayer` whose `keys`/`values` are leading slices of larger buffers: `update` writes the new
    block after them in place and grows a buffer (by half, at least `GROW` slots) only when it is full.
    Anything that leaves `keys`/`values` a leading slice of the buffer (`crop`, `KVState.commit`) keeps the
    buffer; anything else (a row selection) is adopted into a new buffer on the next update."""

    GROW = 256

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self._room = {}
        self.keys = self._append("keys", self.keys, key_states)
        self.values = self._append("values", self.values, value_states)
        return self.keys, self.values

    def _append(self, name: str, held: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        # held: [B, H, S, D] (or empty), new: [B, H, N, D] -> a view [B, H, S + N, D] of the buffer
        size = held.shape[2] if held.dim() == 4 else 0
        end = size + new.shape[2]
        buf = self._room.get(name)
        prefix = (buf is not None and held.dim() == 4 and held.data_ptr() == buf.data_ptr()
                  and held.stride() == buf.stride() and held.shape[:2] == buf.shape[:2] and buf.shape[3] == new.shape[3])
        if not prefix or end > buf.shape[2]:
            room = max(end + self.GROW, end * 3 // 2)
            grown = new.new_empty(new.shape[0], new.shape[1], room, new.shape[3])
            if size:
                grown[:, :, :size] = held
            self._room[name] = buf = grown
        buf[:, :, size:end] = new
        return buf[:, :, :end]


class RoomyCache(DynamicCache):
    """A `DynamicCache` of `RoomyLayer`s, one per decoder layer, created as the model first writes them."""

    def __init__(self):
        Cache.__init__(self, layer_class_to_replicate=RoomyLayer)


class KVState:
    """A `DynamicCache` plus, for every slot, whether it holds a live token and at which position.

    Invariant: `length == valid.sum(1)`, the position id the next token of each row gets.
    """

    def __init__(self, batch_size: int, device: torch.device, config: PretrainedConfig | None = None,
                 roomy: bool = True):
        # roomy=False: transformers' own DynamicCache, which torch.compile traces (RoomyLayer's buffer checks
        # would break a compiled graph at every layer)
        self.cache = RoomyCache() if roomy else DynamicCache()
        self.layout, self.windows = attention_layout(config)
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)  # [B, S]
        self.pos = torch.zeros(batch_size, 0, dtype=torch.long, device=device)  # [B, S]
        self.length = torch.zeros(batch_size, dtype=torch.long, device=device)  # [B] live tokens = next position

    @property
    def size(self) -> int:
        return self.valid.shape[1]

    def mask(self, query_pos: torch.Tensor, attend: torch.Tensor, dtype: torch.dtype):
        """Additive 4D mask(s) for queries at `query_pos` [B, N] allowed to see `attend` [B, N, S + N]."""
        b, n = query_pos.shape
        key_pos = torch.cat([self.pos, query_pos], dim=1)  # [B, S + N]
        # A query always sees itself, so no softmax row is empty (padding queries included).
        self_slot = torch.zeros_like(attend)
        self_slot[:, torch.arange(n), self.size + torch.arange(n)] = True
        attend = attend | self_slot
        masks = {}
        for name, window in self.windows.items():
            allowed = attend
            if window is not None:
                allowed = allowed & (query_pos[:, :, None] - key_pos[:, None, :] < window)
            m = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
            m.masked_fill_(~allowed, torch.finfo(dtype).min)
            masks[name] = m[:, None]  # [B, 1, N, S + N]
        return masks["all"] if self.layout == "tensor" else masks

    def tree_inputs(self, depth: torch.Tensor, ancestors: torch.Tensor, node_valid: torch.Tensor,
                    dtype: torch.dtype):
        """position_ids [B, N], cache_position [N] and mask(s) for a block of tree nodes after the cache."""
        # depth: [B, N]; ancestors: [B, N, N]; node_valid: [B, N]
        b, n = depth.shape
        position_ids = self.length[:, None] + depth
        past = self.valid[:, None, :].expand(b, n, self.size)
        attend = torch.cat([past, ancestors & node_valid[:, None, :]], dim=2)
        cache_position = torch.arange(self.size, self.size + n, device=depth.device)
        return position_ids, cache_position, self.mask(position_ids, attend, dtype)

    def appended(self, position_ids: torch.Tensor, node_valid: torch.Tensor) -> None:
        """Record slots the model's forward just appended to the cache (not yet committed)."""
        self.valid = torch.cat([self.valid, torch.zeros_like(node_valid)], dim=1)
        self.pos = torch.cat([self.pos, position_ids], dim=1)

    def commit(self, start: int, slots: torch.Tensor, keep: torch.Tensor) -> None:
        """Keep slots `start + slots[b, j]` (where `keep[b, j]`) at `start + j`; drop everything after.

        slots, keep: [B, A]. The kept entries are gathered into place, never recomputed.
        """
        index = start + slots
        width = slots.shape[1]
        for layer in self.cache.layers:
            if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
                continue
            for name in ("keys", "values"):
                t = getattr(layer, name)  # [B, H, S, D]
                gathered = t.gather(2, index[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))
                t[:, :, start:start + width] = gathered
                setattr(layer, name, t[:, :, :start + width])
        self.pos = torch.cat([self.pos[:, :start], self.pos.gather(1, index)], dim=1)
        self.valid = torch.cat([self.valid[:, :start], keep], dim=1)
        self.length = self.valid.sum(1)

    def mark_valid(self, node_valid: torch.Tensor) -> None:
        """Provisionally treat the last block of slots as context (multi-step drafting); `commit` or
        `rollback` later decides what stays."""
        n = node_valid.shape[1]
        self.valid = torch.cat([self.valid[:, :self.size - n], node_valid], dim=1)
        self.length = self.valid.sum(1)

    def rollback(self, size: int) -> None:
        """Forget every slot from `size` on (uncommitted drafts)."""
        drop = self.size - size
        if drop > 0:
            for layer in self.cache.layers:
                layer.crop(-drop)
            self.valid = self.valid[:, :size]
            self.pos = self.pos[:, :size]
            self.length = self.valid.sum(1)

    def select_rows(self, rows: torch.Tensor) -> None:
        for layer in self.cache.layers:
            layer.batch_select_indices(rows)
        self.valid, self.pos, self.length = self.valid[rows], self.pos[rows], self.length[rows]


def prompt_tree(attention_mask: torch.Tensor):
    """depth, ancestors and node validity that make a left-padded prompt one causal block."""
    # attention_mask: [B, P]
    valid = attention_mask.bool()
    p = valid.shape[1]
    depth = (valid.long().cumsum(1) - 1).clamp(min=0)
    causal = torch.ones(p, p, dtype=torch.bool, device=valid.device).tril()
    ancestors = causal[None] & valid[:, None, :]
    return depth, ancestors, valid


def forward_block(model, kv: KVState, depth, ancestors, node_valid, *, input_ids=None, inputs_embeds=None,
                  **kwargs):
    """Run `model` on a block of nodes placed after the cache; the new slots stay uncommitted."""
    dtype = model.dtype if inputs_embeds is None else inputs_embeds.dtype
    position_ids, cache_position, mask = kv.tree_inputs(depth, ancestors, node_valid, dtype)
    kwargs[cache_argument(model)] = kv.cache
    out = model(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=mask,
                position_ids=position_ids, cache_position=cache_position, use_cache=True, **kwargs)
    kv.appended(position_ids, node_valid)
    return out


_CACHE_ARGUMENT: dict[type, str] = {}


def cache_argument(model) -> str:
    """The keyword a transformers model's forward takes its KV cache by: `cache` from transformers 5.24
    (where `past_key_values` is deprecated), `past_key_values` before and in classes not yet renamed."""
    cls = type(getattr(model, "_orig_mod", model))  # a torch.compile'd model: the class it wraps
    if cls not in _CACHE_ARGUMENT:
        params = inspect.signature(getattr(cls, "forward", cls.__call__)).parameters
        _CACHE_ARGUMENT[cls] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_ARGUMENT[cls]
