"""The target's (or a drafter's) KV cache with per-row bookkeeping, driven through the model's own forward.

We never patch modeling code. Every forward gets an explicit 4D additive attention mask (infer/attention.py),
`position_ids` and `cache_position`; transformers passes a 4D mask through untouched. That lets one cache hold rows
that accept different numbers of tokens per step: a row's rejected or unused slots stay in the tensor as
holes (`valid` False) that no later query attends to, and positions are counted over valid slots only.
With batch size 1 no hole ever appears.

The cache's keys and values live in buffers with room to spare (`RoomyLayer`): a step writes its block in
place and a commit gathers the kept path in place, where transformers' `DynamicCache` would copy the whole
cache with `torch.cat` on every forward of every layer (SmolLM2-135M at 300 tokens: 14 MB a forward,
3.5 ms of a 25 ms draft forward on this CPU).
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import Cache, DynamicLayer, StaticLayer

from .attention import attention_layout, tree_attention_mask

# With a static cache, verify blocks are padded to the next of these node counts, so the verify forward sees
# a handful of shapes (one compiled graph each); larger blocks are padded to a multiple of the last.
VERIFY_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
# Slots a static cache holds beyond prompt + max_new_tokens: the uncommitted block of the step in flight.
VERIFY_ROOM = VERIFY_BUCKETS[-1]


def verify_bucket(nodes: int) -> int:
    """The padded node count of a verify block of `nodes` nodes."""
    for size in VERIFY_BUCKETS:
        if nodes <= size:
            return size
    return -(-nodes // VERIFY_BUCKETS[-1]) * VERIFY_BUCKETS[-1]


class RoomyLayer(DynamicLayer):
    """A `DynamicLayer` whose `keys`/`values` are leading slices of larger buffers: `update` writes the new
    block after them in place and grows a buffer (by half, at least `GROW` slots) only when it is full.
    Anything that leaves `keys`/`values` a leading slice of the buffer (`crop`, `KVState.commit`) keeps the
    buffer; anything else (a row selection) is adopted into a new buffer on the next update.

    `reserve` hands the buffers out to a caller that writes the block itself (the lean verify forward's
    kernel, `infer.cpu.lean_forward`) and then sets `keys`/`values` to their leading slices."""

    GROW = 256

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        b, h, n, d = key_states.shape
        key_buffer, value_buffer, size = self.reserve(key_states, b, h, n, d)
        key_buffer[:, :, size:size + n] = key_states
        value_buffer[:, :, size:size + n] = value_states
        self.keys, self.values = key_buffer[:, :, :size + n], value_buffer[:, :, :size + n]
        return self.keys, self.values

    def reserve(self, like: torch.Tensor, batch: int, heads: int, n: int, head_dim: int):
        """Key and value buffers [batch, heads, room, head_dim] (`like`'s dtype and device) whose leading slots
        are the ones in use, with room for `n` more after them, and how many are in use (`size`). The caller
        writes the block at slots [size, size + n) and sets `keys`/`values` to the buffers' first size + n."""
        if not self.is_initialized:
            self.lazy_initialization(like, like)
            self._room = {}
        size = self.keys.shape[2] if self.keys.dim() == 4 else 0
        shape = (batch, heads, size + n, head_dim)
        return self._buffer("keys", self.keys, shape), self._buffer("values", self.values, shape), size

    def _buffer(self, name: str, held: torch.Tensor, shape: tuple[int, int, int, int]) -> torch.Tensor:
        """`name`'s buffer, holding `held` [B, H, S, D] (or an empty tensor) as its leading slots, with room for
        `shape`[2] slots in all: the one kept, or a new one (by half again, at least GROW slots more) when it is
        full or `held` is no longer its leading slice."""
        batch, heads, end, head_dim = shape
        size = held.shape[2] if held.dim() == 4 else 0
        buf = self._room.get(name)
        prefix = (buf is not None and held.dim() == 4 and held.data_ptr() == buf.data_ptr()
                  and held.stride() == buf.stride() and held.shape[:2] == buf.shape[:2] and buf.shape[3] == head_dim)
        if not prefix or end > buf.shape[2]:
            room = max(end + self.GROW, end * 3 // 2)
            buf = held.new_empty(batch, heads, room, head_dim)
            if size:
                buf[:, :, :size] = held
            self._room[name] = buf
        return buf


class RoomyCache(DynamicCache):
    """A `DynamicCache` of `RoomyLayer`s, one per decoder layer, created as the model first writes them."""

    def __init__(self):
        Cache.__init__(self, layer_class_to_replicate=RoomyLayer)

    def layer(self, index: int) -> RoomyLayer:
        """Layer `index`, created (with any before it) if the model has not written it yet, as `update` does."""
        while len(self.layers) <= index:
            self.layers.append(RoomyLayer())
        return self.layers[index]


class KVState:
    """A KV cache plus, for every slot, whether it holds a live token and at which position.

    Two kinds of cache behind one interface:

    - growing (default): `RoomyCache`, buffers with room to spare that grow when full; the model sees the
      `size + N` slots in use, so every forward has its own shape;
    - static (`capacity=`): one buffer of `capacity` slots per layer, allocated once (transformers'
      `StaticLayer`, written at its own counter, which is kept at `size`), and masks of the full capacity,
      so a forward's shapes depend on its block size only and can be compiled and captured.

    In both, a step writes its block in place after the committed slots, `commit` gathers the kept path into
    place, and the slot tables (`valid`, `pos`) are preallocated buffers with a length: no `torch.cat` and no
    allocation per step (the growing cache allocates when it runs out of room).

    Invariant: `length == valid.sum(1)`, the position id the next token of each row gets.
    """

    def __init__(self, batch_size: int, device: torch.device, config: PretrainedConfig | None = None,
                 roomy: bool = True, capacity: int | None = None):
        # roomy=False: transformers' own DynamicCache, which torch.compile traces with shapes dynamic over the
        # cache length (RoomyLayer's buffer checks would break a compiled graph at every layer)
        if capacity is not None and capacity < 1:
            raise ValueError(f"a static KV cache needs capacity >= 1 slot, got {capacity}")
        self.capacity = capacity
        if capacity is not None:
            self.cache = Cache(layer_class_to_replicate=functools.partial(StaticLayer, max_cache_len=capacity))
        else:
            self.cache = RoomyCache() if roomy else DynamicCache()
        self.layout, self.windows = attention_layout(config)
        room = capacity if capacity is not None else RoomyLayer.GROW
        self._valid = torch.zeros(batch_size, room, dtype=torch.bool, device=device)
        self._pos = torch.zeros(batch_size, room, dtype=torch.long, device=device)
        self._size = 0
        self.length = torch.zeros(batch_size, dtype=torch.long, device=device)  # [B] live tokens = next position
        self._masks: dict[tuple, torch.Tensor] = {}  # (name, block size) -> preallocated static mask
        self._counters: torch.Tensor | None = None  # [L] every static layer's write counter, one tensor
        self._unified: torch.Tensor | None = None  # [2L, B, H, capacity, D] every static layer's keys and values

    @property
    def size(self) -> int:
        """Slots written so far, committed or not (the next block goes after them)."""
        return self._size

    @property
    def valid(self) -> torch.Tensor:  # [B, size]
        return self._valid[:, :self._size]

    @property
    def pos(self) -> torch.Tensor:  # [B, size]
        return self._pos[:, :self._size]

    @property
    def static(self) -> bool:
        return self.capacity is not None

    @property
    def batch_size(self) -> int:
        return self._valid.shape[0]

    def reset(self) -> None:
        """Empty the cache for a new generation, keeping its buffers (a static cache's addresses, and so
        its compiled and captured graphs, stay valid)."""
        if not self.static:
            raise RuntimeError("only a static KV cache is reset for reuse; make a new KVState")
        self._size = 0
        self._valid.zero_()
        self.length = torch.zeros_like(self.length)
        self._sync_layers()

    def room(self) -> int:
        """Slots a static cache has left after those written (None-like large for a growing one)."""
        return self.capacity - self._size if self.static else 1 << 62

    def _reserve(self, n: int) -> None:
        """Make the slot tables hold `size + n` slots; a static cache that cannot is an error."""
        end = self._size + n
        if end <= self._valid.shape[1]:
            return
        if self.static:
            raise RuntimeError(f"a block of {n} slots does not fit the static KV cache: {self._size} of "
                               f"{self.capacity} slots are in use; give SelfSpecModel a larger static_cache")
        room = max(end + RoomyLayer.GROW, end * 3 // 2)
        grown_valid = self._valid.new_zeros(self._valid.shape[0], room)
        grown_pos = self._pos.new_zeros(self._pos.shape[0], room)
        grown_valid[:, :self._size], grown_pos[:, :self._size] = self.valid, self.pos
        self._valid, self._pos = grown_valid, grown_pos

    def grow(self, capacity: int) -> None:
        """Give a static cache `capacity` slots, keeping what it holds (new buffers: compiled graphs of the
        old shape recompile)."""
        if not self.static or capacity <= self.capacity:
            return
        for layer in self.cache.layers:
            if getattr(layer, "is_initialized", False):
                for name in ("keys", "values"):
                    old = getattr(layer, name)
                    new = old.new_zeros(*old.shape[:2], capacity, old.shape[3])
                    new[:, :, :self._size] = old[:, :, :self._size]
                    setattr(layer, name, new)
            layer.max_cache_len = capacity
        for name in ("_valid", "_pos"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[0], capacity)
            new[:, :self._size] = old[:, :self._size]
            setattr(self, name, new)
        self.capacity = capacity
        self._masks.clear()

    def _sync_layers(self) -> None:
        """Point every static layer's write counter at `size` (forwards advance it; commits move it back): one op
        once the layers are adopted (`_adopt_layers`), on a GPU one launch rather than one a layer."""
        if not self.static:
            return
        if self._counters is not None and self._adopted():
            self._counters.fill_(self._size)
            return
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(self._size)

    def _adopted(self) -> bool:
        layers = self.cache.layers
        return bool(layers) and self._counters is not None \
            and layers[0].cumulative_length.data_ptr() == self._counters.data_ptr()

    def _adopt_layers(self) -> None:
        """Once the model has made its static layers (at its first forward), make their write counters views of one
        tensor and their keys and values views of one buffer (`_unify`): a commit then moves the kept slots of every
        layer in one gather and sets every counter in one op, and the addresses stay put for captured forwards."""
        layers = self.cache.layers
        if not layers or not all(getattr(layer, "is_initialized", False) for layer in layers):
            return
        if not self._adopted():
            self._counters = torch.stack([layer.cumulative_length for layer in layers])
            for i, layer in enumerate(layers):
                layer.cumulative_length = self._counters[i]
        if not self._is_unified(layers):
            self._unify(layers)

    def _is_unified(self, layers) -> bool:
        return self._unified is not None and layers[0].keys.data_ptr() == self._unified.data_ptr()

    def _unify(self, layers) -> None:
        """Move every static layer's keys and values into one buffer (where their shapes and dtypes agree), so a
        commit moves the kept slots of all layers in one gather; the layers hold views of it, at addresses that
        stay put from then on. Done once the layers exist (the model makes them at its first forward)."""
        shapes = {(t.shape, t.dtype) for layer in layers for t in (layer.keys, layer.values)}
        if len(shapes) != 1:  # heads or head sizes differ between layers: each commits its own
            self._unified = None
            return
        self._unified = torch.stack([t for layer in layers for t in (layer.keys, layer.values)])
        for i, layer in enumerate(layers):
            layer.keys, layer.values = self._unified[2 * i], self._unified[2 * i + 1]

    def mask(self, query_pos: torch.Tensor, attend: torch.Tensor, dtype: torch.dtype):
        """Additive 4D mask(s) for queries at `query_pos` [B, N] allowed to see `attend` [B, N, size + N], placed
        after the cache's slots (`infer.attention.tree_attention_mask`).

        A static cache's masks span its whole capacity (the slots after the block are never seen) and are
        written into buffers kept per block size."""
        n = query_pos.shape[1]
        self._reserve(n)
        width = self.capacity if self.static else self._size + n
        return tree_attention_mask(query_pos, attend, dtype, key_pos=self._pos[:, :width], start=self._size,
                                   windows=self.windows, layout=self.layout,
                                   buffers=self._masks if self.static else None)

    def forward(self, model, position_ids: torch.Tensor, attend: torch.Tensor, node_valid: torch.Tensor, *args,
                dtype: torch.dtype | None = None, **inputs):
        """One step of a cache transaction: `model` on a block of N nodes placed after the cache, at
        `position_ids` [B, N], each seeing the slots `attend` [B, N, size + N] allows (and itself). The block's
        slots are written but not committed: `commit`/`commit_block` keep them, `rollback` drops them,
        `mark_valid` lets the next block see them meanwhile. Works for transformers models and our drafters
        (positional `args` go first); `dtype` is the mask's, the model's by default."""
        n = position_ids.shape[1]
        mask = self.mask(position_ids, attend, dtype or model.dtype)
        inputs[cache_argument(model)] = self.cache
        out = model(*args, attention_mask=mask, position_ids=position_ids,
                    cache_position=torch.arange(self._size, self._size + n, device=position_ids.device), **inputs)
        self.appended(position_ids, node_valid)
        return out

    def forward_tree(self, model, depth: torch.Tensor, ancestors: torch.Tensor, node_valid: torch.Tensor, *args,
                     dtype: torch.dtype | None = None, **inputs):
        """`forward` for a block of tree nodes: node i at `length + depth[b, i]`, seeing every committed
        slot and its valid ancestors in the block (ancestors [B, N, N], node_valid [B, N])."""
        b, n = depth.shape
        attend = torch.zeros(b, n, self._size + n, dtype=torch.bool, device=depth.device)
        attend[:, :, :self._size] = self.valid[:, None, :]
        attend[:, :, self._size:] = ancestors & node_valid[:, None, :]
        return self.forward(model, self.length[:, None] + depth, attend, node_valid, *args, dtype=dtype, **inputs)

    def commit_block(self, start: int, valid: torch.Tensor) -> None:
        """Keep the valid slots of the block written at `start` (a prompt or catch-up block), in order."""
        self.commit(start, torch.arange(valid.shape[1], device=valid.device).expand_as(valid), valid, in_place=True)

    def appended(self, position_ids: torch.Tensor, node_valid: torch.Tensor) -> None:
        """Record slots the model's forward just appended to the cache (not yet committed)."""
        n = node_valid.shape[1]
        self._reserve(n)
        self._valid[:, self._size:self._size + n] = False
        self._pos[:, self._size:self._size + n] = position_ids
        self._size += n
        if self.static:
            self._adopt_layers()

    def commit(self, start: int, slots: torch.Tensor, keep: torch.Tensor, in_place: bool | None = None) -> None:
        """Keep slots `start + slots[b, j]` (where `keep[b, j]`) at `start + j`; drop everything after.

        slots, keep: [B, A]. The kept entries are gathered into place, never recomputed. `in_place`: whether
        every kept slot is already where it goes (slots[b, j] == j wherever keep[b, j]), as a caller that read
        the slots on the host knows; None = looked up here (a host read).
        """
        index = start + slots
        width = slots.shape[1]
        # The kept slots often are the block's first ones already (the root, then its first child, ...):
        # nothing to move then, only the rest to drop.
        if in_place is None:
            in_place = bool((slots == torch.arange(width, device=slots.device)).all())
        layers = self.cache.layers
        if self.static and layers and self._is_unified(layers):  # one gather for all layers
            if not in_place:
                t = self._unified  # [2L, B, H, capacity, D]
                moved = index[None, :, None, :, None].expand(t.shape[0], -1, t.shape[2], -1, t.shape[4])
                t[:, :, :, start:start + width] = t.gather(3, moved)
            layers = ()
        for layer in layers:
            if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
                continue
            for name in ("keys", "values"):
                t = getattr(layer, name)  # [B, H, S, D]
                if not in_place:
                    t[:, :, start:start + width] = t.gather(2, index[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))
                if not self.static:  # a static layer keeps its whole buffer; its counter says what is in use
                    setattr(layer, name, t[:, :, :start + width])
        if not in_place:
            self._pos[:, start:start + width] = self._pos.gather(1, index)
        self._valid[:, start:start + width] = keep
        self._size = start + width
        self.length = self.valid.sum(1)
        self._sync_layers()

    def mark_valid(self, node_valid: torch.Tensor) -> None:
        """Provisionally treat the last block of slots as context (multi-step drafting); `commit` or
        `rollback` later decides what stays."""
        n = node_valid.shape[1]
        self._valid[:, self._size - n:self._size] = node_valid
        self.length = self.valid.sum(1)

    def rollback(self, size: int) -> None:
        """Forget every slot from `size` on (uncommitted drafts, or what a failed forward half wrote)."""
        drop = self._size - size
        if drop > 0:
            if not self.static:
                for layer in self.cache.layers:
                    layer.crop(-drop)
            self._size = size
            self.length = self.valid.sum(1)
        self._sync_layers()

    def select_rows(self, rows: torch.Tensor) -> None:
        for layer in self.cache.layers:
            if self.static:
                if getattr(layer, "is_initialized", False):
                    layer.keys, layer.values = layer.keys[rows], layer.values[rows]
            else:
                layer.batch_select_indices(rows)
        self._valid, self._pos, self.length = self._valid[rows], self._pos[rows], self.length[rows]
        self._masks.clear()


def forward_block(model, kv: KVState, depth, ancestors, node_valid, *, input_ids=None, inputs_embeds=None,
                  **kwargs):
    """A transformers model on a block of tree nodes after the cache (`KVState.forward_tree`); the new slots
    stay uncommitted."""
    dtype = None if inputs_embeds is None else inputs_embeds.dtype
    return kv.forward_tree(model, depth, ancestors, node_valid, dtype=dtype, input_ids=input_ids,
                           inputs_embeds=inputs_embeds, use_cache=True, **kwargs)


_CACHE_ARGUMENT: dict[type, str] = {}


def cache_argument(model) -> str:
    """The keyword a transformers model's forward takes its KV cache by: `cache` from transformers 5.24
    (where `past_key_values` is deprecated), `past_key_values` before and in classes not yet renamed."""
    cls = type(getattr(model, "_orig_mod", model))  # a torch.compile'd model: the class it wraps
    if cls not in _CACHE_ARGUMENT:
        params = inspect.signature(getattr(cls, "forward", cls.__call__)).parameters
        _CACHE_ARGUMENT[cls] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_ARGUMENT[cls]
