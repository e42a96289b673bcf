"""A generate call's request, checked and resolved before the engine runs it: settings as transformers' generate
reads them (`resolve_settings`), inputs shaped and on the target's device (`check_inputs`), and what speculative
verification does not reproduce refused by name."""

from __future__ import annotations

import copy
import operator
import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch
from transformers import GenerationConfig

from .sampling import SamplingParams
from .target import max_positions

# The default of generate's eos_token_id and pad_token_id: not given, as distinct from given as None.
NOT_GIVEN = object()


@dataclass
class Settings:
    """One generate call's settings, resolved and checked (`resolve_settings`)."""

    sampling: SamplingParams
    max_new_tokens: int
    eos: set[int]
    pad: int
    typical: bool
    min_new_tokens: int = 0  # eos is impossible before this many new tokens (transformers' MinNewTokens...)
    suppress: list[int] = field(default_factory=list)  # never generated (suppress_tokens, one-token bad words)
    begin_suppress: list[int] = field(default_factory=list)  # not generated as the first new token
    _ids: dict = field(default_factory=dict)  # (which, device) -> those token ids as a tensor there, made once

    def ids(self, which: str, device: torch.device) -> torch.Tensor:
        """Token ids (`suppress`, `begin_suppress`, or `eos` in order) as an index on `device`, made once a call: a
        list used as an index is copied to the device at every use, and a copy to a GPU waits for its queue."""
        if (which, device) not in self._ids:
            values = sorted(self.eos) if which == "eos" else getattr(self, which)
            self._ids[which, device] = torch.tensor(values, dtype=torch.long, device=device)
        return self._ids[which, device]


def resolve_settings(target, typical_acceptance: bool, max_new_tokens, do_sample, temperature, top_k, top_p,
                     eos_token_id, pad_token_id, generation_config) -> Settings:
    """The call's settings as transformers' generate resolves them: the argument, the call's generation_config (and
    keywords), the target's own, transformers' default; each checked, and what we do not apply refused."""
    gc = generation_config
    base = target.generation_config
    if gc is not None:
        _refuse_unsupported(gc, "the call (generation_config or keywords)")
    _refuse_unsupported(base, "the target's own generation_config", warn_only=True)

    def pick(value, name):
        """A setting as transformers' generate resolves it: the argument, the call's generation_config (and
        keywords), the target's own, transformers' default."""
        for got in (value, getattr(gc, name, None), getattr(base, name, None)):
            if got is not None:
                return got
        return TRANSFORMERS_DEFAULTS.get(name)

    sample = pick(do_sample, "do_sample")
    if not isinstance(sample, (bool, np.bool_)):
        raise TypeError(f"do_sample must be True or False, got {sample!r}")
    sampling = SamplingParams(do_sample=bool(sample), temperature=_real(pick(temperature, "temperature"),
                                                                        "temperature"),
                              top_k=_int_like(pick(top_k, "top_k"), "top_k"),
                              top_p=_real(pick(top_p, "top_p"), "top_p"))
    max_new = pick(max_new_tokens, "max_new_tokens")
    if max_new is None:
        raise ValueError("pass max_new_tokens (or a generation_config that sets it)")
    max_new = _int_like(max_new, "max_new_tokens")
    if max_new <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new}")
    vocab = target.config.get_text_config().vocab_size
    # given as None, eos and pad are unset over the configs' (transformers sets the call's keywords last)
    eos = _token_ids(pick(None, "eos_token_id") if eos_token_id is NOT_GIVEN else eos_token_id, "eos_token_id",
                     vocab)
    pad = pick(None, "pad_token_id") if pad_token_id is NOT_GIVEN else pad_token_id
    pad = (eos[0] if eos else 0) if pad is None else _token_ids(pad, "pad_token_id", vocab, single=True)[0]
    min_new = _int_like(pick(None, "min_new_tokens") or 0, "min_new_tokens")
    if min_new < 0:
        raise ValueError(f"min_new_tokens must be >= 0, got {min_new}")
    suppress = _token_ids(pick(None, "suppress_tokens"), "suppress_tokens", vocab)
    bad = pick(None, "bad_words_ids") or []
    if not isinstance(bad, (list, tuple)) or not all(isinstance(words, (list, tuple)) for words in bad):
        raise TypeError(f"bad_words_ids must be a list of token-id lists, e.g. [[5], [9]], got {bad!r}")
    if any(len(words) != 1 for words in bad):
        raise ValueError("bad_words_ids with sequences of more than one token are not supported by "
                         "speculative decoding here; ban single tokens, or use target.generate")
    suppress += _token_ids([words[0] for words in bad], "bad_words_ids", vocab)
    begin = _token_ids(pick(None, "begin_suppress_tokens"), "begin_suppress_tokens", vocab)
    typical = typical_acceptance and sampling.do_sample  # greedy decoding stays greedy
    return Settings(sampling, max_new, set(eos), int(pad), typical, min_new, suppress, begin)


