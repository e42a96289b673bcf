"""Grouped-query attention over a tree mask on CPU, without a copy of the KV cache per query head.

Given a mask (a verify step always passes its tree mask) and grouped K/V heads (GQA: SmolLM2-135M has 9
query heads over 3 K/V heads), transformers' `sdpa` attention repeats K and V once per query head before
calling torch's kernel, because CUDA's fused kernels do not take GQA together with a mask. On a CPU that is a
copy of the whole cache, per layer, per verify step (docs/benchmarks.md has its cost). torch's CPU kernel takes the grouped heads as they are
(`enable_gqa=True`), so during `SelfSpecModel.generate` an `sdpa` target on CPU runs `cpu_gqa_sdpa`,
registered with transformers' attention interfaces under `NAME`; every other case goes to transformers' own
`sdpa` function unchanged. The user's setting is restored after the call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "selfspec_cpu_sdpa"


def cpu_gqa_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    # query: [B, H, T, D]; key, value: [B, H_kv, S, D]; attention_mask: [B, 1, T, S]
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    if (not grouped or attention_mask is None or query.shape[2] == 1 or query.device.type != "cpu"
            or any(kwargs.get(k) is not None for k in ("position_bias", "softcap", "s_aux"))
            or kwargs.get("output_attentions")):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None  # [B, T, H, D]


AttentionInterface.register(NAME, cpu_gqa_sdpa)
AttentionMaskInterface.register(NAME, sdpa_mask)
