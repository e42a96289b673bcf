"""Drafting with the target's own weights in torch: a low-precision copy, or its first layers.

- `bf16`: a bfloat16 copy of the whole target. Decoding reads every weight once per token, so half the
  bytes is up to half the time where the matrix-vector products dominate.
- `int8`: linear weights int8 per output channel, weight-only (activations are not quantized: quantizing
  them too drops agreement, see docs/benchmarks.md). On CPU: `infer.cpu.linear.Int8Linear` (fp32 blocks of
  up to 16 rows on the streamed kernel's int8 rows, others on torch's int8 kernel with bf16 activations),
  the target's norms and embedding shared, not copied (torchao's CPU int8 path is slower than fp32 on
  AVX2), and for a Llama-layout target the whole forward lean (`infer.cpu.lean_forward.LeanForward` over the
  int8 rows: one kernel call a layer, fp32 activations at any block size); elsewhere a copy quantized by
  torchao.
- `int4`: the target's own norms and embedding (shared, not copied) with every decoder-layer linear held
  as 4-bit integers in groups of 32 inputs with a scale and an offset each (`infer.cpu.linear.Int4Linear`, GGUF's
  Q4_1) and the LM head as int8 in groups of 32 (GGUF's Q8_0), run lean on the kernel with fp32 activations.
  A target dequantized from such a GGUF, as the embedded SmolLM2 is, is held again exactly, so the drafts are
  the target's own tokens but for float rounding (SmolLM2, 1,168 teacher-forced MT-bench tokens: 100%
  agreement); from other weights, 4 bits are the copy's rounding. The LM head stays in 8 bits because it is the
  one weight whose rounding moves the argmax most (SmolLM2: 91.7% agreement with an int4 head, 98.0% with
  int8 rows). CPU only: about a fifth of fp32's bytes per layer weight, a quarter for the head.
- `early_exit:<k>`: the target's first k decoder layers, its final norm and LM head (LayerSkip, Elhoushi
  et al. 2024; transformers' `assistant_early_exit`). No weights are copied: the shallow model is built
  on the meta device and takes the target's own tensors.

Each drafts a chain with its own KV cache through `DraftModelDrafter`, with adaptive length. The
target is never modified: copies are new modules, and the shallow model shares tensors, not modules.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..cpu.linear import GROUP, Int4Linear, Int8Linear, groups_fit
from .draft_model import DraftModelDrafter

MAX_TOKENS = 12


def _copy_of(target) -> nn.Module:
    draft = copy.deepcopy(target)
    draft.eval().requires_grad_(False)
    return draft


def _check_finite(target, name: str) -> None:
    """A low-precision copy of weights holding NaN or inf drafts from NaN probabilities: refuse the target by name."""
    for param_name, param in target.named_parameters():
        if param.is_floating_point() and not bool(torch.isfinite(param).all()):
            raise ValueError(f"the target's weight {param_name} holds NaN or infinite values, so the '{name}' "
                             "drafter (a low-precision copy of the target) cannot draft from it, and the target's "
                             "own outputs are not meaningful either; reload the target from intact weights")


def bf16(arg, target, tokenizer=None) -> DraftModelDrafter:
    if arg:
        raise ValueError(f"'bf16' takes no argument, got {arg!r}")
    _check_finite(target, "bf16")
    return DraftModelDrafter(_copy_of(target).to(torch.bfloat16), num_tokens=MAX_TOKENS, adaptive=True,
                             prompt_kv_from_target=True)


def int8(arg, target, tokenizer=None) -> DraftModelDrafter:
    if arg:
        raise ValueError(f"'int8' takes no argument, got {arg!r}")
    _check_finite(target, "int8")
    if _device(target).type == "cpu":  # Int8Linear: torchao's CPU path is slower than fp32 here
        return DraftModelDrafter(_low_bit(target, lambda w, b, head: Int8Linear(w, b)), num_tokens=MAX_TOKENS,
                                 adaptive=True, lean_quantized=True, prompt_kv_from_target=True)
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError as err:
        raise ImportError("the 'int8' drafter quantizes with torchao off the CPU, which is not installed; "
                          "install it with: pip install torchao") from err
    draft = _copy_of(target)
    quantize_(draft, Int8WeightOnlyConfig())
    return DraftModelDrafter(draft, num_tokens=MAX_TOKENS, adaptive=True, prompt_kv_from_target=True)


def int4(arg, target, tokenizer=None) -> DraftModelDrafter:
    if arg:
        raise ValueError(f"'int4' takes no argument, got {arg!r}")
    _check_finite(target, "int4")
    if _device(target).type != "cpu":
        raise ValueError(f"'int4' runs selfspec's CPU kernel, but the target is on {_device(target)}; use "
                         "'int8', 'bf16' or 'gguf' there")

    def layer(weight, bias, head):
        if head:  # 4 bits move the argmax most: 8 bits in groups, GGUF's Q8_0, where the shape allows
            return Int8Linear(weight, bias, group=groups_fit(weight))
        return Int4Linear(weight, bias) if groups_fit(weight) else Int8Linear(weight, bias)

    draft = _low_bit(target, layer)
    if not any(isinstance(m, Int4Linear) for m in draft.modules()):
        raise ValueError(f"no linear layer of {type(target).__name__} takes inputs in groups of {GROUP} (in_features "
                         f"divisible by {GROUP}); use 'int8'")
    return DraftModelDrafter(draft, num_tokens=MAX_TOKENS, adaptive=True, lean_quantized=True,
                             prompt_kv_from_target=True)


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _low_bit(target, make) -> nn.Module:
    """The target's own modules and tensors (shared, not copied) with every linear layer replaced by
    `make(weight [out, in], bias, is_lm_head)`; the target's modules are not touched."""
    draft = shallow_model(target, list(range(_layer_count(target))))
    head = draft.get_output_embeddings()
    for module in list(draft.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                weight = child.weight
            elif type(child) is Conv1D:  # GPT-2's linear layers keep their weight as [in, out]
                weight = child.weight.t()
            else:
                continue
            setattr(module, name, make(weight, child.bias, child is head))
    return draft


def early_exit(arg, target, tokenizer=None) -> DraftModelDrafter:
    layers = _layer_count(target)
    try:
        k = int(arg)
    except (TypeError, ValueError):
        raise ValueError(f"write early_exit:<layers>, e.g. early_exit:{max(1, layers // 2)} for the first half "
                         f"of the target's {layers} layers; got {arg!r}") from None
    if not 1 <= k < layers:
        raise ValueError(f"early_exit:{k} must keep between 1 and {layers - 1} of the target's {layers} layers")
    return DraftModelDrafter(shallow_model(target, list(range(k))), num_tokens=MAX_TOKENS, adaptive=True,
                             prompt_kv_from_target=True)  # the target's first k layers: the same K/V exactly


def _layer_count(target) -> int:
    return len(_decoder_layers(target)[1])


def _decoder_layers(model) -> tuple[str, nn.ModuleList]:
    """(qualified name, module list) of the model's decoder layers."""
    want = model.config.get_text_config().num_hidden_layers
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == want]
    if len(found) != 1:
        raise ValueError(f"cannot tell which module list of {type(model).__name__} holds its {want} decoder "
                         f"layers (found {len(found)} candidates); layer skipping needs one")
    return found[0]