def check_generator(generator, device: torch.device) -> None:
    """A seeded call's generator: a torch.Generator on the target's device type (draws are made where the logits
    are; torch refuses a CPU generator for a CUDA tensor deep inside a step, so it is refused here, with the fix)."""
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if generator.device.type != torch.device(device).type:
        raise ValueError(f"generator is on {generator.device} and the target on {device}: sampling draws where the "
                         f"logits are, so pass torch.Generator(device={str(device)!r}).manual_seed(seed)")


def check_inputs(target, input_ids, attention_mask, streamer) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids as [B, T] on the target's device with a left-padded 0/1 attention mask, or an error naming the fault."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.long:
        raise TypeError("input_ids must be a LongTensor of token ids, shape [batch, prompt_len]")
    if input_ids.device.type == "meta":
        raise ValueError("input_ids are on the meta device, which holds no values; pass token ids on the "
                         "target's device (or the CPU)")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2 or input_ids.shape[1] == 0 or input_ids.shape[0] == 0:
        raise ValueError(f"input_ids must be [batch, prompt_len] with a non-empty prompt, got "
                         f"{tuple(input_ids.shape)}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a tensor of 0s and 1s shaped like input_ids, got "
                        f"{type(attention_mask).__name__}")
    if attention_mask.dim() == 1 and input_ids.shape[0] == 1:
        attention_mask = attention_mask[None]  # as input_ids of one prompt may be
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                         f"{tuple(input_ids.shape)}")
    if attention_mask.device.type == "meta":
        raise ValueError("attention_mask is on the meta device, which holds no values; pass a tensor of 0s and "
                         "1s on input_ids' device")
    attention_mask = attention_mask.to(input_ids.device)
    if ((attention_mask != 0) & (attention_mask != 1)).any():  # before .long(), which would truncate 0.5 to 0
        raise ValueError(f"attention_mask must hold only 0 (padding) and 1 (token), got values such as "
                         f"{attention_mask[(attention_mask != 0) & (attention_mask != 1)][0].item()}")
    attention_mask = attention_mask.long()
    lengths = attention_mask.sum(1)
    if (lengths == 0).any():
        raise ValueError("a prompt in the batch is empty (attention_mask all zero)")
    if not (attention_mask[:, -1] == 1).all() or (attention_mask.diff(dim=1) < 0).any():
        raise ValueError("prompts must be left-padded (attention_mask 0...0 1...1 per row); set "
                         "tokenizer.padding_side = 'left'")
    max_len = max_positions(target.config)
    if max_len and int(lengths.max()) >= max_len:
        raise ValueError(f"prompt of {int(lengths.max())} tokens leaves no room in the target's context "
                         f"of {max_len} positions")
    if streamer is not None and input_ids.shape[0] != 1:
        raise ValueError("streamer supports batch size 1 only")
    vocab = target.config.get_text_config().vocab_size
    if int(input_ids.max()) >= vocab or int(input_ids.min()) < 0:
        raise ValueError(f"input_ids hold ids outside the target's vocabulary [0, {vocab})")
    return input_ids.to(target.device), attention_mask.to(target.device)


