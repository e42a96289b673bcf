"""The target's forward over a verify block, as plain tensor code: Llama-layout targets, fp32 or bf16, CPU.

A verify step runs the target over a handful of tree nodes. On a small CPU streaming the weights takes most of
it, and transformers' forward spends half as much again around them: ~1,500 small ops over SmolLM2-135M's 30
layers, each dispatched through `nn.Module.__call__`, kwarg-deprecation wrappers and the attention interface.
Greedy decoding pays that too, once per token; a verify step pays it once per step, and it was what made a verify
over a few drafted nodes cost more than a greedy step (docs/benchmarks.md).

`LeanForward(target)` computes the same function with fewer, larger ops, reading the user's modules'
weights as they are (nothing is set on them; it holds references to their tensors, read once when it is made, so
the engine makes one per generate call; the copies derived from them live in the engine's `linear.PackCache`):
- q/k/v and gate/up each in ONE pass of the streamed kernel (`few_rows_linear_cat`), which writes the
  projections side by side without a concatenated copy of the weights; o/down/lm_head alone;
- RMSNorm in the kernel (one call instead of seven ops);
- rotary from the model's own rotary module (its scaling included), applied to q and k in place in the
  q/k/v projection's output by the kernel (`rope_`), one call per layer instead of seven ops;
- attention on the grouped K/V heads as they are, under the tree mask the engine built: torch's SDPA, or for
  the few rows of a verify block the kernel's own loop (`few_rows_attention`, faster than SDPA at those rows);
- K/V written into the engine's cache, as the model's attention writes them;
- after that write, the rest of the layer (attention, o, the MLP, both residual adds and the next layer's
  input norm) is one call into the kernel (`attention_tail`), which runs ATen's ops there without a Python
  dispatch for each (docs/benchmarks.md);
- where the cache is the engine's growing one (`infer.kv.RoomyCache`), the whole layer is one kernel call
  (`decoder_layer`: q/k/v, rotary, K and V copied straight into the cache layer's buffers, then the tail), in
  place of transformers' cache update, a dozen small ops from Python a layer;
- where a target's weights lie exactly on GGUF grids (dequantized from a GGUF file: the embedded SmolLM2's layers
  from Q4_1, its tied LM head from Q8_0), blocks of up to 16 rows read them as 4-bit or int8 groups
  (`linear.exact_groups`, found once and kept in the engine's `linear.PackCache`): the kernel rebuilds each
  weight to its fp32 bits in registers, so the forward computes the same bits from a fifth (a quarter) of the bytes
  (SmolLM2's tied LM head, where the full logits are read: 113 MB -> 31 MB);
- where the caller reads only each node's argmax (the engine's greedy verify), the LM head's logits come from
  `infer.cpu.argmax_head.ArgmaxHead` (`argmax_head`): exact for the tokens that could be the argmax, -inf for the
  rest, from a quarter of the head's bytes.
Without the compiled kernel (no compiler) every op falls back to torch. Blocks of one row or of more rows
than the streamed kernel is measured to win at go to `F.linear` / oneDNN's packed GEMM.

A bf16 target runs the same layers as transformers' modules compute them in bf16, op for op and rounding for
rounding, with its linears of 1..stream_rows rows on the streamed kernel as the engine runs them under the modules
(`linear.prepacked_linears`): the same bits without the modules' Python around each op (`LeanLayers`). What it
gains is the greedy verify's head: the int8 copy of a bf16 head is half its bytes (`ArgmaxHead`; on a Llama-3.2-1B
shape, a tenth of a step's reading), which the modules' forward cannot use.

The same forward runs the `int8` and `int4` self-drafters' copies of the target (`LeanForward(draft, 0, None,
quantized=True)`, their linears `linear.Int8Linear` or `Int4Linear`): the kernel reads their quantized weights
at every block size, as nothing else here runs them, in well under half the time of transformers' modules
(docs/benchmarks.md).

Which targets: decoder layers of the classes in `LAYERS` with the Llama layout (Qwen3's q/k norms too, there
without the kernel's fused layer calls; a SiLU gated MLP, biases or not, no tensor-parallel split, full attention
or one sliding window that the mask already carries). `why_not(target)` says why another target is left to transformers; the engine then runs the
model's own forward as before. Module hooks outside transformers' own output capture also make it stand
aside (`user_hooks`): a hook on the user's model must see every forward.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from ..kv import RoomyCache, RoomyLayer
from . import linear
from .argmax_head import ArgmaxHead

LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks")


@dataclass
class LeanOutput:
    logits: torch.Tensor  # [B, N, V]
    hidden_states: tuple[torch.Tensor, ...] | None  # as transformers': embeddings, then every layer's output


@dataclass(frozen=True)
class Linears:
    """Weights (and biases) that share an input and write side by side: q/k/v, gate/up, or one alone. Each weight
    is an `nn.Linear`'s fp32 one, or the quantized one of a `linear.Int8Linear` or `linear.Int4Linear`
    with its scales (and offsets)."""

    weights: tuple[torch.Tensor, ...]
    biases: tuple[torch.Tensor | None, ...]
    scales: tuple[torch.Tensor | None, ...]  # a quantized weight's fp32 scales (a row's or a group's), else None
    lows: tuple[torch.Tensor | None, ...]  # a 4-bit weight's fp32 offsets (a group's), else None
    streamable: bool  # every weight contiguous: the streamed kernel can read it as it is

    @classmethod
    def of(cls, *linears: nn.Module) -> Linears:
        quantized = [type(m) in QUANTIZED for m in linears]
        weights = tuple(m.q if q else m.weight for m, q in zip(linears, quantized, strict=True))
        scales = tuple(m.scale if q else None for m, q in zip(linears, quantized, strict=True))
        lows = tuple(getattr(m, "low", None) for m in linears)
        return cls(weights, tuple(m.bias for m in linears), scales, lows, all(w.is_contiguous() for w in weights))

    @functools.cached_property  # read for every layer of every forward
    def quantized(self) -> bool:
        """Some weight is int8 or 4-bit: only the streamed kernel runs it."""
        return any(s is not None for s in self.scales)

    def native(self, kernel):
        """These weights as the kernel's `Linears`, which `decoder_layer` and `attention_tail` take."""
        return kernel.Linears(list(self.weights), list(self.biases), list(self.scales), list(self.lows))

    def on_grid(self, packed: linear.PackCache) -> Linears | None:
        """These fp32 weights as the 4-bit or int8 groups each lies on exactly (`linear.exact_groups`, found once
        per weight and kept in `packed`), or None where one does not."""
        if self.quantized:
            return None
        groups = [packed.derived(w, "exact groups", linear.exact_groups) for w in self.weights]
        if any(g is None for g in groups):
            return None
        q, scales, lows = zip(*groups, strict=True)
        return Linears(q, self.biases, scales, lows, True)

    def int8_rows(self, packed: linear.PackCache) -> Linears:
        """These fp32 weights as int8 rows with one scale each (`linear.int8_rows`, made once per weight and
        kept in `packed`): a quarter of the bytes, products near the fp32 ones, not the same bits. For a drafter,
        whose drafts the verify checks, never for the target."""
        q, scales = zip(*(packed.derived(w, "int8 rows", linear.int8_rows) for w in self.weights), strict=True)
        return Linears(q, self.biases, scales, (None,) * len(q), True)


