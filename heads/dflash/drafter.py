"""Drafting with a DFlash block drafter.

The drafter keeps its own KV cache (`infer.kv.KVState`, full attention) of the context: slot t holds each
drafter layer's keys and values projected from the target's features at committed token t.

- `observe` writes the keys and values of the tokens the target just committed (the prompt, or root +
  accepted drafts) as context slots and commits them; no layer runs.
- `propose` runs one block after the cache: [root, mask x (block_size - 1)] at positions n .. n+S-1,
  attending to every committed slot and to the whole block. Block slot k gives the distribution of the
  token k places after the root. The block's slots are rolled back after.

A chain (`top_k` = 1) drafts each position's argmax; when sampling, each position's token is drawn from
the drafter's own processed distribution q (the target's sampling settings, `infer.sampling`), which goes
to verification with the tree (`DraftTree.q`). The drafts are drawn independently of each other, so q at
depth k is the distribution the token was drawn from whatever was accepted before it: rejection sampling
stays exact. A tree (`top_k` > 1) expands, depth by depth, the `top_k` best nodes by the `top_k` best
tokens of the next block position, then keeps the `total_tokens` nodes of highest joint log-probability;
its drafts are deterministic (q one-hot), which verification also handles exactly.
"""

from __future__ import annotations

import torch

from infer.attention import prompt_tree
from infer.drafters.chain import chain_tree
from infer.kv import KVState
from infer.sampling import logits_to_probs, sample
from infer.tree import DraftTree

from ..base import HeadDrafter
from ..eagle.drafter import keep_best


def block_tree(root: torch.Tensor, logp: torch.Tensor, top_k: int, total_tokens: int) -> DraftTree:
    """A tree below `root` [B] from per-position draft log-probs `logp` [B, K, V]: at depth d the `top_k`
    best nodes (by joint log-prob) each get the `top_k` best tokens of position d as children; then the
    `total_tokens` best nodes are kept. With `top_k` = 1 it is the argmax chain."""
    b, depth, v = logp.shape
    top = logp.topk(min(top_k, v), dim=-1)  # [B, K, k]
    k = top.indices.shape[2]
    tokens, parents, scores = [root[:, None]], [torch.full_like(root[:, None], -1)], [logp.new_zeros(b, 1)]
    f_node, f_score = torch.zeros_like(root[:, None]), logp.new_zeros(b, 1)  # the frontier: [B, F]
    num_nodes = 1
    for d in range(depth):
        f = f_node.shape[1]
        c_score = (f_score[:, :, None] + top.values[:, d, None, :]).flatten(1)  # [B, F*k]
        tokens.append(top.indices[:, d, None, :].expand(b, f, k).flatten(1))
        parents.append(f_node[:, :, None].expand(b, f, k).flatten(1))
        scores.append(c_score)
        pick = c_score.topk(min(k, f * k), dim=1).indices  # [B, F']
        f_node, f_score = num_nodes + pick, c_score.gather(1, pick)
        num_nodes += f * k
    return keep_best(torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(scores, 1), total_tokens)


class DFlashDrafter(HeadDrafter):
    def __init__(self, model, tree: dict):
        super().__init__(model)
        self.tree = tree
        self.kv = self.root = None

    def bind(self, target, sampling, batch_size: int, generator=None) -> None:
        super().bind(target, sampling, batch_size, generator)
        self.kv = KVState(batch_size, target.get_input_embeddings().weight.device, config=None)
        self.root = None

    @torch.no_grad()
    def observe(self, step) -> None:
        # step.valid: [B, A]; step.hidden: one [B, A, D] per feature layer
        depth, ancestors, valid = prompt_tree(step.valid)  # one causal block over the valid slots
        start = self.kv.size
        self.kv.forward_tree(self.model, depth, ancestors, valid, self.model.fuse_features(step.hidden),
                             step.next_tokens[:, None][:, :0])
        self.kv.commit_block(start, valid)
        self.root = step.next_tokens

    @torch.no_grad()
    def propose(self, budget: torch.Tensor) -> DraftTree:
        # budget: [B]
        b = self.root.shape[0]
        # sync_free (a GPU's step): no read of the budget; the block's drafts past it are pruned below
        depth = self.tree["depth"] if self.sync_free else min(self.tree["depth"], int(budget.max()))
        if self.tree["top_k"] == 1:
            depth = min(depth, self.tree["total_tokens"])
        if depth < 1:
            return chain_tree(self.root, self.root.new_zeros(b, 0), torch.zeros_like(self.root))
        logits = self._block_logits()[:, :depth]  # [B, K, V]
        if self.sampling.do_sample and self.tree["top_k"] == 1:
            q = logits_to_probs(logits, self.sampling)
            tree = chain_tree(self.root, sample(q, self.generator), torch.full_like(self.root, depth), q)
        else:
            tree = block_tree(self.root, torch.log_softmax(logits.float(), -1), self.tree["top_k"],
                              self.tree["total_tokens"])
        return tree.prune_deeper_than(budget)

    def _block_logits(self) -> torch.Tensor:
        """[B, S-1, V]: the block [root, masks] after the committed cache, in one pass, then rolled back."""
        kv, s = self.kv, self.model.config.block_size
        b, committed, device = self.root.shape[0], kv.size, self.root.device
        query_pos = kv.length[:, None] + torch.arange(s, device=device)  # [B, S]
        attend = torch.ones(b, s, committed + s, dtype=torch.bool, device=device)
        attend[:, :, :committed] = kv.valid[:, None, :]
        _, logits = kv.forward(self.model, query_pos, attend, torch.zeros(b, s, dtype=torch.bool, device=device), None,
                               self.root[:, None])
        kv.rollback(committed)
        return logits[:, 0]

    def select_rows(self, rows: torch.Tensor) -> None:
        self.kv.select_rows(rows)
        self.root = self.root[rows]