# generation_config fields whose logits processors we do not apply; each changes what target.generate returns
_UNSUPPORTED = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "encoder_repetition_penalty": 1.0,
                "sequence_bias": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
                "exponential_decay_length_penalty": None, "min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0,
                "eta_cutoff": 0.0, "top_h": None, "guidance_scale": None, "num_beams": 1,
                "num_return_sequences": 1, "min_length": 0, "constraints": None, "force_words_ids": None,
                "stop_strings": None, "watermarking_config": None, "penalty_alpha": None, "dola_layers": None}


# generation_config fields asking for more than the token ids generate returns, or for a time limit it has not
_UNRETURNED = ("output_scores", "output_logits", "return_dict_in_generate", "output_attentions",
               "output_hidden_states", "max_time")
# Where neither the call nor the target's generation_config sets one: transformers' own defaults
# (`GenerationConfig._get_default_generation_params`, which a test compares), so sampling means what it does there.
TRANSFORMERS_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}


def with_keywords(generation_config, settings: dict) -> GenerationConfig | None:
    """The call's generation_config with generate's extra keywords over it, as transformers' generate takes them."""
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise TypeError(f"generation_config must be a GenerationConfig, got {type(generation_config).__name__}")
    if not settings:
        return generation_config
    # refused in our words before GenerationConfig.update validates them in its own (which, for
    # num_return_sequences, speaks of greedy search whatever do_sample the call passed)
    _refuse_unsupported(SimpleNamespace(**settings), "the call")
    merged = copy.deepcopy(generation_config) if generation_config is not None else GenerationConfig()
    unknown = merged.update(**settings)
    if unknown:
        raise TypeError(f"generate got {', '.join(sorted(unknown))}: neither an argument of SelfSpecModel.generate "
                        "nor a GenerationConfig field (logits processors, stopping criteria and model inputs "
                        "other than input_ids and attention_mask are not supported)")
    return merged


def _refuse_unsupported(gc: GenerationConfig, where: str, warn_only: bool = False) -> None:
    """Raise (or, for the target's own defaults, warn) for settings that would change target.generate's
    output and that speculative verification here does not reproduce, or ask for what generate does not return."""
    found = {k: getattr(gc, k, None) for k, neutral in _UNSUPPORTED.items()
             if getattr(gc, k, None) not in (None, neutral, [], {})}
    unreturned = {k: getattr(gc, k, None) for k in _UNRETURNED if getattr(gc, k, None) not in (None, False)}
    if not found and not unreturned:
        return
    if found:
        message = (f"{where} sets {found}; SelfSpecModel applies temperature, top_k, top_p, min_new_tokens, "
                   "suppress_tokens, begin_suppress_tokens and single-token bad_words_ids, not these, so its "
                   "output would differ from target.generate")
    else:
        message = (f"{where} sets {unreturned}; SelfSpecModel.generate returns the token ids only (no scores, "
                   "logits, attentions, hidden states or dict) and stops at max_new_tokens or eos, not on a clock")
    if warn_only:
        warnings.warn(message + "; they are ignored", stacklevel=4)
    else:
        raise ValueError(message + "; unset them or use target.generate")


def _int_like(value, name: str) -> int:
    """An int, numpy integer or one-element integer tensor, as generate takes them; floats and bools refused."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer, got a tensor of shape {tuple(value.shape)} and dtype "
                            f"{value.dtype}")
        return int(value.item())
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})") from None


def _real(value, name: str) -> float:
    """A real number as generate takes one (int, float, numpy number, one-element tensor); text and bools refused."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype != torch.bool:
        return float(value.item())
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    return float(value)


def _token_ids(value, name: str, vocab: int, single: bool = False) -> list[int]:
    """Token ids as generate takes them (int, numpy int, list, tensor), each checked against the vocabulary;
    order kept (the first eos pads, as in transformers)."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        value = value.flatten().tolist()
    elif isinstance(value, np.ndarray):
        value = value.reshape(-1).tolist()
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if single and len(items) != 1:
        raise ValueError(f"{name} must be one token id, got {value!r}")
    ids = [_int_like(v, name) for v in items]
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ValueError(f"{name} {bad} outside the target's vocabulary [0, {vocab})")
    return ids
