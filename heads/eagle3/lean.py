"""The EAGLE-3 drafter's forward as plain tensor code, for drafting on CPU (`infer.cpu.lean_forward`'s layers).

`Eagle3Model.forward` runs transformers' decoder-layer modules, which on a 2-core CPU cost about as much as
the drafter's few matmuls (docs/benchmarks.md). `LeanEagle3` computes the same function from the model's own
tensors, read once when it is made (references, not copies): the fused-feature `fc`, the widened q/k/v layer
and any further layers through `infer.cpu.lean_forward.LeanLayers` (the streamed kernel for 2..stream_rows rows,
RMSNorm and rotary in it), then the draft `lm_head`; with `int8`, draft steps read int8 copies of those weights.
"""

from __future__ import annotations

import torch
from torch import nn

from infer.cpu import linear
from infer.cpu.lean_forward import (
    LeanLayers,
    Linears,
    Unsupported,
    check_cpu_fp32,
    norm_of,
    plain_linear,
    read_layer,
    reason_not_to_run,
)


def read(model) -> list:
    """The drafter's layers as `infer.cpu.lean_forward.Layer`s, or `Unsupported` saying why it cannot run lean."""
    check_cpu_fp32(model)
    config = model.config
    if config.input_mode != "widen":
        raise Unsupported(f"input_mode {config.input_mode!r} (widen only)")
    if config.layer_windows:
        raise Unsupported("sliding-window attention layers (full attention only)")
    if config.layer_config.get("hidden_act") != "silu":
        raise Unsupported(f"activation {config.layer_config.get('hidden_act')!r} (SiLU only)")
    embed = model._require_target("the lean drafter forward")["embed"]
    if type(embed) is not nn.Embedding or model.rotary_emb is None:
        raise Unsupported("a non-standard embedding, or no rotary embedding")
    if not plain_linear(model.fc) or not plain_linear(model.lm_head):
        raise Unsupported("adapted or quantized linear layers")
    return [read_layer(layer) for layer in model.layers]


def why_not(model) -> str | None:
    """Why `LeanEagle3` cannot run the drafter `model` (None: it can)."""
    return reason_not_to_run(read, model)


class LeanEagle3(LeanLayers):
    """Called as the drafter is: (input_ids [B, T], hidden_states [B, T, n*D] fused target features or
    [B, T, D] its own output, attention_mask, position_ids, past_key_values, ...) -> (hidden [B, T, D],
    logits over the draft vocabulary)."""

    def __init__(self, model, stream_rows: int, int8: linear.PackCache | None = None):
        """`int8`: draft from int8 copies of the weights (one scale a row, made once and kept in this cache): the
        LM head's scores the draft vocabulary, and those of `fc` and the layers run blocks of up to `COMPACT_ROWS`
        rows on the streamed kernel (every draft step; not the prompt, which oneDNN's fp32 GEMM runs faster). A
        quarter of the bytes (the shipped drafter's `fc` and layer: 20 MB in fp32, 5 MB), and drafts that may
        differ from the fp32 weights' at near-ties. Only the tree changes, never the output, and a top-k draft's sampling
        stays exact (its q is one-hot). Without the streamed kernel, the fp32 weights."""
        layers = self.read_or_refuse(read, model, "drafter")
        kernel = linear.streamed_kernel() if int8 is not None else None
        super().__init__(layers, stream_rows, None, None if kernel is None else [layer.int8_rows(int8) for layer in layers])
        self.model = model
        self.embed = model._require_target("the lean drafter forward")["embed"]
        self.fc, self.lm_head = Linears.of(model.fc), Linears.of(model.lm_head)
        self.fc_int8 = None if kernel is None else self.fc.int8_rows(int8)
        self.hidden_norm, self.final_norm = norm_of(model.hidden_norm), norm_of(model.norm)
        self.input_norm = norm_of(model.input_norm) if model.config.norm_before_fc else None
        self.head_rows = None if kernel is None else int8.derived(model.lm_head.weight, "int8 rows",
                                                                   linear.int8_rows)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @torch.no_grad()
    def __call__(self, input_ids, hidden_states, *, attention_mask, position_ids, past_key_values,
                 cache_position=None, fused: bool | None = None):
        # cache_position: the cache's layers place the block themselves
        h = hidden_states.to(self.dtype)
        if self.model._is_fused(h, fused):
            compact = self.fc_int8 is not None and h.shape[0] * h.shape[1] <= self.COMPACT_ROWS
            if self.input_norm is not None:
                h = self._norm(h, self.input_norm)
            h = self._linear(h, self.fc_int8 if compact else self.fc)
        rotary = self._rotary(self.model.rotary_emb, h, position_ids)
        normed = self._norm(h, self.hidden_norm)
        residual = normed if self.model.config.norm_before_residual else h
        y = torch.cat([self._norm(self.embed(input_ids), self.layers[0].input_norm), normed], dim=-1)
        norms = [layer.input_norm for layer in self.layers[1:]] + [self.final_norm]
        h = residual
        for i, (layer, next_norm) in enumerate(zip(self.layers, norms, strict=True)):
            h, y = self._layer(h, y, layer, i, past_key_values, attention_mask, rotary, next_norm)
        # y is the final norm of h: what speculators' norm_output feeds back
        return (y if self.model.config.norm_output else h), self._head(y)

    def _head(self, y: torch.Tensor) -> torch.Tensor:
        """y [B, T, D] -> logits over the draft vocabulary [B, T, V']."""
        if self.head_rows is None:
            return self._linear(y, self.lm_head)
        # head_rows are made only with int8 layers, which LeanLayers runs on the streamed kernel: self.kernel is set
        logits = self.kernel.int8_rows_linear(y.reshape(-1, y.shape[-1]), *self.head_rows)
        bias = self.lm_head.biases[0]
        if bias is not None:
            logits += bias
        return logits.view(*y.shape[:-1], logits.shape[-1])