@dataclass(frozen=True)
class Layer:
    """What one decoder layer's forward reads: the user's tensors themselves, no copies."""

    input_norm: tuple[torch.Tensor, float]  # (weight, eps)
    qkv: Linears
    o: Linears
    post_norm: tuple[torch.Tensor, float]
    gate_up: Linears
    down: Linears
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    qk_norms: tuple[tuple[torch.Tensor, float], tuple[torch.Tensor, float]] | None = None  # Qwen3's, over each head

    LINEARS = ("qkv", "o", "gate_up", "down")  # in the order the kernel's one-layer calls take them

    @functools.cached_property  # read for every layer of every forward
    def linears(self) -> tuple[Linears, ...]:
        return tuple(getattr(self, name) for name in self.LINEARS)

    def on_grid(self, packed: linear.PackCache) -> Layer | None:
        """This layer with every linear on its exact grid (`Linears.on_grid`), or None where one is not."""
        grid = [m.on_grid(packed) for m in self.linears]
        return None if None in grid else replace(self, **dict(zip(self.LINEARS, grid, strict=True)))

    def int8_rows(self, packed: linear.PackCache) -> Layer:
        """This layer with every linear as int8 rows (`Linears.int8_rows`): a drafter's, never the target's."""
        return replace(self, **{name: getattr(self, name).int8_rows(packed) for name in self.LINEARS})


