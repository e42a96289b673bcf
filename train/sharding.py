"""The frozen target split across the training processes, for a target too large for one device.

`target_sharding: fsdp` wraps each of the target's decoder layers with FSDP2 (`fully_shard`): every process
keeps 1/N of each layer's weights and all-gathers a layer's weights just before its forward, freeing them
just after. The target is frozen, so there are no gradients to reduce and no optimizer state: FSDP2 is only
a memory layout here, and the features are the unsharded target's, bit for bit.

Why FSDP2 and not the other routes: it is part of torch (no second environment, unlike vLLM's hidden-state
extraction), works with gloo, so a CPU test runs the very code a GPU run does, and leaves the drafter's own
distribution (DDP, DeepSpeed ZeRO-2/3, FSDP) untouched; DeepSpeed's ZeRO-3 inference would tie the target's
layout to DeepSpeed runs only.

What stays whole on every process: the input embedding, the final norm and the lm_head. The drafter borrows
the embedding and lm_head by reference (`heads.base.DrafterModel.attach`) and calls them outside the target's
forward, where a sharded weight would never be gathered; for a 70B Llama they are 4.2 GB of the 141 GB in
bf16. The decoder stack itself (`target.base_model`) is not wrapped as a root: transformers records
`output_hidden_states` with hooks on its layers, and a wrapped root returned none; each layer is its own
FSDP2 unit, resharded after its forward.

Any number of processes works: FSDP2 splits each weight along its first dimension and pads the last shard
where the rows do not divide evenly.

Every process must run the target's forward the same number of times (each forward's all-gathers are
collective): training batches are equal per process (train.data.epoch_batches), evaluation batches are not,
so under sharding the held-out split's features come from the offline cache, and an offline cache is built by
all processes together (each computes every batch; only the layers' weights are split, not the samples).
"""

from __future__ import annotations

import torch
from torch import nn

MODES = ("none", "fsdp")


def check_sharding(target_sharding: str, world_size: int, *, lora_r: int = 0) -> None:
    """Settings that make sharding impossible, checked before the data or the target load."""
    if target_sharding not in MODES:
        raise ValueError(f"config key 'target_sharding' must be one of {MODES}, got {target_sharding!r}")
    if target_sharding == "none":
        return
    if lora_r > 0:
        raise ValueError("target_sharding: fsdp with lora_r > 0: Medusa-2 trains LoRA adapters inside the target, "
                         "which a frozen sharded target does not allow; set lora_r: 0 or target_sharding: none")
    if world_size < 2:
        raise ValueError("target_sharding: fsdp splits the target across processes, but this run has 1 process; "
                         "launch 2 or more (accelerate launch --num_processes N, or torchrun --nproc_per_node N), "
                         "or set target_sharding: none")


def decoder_layers(target: nn.Module) -> nn.ModuleList:
    """The target's stack of decoder layers: the one ModuleList under its base model with num_hidden_layers
    entries (model.layers in Llama/Qwen/Gemma, transformer.h in GPT-2)."""
    config = target.config.get_text_config()
    count = getattr(config, "num_hidden_layers", None)
    found = [m for m in target.base_model.modules() if isinstance(m, nn.ModuleList) and len(m) == count]
    if len(found) != 1:
        what = "no" if not found else f"{len(found)}"
        raise ValueError(f"target_sharding: fsdp splits the target by its decoder layers, but "
                         f"{type(target).__name__} has {what} list of {count} layers (num_hidden_layers) under its "
                         "base model; set target_sharding: none")
    return found[0]


def check_shardable(target: nn.Module, layers: nn.ModuleList) -> None:
    """A weight shared between a decoder layer and anything outside it would be split in one place and whole
    in the other; refuse it by name."""
    inside = {id(p) for p in layers.parameters()}
    shared = [name for name, p in target.named_parameters(remove_duplicate=False)
              if id(p) in inside and not name.startswith(_prefix(target, layers))]
    if shared:
        raise ValueError(f"target_sharding: fsdp cannot split {type(target).__name__}: its decoder layers share "
                         f"weights with other modules ({', '.join(shared[:3])}); set target_sharding: none")


def _prefix(target: nn.Module, layers: nn.ModuleList) -> str:
    return next(name for name, m in target.named_modules() if m is layers) + "."


def shard_target(target: nn.Module, device: torch.device, world_size: int) -> float:
    """Move `target` to `device` with its decoder layers split over the `world_size` processes of the default
    process group; returns the share of the target's parameters this process holds."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = torch.device(device)
    layers = decoder_layers(target)
    check_shardable(target, layers)
    total = sum(p.numel() for p in target.parameters())
    in_layers = {id(m) for m in layers.modules()}
    # Everything outside the layers goes to the device whole; the layers go there as shards, so the whole
    # target is never on one device.
    for module in target.modules():
        if id(module) not in in_layers:
            module._apply(lambda t: t.to(device), recurse=False)
    mesh = init_device_mesh(device.type, (world_size,))
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    return local_parameters(target) / total


def local_parameters(model: nn.Module) -> int:
    """Parameters this process holds: a sharded (DTensor) weight counts its local shard."""
    return sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())


def place_target(target: nn.Module, target_sharding: str, accelerator) -> None:
    """The frozen target on this process's device: whole, or split (`target_sharding: fsdp`)."""
    if target_sharding == "none":
        target.to(accelerator.device)
        return
    share = shard_target(target, accelerator.device, accelerator.num_processes)
    print(f"[target] process {accelerator.process_index}/{accelerator.num_processes} holds {share:.1%} of the "
          "target's parameters (decoder layers split by FSDP2; embedding, final norm and lm_head whole)", flush=True)