def shallow_model(target, keep: list[int]) -> nn.Module:
    """A model of the target's class running only decoder layers `keep` (in order), sharing its tensors."""
    config = copy.deepcopy(target.config)
    text = config.get_text_config()
    text.num_hidden_layers = len(keep)
    if getattr(text, "layer_types", None):
        text.layer_types = [text.layer_types[i] for i in keep]
    prefix, _ = _decoder_layers(target)
    rename = {f"{prefix}.{old}.": f"{prefix}.{new}." for new, old in enumerate(keep)}

    def theirs(name: str) -> str | None:
        if not name.startswith(prefix + "."):
            return name
        head = name[:len(prefix) + 1 + name[len(prefix) + 1:].index(".") + 1]
        back = {v: k for k, v in rename.items()}
        return back[head] + name[len(head):] if head in back else None

    with torch.device("meta"):
        shallow = type(target)._from_config(config, attn_implementation=target.config._attn_implementation)
    tensors = dict(target.named_parameters(remove_duplicate=False))
    tensors.update(dict(target.named_buffers(remove_duplicate=False)))
    for name, _ in list(shallow.named_parameters(remove_duplicate=False)) + list(
            shallow.named_buffers(remove_duplicate=False)):
        source = theirs(name)
        if source not in tensors:
            raise ValueError(f"cannot map {name} of the shallow model to a tensor of the target")
        owner, _, leaf = name.rpartition(".")
        module = shallow.get_submodule(owner) if owner else shallow
        if leaf in module._parameters:
            module._parameters[leaf] = tensors[source]
        else:
            module._buffers[leaf] = tensors[source]
    shallow.generation_config = copy.deepcopy(target.generation_config)
    return shallow.eval()  # no requires_grad_ here: the parameters are the target's own