class Unsupported(ValueError):
    """A model a lean forward cannot run; the message says why."""


def norm_of(norm: nn.Module) -> tuple[torch.Tensor, float]:
    return norm.weight, float(getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", 1e-6))


def plain_linear(module: nn.Module) -> bool:
    return type(module) is nn.Linear and linear._plain(module.weight)


QUANTIZED = (linear.Int8Linear, linear.Int4Linear)


def readable_linear(module: nn.Module, quantized: bool) -> bool:
    """An fp32 `nn.Linear`, or where `quantized`, a `linear.Int8Linear` or `linear.Int4Linear` (and
    nothing else)."""
    return type(module) in QUANTIZED if quantized else plain_linear(module)


def read_layer(layer: nn.Module, quantized: bool = False) -> Layer:
    """One Llama-layout decoder layer (its q/k/v may take a wider input: EAGLE-3's), or `Unsupported`.
    `quantized`: its linears are all `linear.Int8Linear` or `Int4Linear` (the `int8` and `int4`
    self-drafters'), else all fp32 `nn.Linear`."""
    if type(layer).__name__ not in LAYERS:
        raise Unsupported(f"decoder layer {type(layer).__name__} (supported: {', '.join(LAYERS)})")
    attn, mlp = layer.self_attn, layer.mlp
    q, k, v, o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
    gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    if not all(readable_linear(m, quantized) for m in (q, k, v, o, gate, up, down)):
        raise Unsupported("linear layers other than int8 or 4-bit ones" if quantized
                          else "adapted or quantized linear layers")
    qk_norms = None
    if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
        if type(attn.q_norm).__name__ != "Qwen3RMSNorm" or type(attn.k_norm) is not type(attn.q_norm):
            raise Unsupported("q/k norms other than Qwen3's RMSNorms")
        qk_norms = (norm_of(attn.q_norm), norm_of(attn.k_norm))
    head_dim = attn.head_dim
    return Layer(norm_of(layer.input_layernorm), Linears.of(q, k, v), Linears.of(o),
                  norm_of(layer.post_attention_layernorm), Linears.of(gate, up), Linears.of(down),
                  q.out_features // head_dim, k.out_features // head_dim, head_dim, float(attn.scaling), qk_norms)


def check_cpu_fp32(model: nn.Module) -> None:
    params = next(model.parameters(), None)
    if params is None or params.device.type != "cpu" or params.dtype != torch.float32:
        raise Unsupported("not an fp32 model on CPU")


def check_cpu_target_dtype(model: nn.Module) -> None:
    """An fp32 model on CPU, or a bf16 one whose every parameter is bf16 (`LeanLayers` computes it as transformers'
    modules do in bf16)."""
    params = next(model.parameters(), None)
    if params is not None and params.device.type == "cpu" and params.dtype == torch.bfloat16:
        if any(p.dtype != torch.bfloat16 for p in model.parameters()):
            raise Unsupported("a bf16 model with parameters of other dtypes")
        return
    check_cpu_fp32(model)


def _read(target, quantized: bool = False) -> list[Layer]:
    """The target's layers as `Layer`s, or `Unsupported` saying why `LeanForward` cannot run it. `quantized`: its
    linears, the LM head's too, are `linear.Int8Linear` or `Int4Linear`, which only the streamed kernel runs."""
    check_cpu_fp32(target) if quantized else check_cpu_target_dtype(target)
    if quantized and linear.streamed_kernel() is None:
        raise Unsupported("quantized linear layers without the streamed kernel, which could not be built here")
    inner = getattr(target, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not all(hasattr(inner, a) for a in ("embed_tokens", "norm", "rotary_emb")):
        raise Unsupported(f"{type(target).__name__} does not have the Llama module layout")
    config = target.config
    if getattr(config, "pretraining_tp", 1) != 1:
        raise Unsupported("pretraining_tp > 1")
    if getattr(config, "hidden_act", None) != "silu":
        raise Unsupported(f"activation {getattr(config, 'hidden_act', None)!r} (SiLU only)")
    if set(getattr(config, "layer_types", None) or ["full_attention"]) - {"full_attention"}:
        raise Unsupported("layers of several attention types")
    if not readable_linear(target.get_output_embeddings(), quantized):
        raise Unsupported("an LM head other than an int8 or 4-bit one" if quantized
                          else "a non-standard embedding or lm_head")
    if getattr(inner, "embed_scale", None) is not None:
        raise Unsupported("a non-standard embedding or lm_head")
    return [read_layer(layer, quantized) for layer in layers]


def reason_not_to_run(read, model) -> str | None:
    """What `read(model)` raises as `Unsupported`, as text; None when it reads the model."""
    try:
        read(model)
    except Unsupported as reason:
        return str(reason)
    return None


def why_not(target) -> str | None:
    """Why `LeanForward` cannot run `target` (None: it can)."""
    return reason_not_to_run(_read, target)


def user_hooks(target) -> bool:
    """Whether any module of `target` has a forward hook that is not transformers' own output capture."""
    from torch.nn.modules import module as torch_module

    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return True
    for m in target.modules():
        for name in _HOOK_DICTS:
            for hook in getattr(m, name, {}).values():
                if not getattr(hook, "__module__", "").startswith("transformers."):
                    return True
    return False


class LeanLayers:
    """What both lean forwards share: RMSNorm, linears on the kernel or torch, and a Llama-layout layer.
    `stream_rows`: blocks of 2..stream_rows rows run on the streamed kernel; `packed`: a
    `linear.PackCache` for larger blocks (None: `F.linear`). Int8 weights run on the kernel at any size.
    `compact`: per layer, the same layer with its weights in fewer bytes, or None; blocks of up to `COMPACT_ROWS`
    rows read those instead. The target's are its weights on their exact grids (`Layer.on_grid`): the same bits
    from a fifth (4-bit) or a quarter (int8) of the bytes. A drafter's may be int8 rows (`Layer.int8_rows`): a
    quarter of the bytes and products near the fp32 ones, as its drafts need not be exact.

    A bf16 model's layers run as transformers' modules run them in bf16, op for op and with the same roundings (its
    RMSNorm in fp32 and the result rounded, rotary, attention, the MLP and the residual adds in bf16), its linears of
    1..stream_rows rows on the streamed kernel (bf16 products summed in fp32, rounded to bf16 once, as
    `linear.patch_linears` runs them under the modules): what it saves is the modules' Python around the ops. The
    kernel's fused one-layer calls, its norm and its rotary are fp32's only."""

    COMPACT_ROWS = linear.Int4Linear.KERNEL_ROWS

    def __init__(self, layers: list, stream_rows: int, packed: linear.PackCache | None,
                 compact: list[Layer | None] | None = None, one_row: bool = False):
        self.layers, self.stream_rows, self.packed, self.one_row = layers, stream_rows, packed, one_row
        self.compact = compact or [None] * len(layers)
        quantized = any(m.quantized for layer in layers + [c for c in self.compact if c is not None]
                        for m in layer.linears)
        self.bf16 = bool(layers) and layers[0].qkv.weights[0].dtype == torch.bfloat16
        self.kernel = (linear.streamed_kernel() if stream_rows > 1 or quantized or one_row or (self.bf16 and stream_rows)
                       else None)
        # the kernel's norm, rotary and one-layer calls, which have no q/k norms
        self.fused = self.kernel is not None and not self.bf16 and not any(layer.qk_norms for layer in layers)
        # each layer's (q/k/v, o, gate/up, down) as the kernel's one-layer calls take them, made once here
        natives = lambda layer: tuple(m.native(self.kernel) for m in layer.linears)  # noqa: E731
        self.native = [natives(layer) for layer in layers] if self.fused else []
        self.compact_native = [None if c is None or not self.fused else natives(c) for c in self.compact]

    @classmethod
    def read_or_refuse(cls, read, model, what: str) -> list:
        """`read(model)`'s layers, or Unsupported naming this class and `what` it cannot run."""
        try:
            return read(model)
        except Unsupported as reason:
            raise Unsupported(f"{cls.__name__} cannot run this {what}: {reason}") from None

    def _rotary(self, rotary: nn.Module, x: torch.Tensor, position_ids: torch.Tensor):
        """The rotary tables for a block, shaped for `_layer`: [B*N, D] for the kernel, [B, 1, N, D] else."""
        cos, sin = rotary(x, position_ids)  # [B, N, D]
        if self.fused:
            return cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1])
        return cos[:, None], sin[:, None]

    def _layer(self, x: torch.Tensor, y: torch.Tensor, layer: Layer, index: int, cache, attention_mask,
               rotary, next_norm: tuple[torch.Tensor, float]):
        """x + attention(y) + MLP, as a Llama decoder layer computes it: x [B, N, D] is the residual stream,
        y [B, N, K] the normed input of q/k/v (the layer's input norm of x, for a target layer). Returns the
        new x and `next_norm` of it (the next layer's input norm, or the final norm)."""
        b, n, _ = x.shape
        h, kvh, hd = layer.heads, layer.kv_heads, layer.head_dim
        cos, sin = rotary
        native = self.native[index] if self.native else None
        if self.compact[index] is not None and b * n <= self.COMPACT_ROWS:
            layer, native = self.compact[index], self.compact_native[index]
        if self.fused and attention_mask is not None and isinstance(cache, RoomyCache):
            stream = self._streamed(b * n, *layer.linears)
            if stream or b * n == 1:
                return self._whole_layer(x, y, layer, native, cache.layer(index), attention_mask, rotary,
                                         next_norm, stream)
        qkv = self._linear(y, layer.qkv)  # [B, N, (H + 2 KVH) D]
        if self.fused:  # rotate q and k in place, in the projection's own layout
            self.kernel.rope_(qkv.view(b * n, -1), cos, sin, h + kvh)
            heads = qkv.view(b, n, h + 2 * kvh, hd).transpose(1, 2)
            keys, values = cache.update(heads[:, h:h + kvh], heads[:, h + kvh:], index)
            stream = self._streamed(b * n, layer.o, layer.gate_up, layer.down)
            if attention_mask is not None and (stream or b * n == 1):
                return self._tail(x, qkv, keys, values, attention_mask, layer, native, next_norm, stream)
            q = heads[:, :h]
        else:
            heads = qkv.view(b, n, h + 2 * kvh, hd)
            if layer.qk_norms is not None:  # each q and k head normed before the rotary, as Qwen3's attention does
                q_norm, k_norm = layer.qk_norms
                normed = (self._norm(heads[:, :, :h], q_norm), self._norm(heads[:, :, h:h + kvh], k_norm))
                heads = torch.cat((*normed, heads[:, :, h + kvh:]), dim=2)
            heads = heads.transpose(1, 2)
            qk = heads[:, :h + kvh]  # [B, H + KVH, N, D]: rotate q and k together
            qk = qk * cos + torch.cat((-qk[..., hd // 2:], qk[..., :hd // 2]), dim=-1) * sin
            q = qk[:, :h]
            keys, values = cache.update(qk[:, h:], heads[:, h + kvh:], index)
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=attention_mask, scale=layer.scaling,
                                           enable_gqa=kvh != h)
        x = x + self._linear(o.transpose(1, 2).reshape(b, n, h * hd), layer.o)
        gate, up = self._linear(self._norm(x, layer.post_norm), layer.gate_up).chunk(2, -1)
        x = x + self._linear(F.silu(gate) * up, layer.down)
        return x, self._norm(x, next_norm)

    def _whole_layer(self, x, y, layer: Layer, native: tuple, kv: RoomyLayer, attention_mask, rotary, next_norm,
                     stream: bool):
        """`_layer` in one kernel call (`decoder_layer`): q/k/v, rotary, the K/V write straight into the cache
        layer's buffers, and `_tail`. What it saves is Python: the cache update alone is a dozen small ops a layer."""
        b, n, _ = x.shape
        key_buffer, value_buffer, size = kv.reserve(x, b, layer.kv_heads, n, layer.head_dim)
        qkv, o, gate_up, down = native
        x, y, kv.keys, kv.values = self.kernel.decoder_layer(
            x, y, qkv, *rotary, key_buffer, value_buffer, size, attention_mask, layer.heads, layer.scaling, o,
            *layer.post_norm, gate_up, down, *next_norm, stream)
        return x, y

    def _tail(self, x, qkv, keys, values, attention_mask, layer: Layer, native: tuple, next_norm, stream: bool):
        """The rest of `_layer` after the K/V write (attention, o, MLP, both residual adds, `next_norm`) in
        one kernel call: ATen's own ops there, without a Python dispatch for each of them."""
        _, o, gate_up, down = native
        return self.kernel.attention_tail(x, qkv.view(x.shape[0] * x.shape[1], -1), keys, values, attention_mask,
                                          layer.heads, layer.scaling, o, *layer.post_norm, gate_up, down, *next_norm,
                                          stream)

    def _streamed(self, rows: int, *linears: Linears) -> bool:
        """Whether a block of `rows` rows goes through the streamed kernel for every one of `linears` (quantized
        ones always do: nothing else here runs them)."""
        if self.kernel is None:
            return False
        fewest = 1 if self.bf16 else 2  # one fp32 row: `one_row`, else ATen's GEMV
        fits = fewest <= rows <= self.stream_rows or (rows == 1 and self.one_row)
        return all(m.quantized for m in linears) or (fits and all(m.streamable for m in linears))

    def _norm(self, x: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
        weight, eps = norm
        if self.fused:
            return self.kernel.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)
        h = x.float()  # in fp32, then rounded to the input's dtype before the weight, as transformers' RMSNorm
        return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def _linear(self, x: torch.Tensor, linears: Linears) -> torch.Tensor:
        """x [B, N, K] through `linears` side by side: [B, N, sum of their out_features]."""
        rows = x.shape[0] * x.shape[1]
        flat = x.reshape(rows, x.shape[-1])
        if self._streamed(rows, linears):
            biases = [None if b is None else b.float() for b in linears.biases] if self.bf16 else linears.biases
            y = self.kernel.few_rows_linear_cat(flat, linears.weights, biases, linears.scales, linears.lows)
            if self.bf16:
                y = y.to(torch.bfloat16)  # fp32 sums rounded once, as a bf16 matmul rounds them
        else:
            if rows > 1 and self.packed is not None and linear.available() and not self.bf16:
                parts = [torch.ops.mkldnn._linear_pointwise(flat, self.packed.get(w), bias, "none", [], "")
                         for w, bias in zip(linears.weights, linears.biases, strict=True)]
            else:
                parts = [F.linear(flat, w, bias) for w, bias in zip(linears.weights, linears.biases, strict=True)]
            y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return y.view(x.shape[0], x.shape[1], y.shape[-1])


class LeanForward(LeanLayers):
    """Called like the target on a verify block (the keywords `infer.kv.KVState.forward` passes):
    input_ids [B, N], a 4D additive attention_mask [B, 1, N, S], position_ids [B, N] and the KV `cache`;
    returns `LeanOutput`. `stream_rows`: blocks of 2..stream_rows rows run on the streamed kernel;
    `packed`: the engine's `linear.PackCache` for larger blocks.

    The layers' tensors are read from the modules once, when it is made (a per-layer list of references,
    not copies): make a new one when the model may have changed, as the engine does at every call."""

    def __init__(self, target, stream_rows: int, packed: linear.PackCache | None, argmax_only: bool = False,
                 quantized: bool = False, one_row: bool = False):
        """`argmax_only`: the caller reads nothing but each node's argmax (the engine's greedy verify), so the
        logits come from `infer.cpu.argmax_head.ArgmaxHead` (an int8 copy of the LM head, kept in `packed`), exact
        where a token could be the argmax and -inf elsewhere (fp32; a bf16 head's logits as their bf16 values). It
        needs the kernel; without one the model's own head runs. `quantized`: the model's linears, its LM head's too, are `linear.Int8Linear` or `Int4Linear` (the
        `int8` and `int4` self-drafters' copies of the target), run on the kernel at any block size.

        An fp32 target whose weights lie exactly on GGUF grids (dequantized from Q4_1 or Q8_0, as the embedded
        SmolLM2's are) runs blocks of up to `COMPACT_ROWS` rows on those (`Layer.on_grid`, found once per weight
        and kept in `packed`): the same bits as from its fp32 weights, a fifth of the bytes to stream. Its LM head
        too where the caller reads the full logits (sampling; not `argmax_only`)."""
        if quantized and argmax_only:
            raise ValueError("argmax_only reads an int8 copy of an fp32 LM head; a quantized model's head is one "
                             "already")
        layers = self.read_or_refuse(lambda m: _read(m, quantized), target,
                                     "quantized model" if quantized else "target")
        grid = None
        fp32 = target.dtype == torch.float32
        if packed is not None and not quantized and fp32 and linear.streamed_kernel() is not None:
            grid = [layer.on_grid(packed) for layer in layers]
        super().__init__(layers, stream_rows, packed, grid, one_row)
        self.target = target
        inner = target.model
        self.embed, self.rotary, self.final_norm = inner.embed_tokens, inner.rotary_emb, norm_of(inner.norm)
        self.lm_head = Linears.of(target.get_output_embeddings())
        self.argmax_head: ArgmaxHead | None = None
        self.lm_head_grid: Linears | None = None  # where the full logits are read, for blocks of up to COMPACT_ROWS
        if argmax_only and linear.streamed_kernel() is not None:
            self.argmax_head = packed.derived(self.lm_head.weights[0], "argmax", ArgmaxHead)
        elif grid is not None and self.kernel is not None:
            self.lm_head_grid = self.lm_head.on_grid(packed)

    @property
    def dtype(self) -> torch.dtype:
        return self.target.dtype

    @torch.no_grad()
    def __call__(self, input_ids=None, *, attention_mask, position_ids, cache, inputs_embeds=None,
                 output_hidden_states: bool = False, logits_to_keep: int = 0, use_cache: bool = True,
                 cache_position=None):
        # use_cache: the block's K/V always go into `cache`; cache_position: the cache's layers place them
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        rotary = self._rotary(self.rotary, x, position_ids)
        hidden = [x] if output_hidden_states else None
        norms = [layer.input_norm for layer in self.layers[1:]] + [self.final_norm]
        y = self._norm(x, self.layers[0].input_norm)
        for i, (layer, next_norm) in enumerate(zip(self.layers, norms, strict=True)):
            x, y = self._layer(x, y, layer, i, cache, attention_mask, rotary, next_norm)
            if hidden is not None:
                hidden.append(x)
        x = y  # the final norm of the last layer's output
        if hidden is not None:
            hidden[-1] = x  # transformers' last hidden state is the normed one
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        if self.argmax_head is not None:
            logits = self.argmax_head.logits(x.reshape(-1, x.shape[-1]), self.lm_head.biases[0])
            logits = logits.view(*x.shape[:-1], logits.shape[-1])
        else:
            on_grid = self.lm_head_grid is not None and x.shape[0] * x.shape[1] <= self.COMPACT_ROWS
            logits = self._linear(x, self.lm_head_grid if on_grid else self.lm_head)
        return LeanOutput(logits=logits, hidden_states=tuple(hidden) if hidden is not None else None)
