"""`specforge train` and `specforge export` (SpecForge 0.2.0) on a CPU, run in the peers' environment (`make peers`).

Run by train/apps/bench/trainers.py as `.venv-peers/bin/python <this file> train --config run.yaml`; it imports only
SpecForge and torch, never selfspec. The one patch: SpecForge's EAGLE-3 KL loss (`LogSoftmaxLoss`) is a Triton
kernel, and Triton has no CPU driver, so the loss module is given the plain-torch form of the same math
(`-sum(mask * p * log_softmax(logits)) / (B * T)`, SpecForge's own reference `_compute_loss`). Everything else
(gloo process group, DDP for fsdp_sharding NO_SHARD, sdpa attention) has a CPU path of SpecForge's own when
SPECFORGE_DEVICE=cpu.
"""

import os
import sys

os.environ.setdefault("SPECFORGE_DEVICE", "cpu")

import specforge.algorithms.eagle3.model as eagle3_model  # noqa: E402
import torch  # noqa: E402


class TorchLogSoftmaxLoss:
    """The Triton kernel's forward and backward as one autograd-tracked torch expression."""

    @staticmethod
    def apply(logits, target, position_mask):
        # logits, target: [B, T, V]; position_mask: [B, T] or [B, T, 1]
        batch, steps, _ = logits.shape
        logp = torch.log_softmax(logits.float(), dim=-1)
        per_position = (target.float() * logp).sum(-1, keepdim=True)
        return -(per_position * position_mask.reshape(batch, steps, 1).to(logp.dtype)).mean()


eagle3_model.LogSoftmaxLoss = TorchLogSoftmaxLoss

if __name__ == "__main__":
    from specforge.cli import main

    raise SystemExit(main(sys.argv[1:]))
