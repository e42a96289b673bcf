"""The target during a generate call: eval mode and an attention that takes a tree mask, and afterwards the target
as the user left it. Shared by the engine and by what times it (`infer.tuning`)."""

from __future__ import annotations

import contextlib
import threading
import warnings

from . import cpu

MASKABLE_ATTENTION = ("sdpa", "eager")
HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
              "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs")

# A target shared by several SelfSpecModels (one per thread) is set up for generation by the first call in and
# restored by the last one out: a call restoring it while another runs would pull the ground from under it.
_modes_lock = threading.Lock()
_modes: dict[int, list] = {}  # id(target) -> [calls under way, the target's state before the first]


def max_positions(config) -> int | None:
    """The target's context length in positions, where its config gives one."""
    text = config.get_text_config()
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(text, name, None)
        if value:
            return int(value)
    return None


def check_maskable(target) -> None:
    """A target whose attention cannot take a 4D tree mask runs with sdpa during generate (and gets its own
    implementation back afterwards); refuse one that cannot switch."""
    with _modes_lock:  # a call under way on the target holds a maskable attention: nothing is switched then
        impl = target.config._attn_implementation
        if impl in MASKABLE_ATTENTION:
            return
        try:
            target.set_attn_implementation("sdpa")
        except (ValueError, ImportError) as err:
            raise ValueError(f"target uses attention {impl!r}, which cannot take a tree mask, and cannot switch "
                             "to sdpa; load it with attn_implementation='eager'") from err
        finally:
            _set_attention(target, impl)
    warnings.warn(f"attention implementation {impl!r} cannot take a 4D tree mask; the target runs with "
                  "'sdpa' during generate and gets its own back afterwards", stacklevel=5)


def _set_attention(target, impl: str) -> None:
    try:
        target.set_attn_implementation(impl)
    except (ValueError, ImportError):  # the user's own setting, even one this machine cannot load
        target.config._attn_implementation = impl


@contextlib.contextmanager
def generation_mode(target):
    """Eval mode and a maskable attention for the call (on CPU, sdpa as `infer.cpu.gqa_attention` runs it for
    grouped K/V heads). Afterwards the target is as it was: the user's train/eval flags and attention, and
    no attribute or hook left on its modules (transformers installs hidden-state capture hooks on first use,
    which would make the model unpicklable). Calls on one target from several threads share the set-up."""
    with _modes_lock:
        entry = _modes.get(id(target))
        if entry is None:
            entry = _modes[id(target)] = [0, _set_up(target)]
        entry[0] += 1
    try:
        yield
    finally:
        with _modes_lock:
            entry[0] -= 1
            if entry[0] == 0:
                del _modes[id(target)]
                _restore(target, *entry[1])


def _set_up(target) -> tuple[dict, str, bool]:
    """Put the target in generation mode; returns what `_restore` needs to undo it."""
    before = {name: (m.training, set(m.__dict__), {d: set(getattr(m, d, {})) for d in HOOK_DICTS})
              for name, m in target.named_modules()}
    impl = target.config._attn_implementation
    during = impl if impl in MASKABLE_ATTENTION else "sdpa"
    during = cpu.attention(target, during)  # on CPU: sdpa without a copy of the KV cache per query head
    switch = during != impl
    if switch:
        target.set_attn_implementation(during)
    target.eval()
    return before, impl, switch


def _restore(target, before: dict, impl: str, switch: bool) -> None:
    if switch:
        _set_attention(target, impl)
    for name, m in target.named_modules():
        if name not in before:
            continue
        training, keys, hooks = before[name]
        m.training = training
        for d, ids in hooks.items():
            for hook_id in set(getattr(m, d, {})) - ids:
                getattr(m, d).pop(hook_id, None)
        for key in set(m.__dict__) - keys:
            del m.__dict__[key]
