"""Drafting with an EAGLE-style drafter (EAGLE-1/2 and EAGLE-3 share it).

The drafter keeps its own KV cache (`infer.kv.KVState`; full attention, or a sliding window in the EAGLE-3
layers that have one: `mask_config()`). Slot t holds the drafter's pass over the pair (token x_{t+1}, feature f_t)
at position t:

- `observe` runs the pairs the target just committed (the prompt, or root + accepted drafts, each with the
  token that follows it) and commits them; the output at the last slot predicts the root's children.
- `propose` grows a tree below the root one depth at a time. A drafted node's input is (its token, its
  parent's output hidden state), placed at position `length + depth - 1`, attending to the committed cache
  and to its drafted ancestors only. Dynamic mode (EAGLE-2) expands, at every depth, the `top_k` nodes with
  the highest cumulative draft log-probability, `top_k` children each, then keeps the `total_tokens` best
  nodes overall; static mode (EAGLE-1) expands fixed paths of ranks. Drafted slots are rolled back after.
  A dynamic tree drafts only what the `total_tokens` best could hold (`_frontier_size`): no deeper than
  `total_tokens`, and at depth d only the best `total_tokens - d` nodes are expanded. The kept tree is the
  same; for the small trees a CPU calibrates to, the drafter passes run on far fewer rows.
  With `min_confidence`, a dynamic row stops expanding once the best node it could expand next has a
  cumulative draft probability below it: easy rows draft deep, hard rows stop early (their deeper nodes are
  invalid, and drafting ends when every row has stopped). Only the tree changes, never the output.

Drafts are deterministic (top-k), so siblings are distinct and `DraftTree.q` is None.

Under the engine's captured step (`capture_forwards`, on a GPU), the drafter's cache is static (preallocated,
kept between calls while the batch size holds, grown by whole steps only when a step would not fit), and every
forward after the prompt's runs through the engine's seam for captured forwards (`infer.cuda.StepGraphs`): a
draft depth's forward has a fixed width (`sync_free` trees drop no node), and observe's block of accepted tokens
is padded to a power of two (`observe_bucket`), so each is the replay of one graph per (input shapes, block size).
"""

from __future__ import annotations

import math

import torch

from infer.attention import prompt_tree
from infer.cpu import lean_forward, linear
from infer.kv import KVState
from infer.tree import DraftTree, tree_from_paths

from ..base import HeadDrafter

# A static drafter cache grows in steps of this many slots (rounded up), as the engine sizes the target's.
STATIC_STEP = 256


def observe_bucket(width: int) -> int:
    """The padded width of a captured observe block of `width` accepted tokens: the next power of two, so the
    few widths a step commits (1 to depth + 1) share a handful of graphs."""
    return 1 << max(width - 1, 0).bit_length()


class StaticLevels:
    """A static tree of paths, cut into depths: which frontier node each child hangs from, at which rank,
    and which children are expanded further."""

    def __init__(self, paths: list[tuple[int, ...]]):
        parents, ranks = tree_from_paths([tuple(p) for p in paths])
        parents, ranks = parents.tolist(), ranks.tolist()
        depth = [0]
        for p in parents[1:]:
            depth.append(depth[p] + 1)
        self.depth = max(depth)
        has_children = set(parents[1:])
        frontier = [0]  # node ids expanded at the previous depth, in order
        self.parent_pos, self.ranks, self.expand, self.width = {}, {}, {}, {}
        for d in range(1, self.depth + 1):
            level = [i for i in range(len(parents)) if depth[i] == d]
            self.parent_pos[d] = torch.tensor([frontier.index(parents[i]) for i in level])
            self.ranks[d] = torch.tensor([ranks[i] for i in level])
            self.width[d] = max(ranks[i] for i in level) + 1  # candidates per frontier node: known here, not read
            self.expand[d] = torch.tensor([j for j, i in enumerate(level) if i in has_children], dtype=torch.long)
            frontier = [i for i in level if i in has_children]
        self._copies: dict[tuple, torch.Tensor] = {}

    def on(self, device: torch.device, table: str, d: int) -> torch.Tensor:
        """Depth d's `table` on `device`, copied once: a copy to a GPU each step would wait for its queue."""
        key = (device, table, d)
        if key not in self._copies:
            self._copies[key] = getattr(self, table)[d].to(device)
        return self._copies[key]


class EagleDrafter(HeadDrafter):
    def __init__(self, model, tree: dict):
        super().__init__(model)
        self.tree = tree
        self.static = StaticLevels(tree["paths"]) if tree["mode"] == "static" else None
        self.max_depth = self.static.depth if self.static else tree["depth"]
        self.log_min_confidence = math.log(tree["min_confidence"]) if tree["min_confidence"] > 0 else None
        self.kv = self.root = self.last_hidden = self.last_logits = None
        self._lean_rows: int | None = None
        self._int8: linear.PackCache | None = None  # the lean forward's int8 copies of the weights, kept here
        self.net = model  # the model, or its lean forward for the current call (`lean_forwards`)
        self._captured = None  # the engine's captured forwards of the model (`capture_forwards`), or None
        self._static_kv: KVState | None = None  # the static cache kept between calls under capture

    def capture_forwards(self, make) -> None:
        """From the next call on, draft over a static cache and run every forward after the prompt's through
        `make(model)` (the engine's `infer.cuda.StepGraphs`: kept input buffers per shape, captured as CUDA graphs
        on a GPU) instead of the model or its lean forward (a CPU's, which a capture would not take); `make` None:
        the growing cache and the model's own forwards again (an engine without the captured step)."""
        self._captured = None if make is None else make(self.model)
        self._static_kv = self.kv = None  # the last call's cache goes with its graphs (bind makes the next one's)
        if make is not None:
            self._lean_rows = None

    def lean_forwards(self, stream_rows: int | None, int8: bool = True) -> None:
        """From the next call on, run the model through its `lean_forward` where it has one and it can run
        (EAGLE-3's `heads.eagle3.lean.LeanEagle3`: the same function without transformers' modules), with
        blocks of 2..stream_rows rows on the streamed kernel and, with `int8`, draft steps on int8 copies of
        the weights (held by this adapter, not the model); None: always through the model's modules (the
        default). The engine sets this from its `lean_verify` and `int8_drafter` settings."""
        self._lean_rows = stream_rows
        self._int8 = linear.PackCache() if int8 else None

    def bind(self, target, sampling, batch_size: int, generator=None) -> None:
        super().bind(target, sampling, batch_size, generator)
        device = target.get_input_embeddings().weight.device
        self.kv = KVState(batch_size, device, config=self.model.mask_config()) if self._captured is None else \
            self._static_cache(batch_size, device)
        self.root = self.last_hidden = self.last_logits = None
        # what runs the model this call: made per call, so a hook or an adapted layer since the last one counts
        self.net = self.model
        make_lean = getattr(self.model, "lean_forward", None)  # EAGLE-3 has one
        if self._lean_rows is not None and make_lean is not None and not lean_forward.user_hooks(self.model):
            self.net = make_lean(self._lean_rows, self._int8) or self.model

    def _static_cache(self, batch_size: int, device: torch.device) -> KVState:
        """The captured path's static cache: the last call's, emptied, while batch size and device are the same
        (its buffers' addresses, and so the graphs captured over them, stay valid), else a new one."""
        kv = self._static_kv
        if kv is not None and (kv.batch_size, kv.length.device) == (batch_size, device):
            kv.reset()
        else:
            kv = self._static_kv = KVState(batch_size, device, config=self.model.mask_config(), capacity=STATIC_STEP)
        return kv

    def _make_room(self, width: int) -> None:
        """Grow a static cache, before a step, to hold the observe block of `width` slots and every slot the
        next propose drafts: no forward of the step then meets a full cache. A grown cache has new buffers, so its
        graphs are captured anew (doubling: a few times per context)."""
        need = width + sum(self.pass_rows())
        if self.kv.room() < need:
            capacity = max(2 * self.kv.capacity, self.kv.size + need)
            self.kv.grow(-(-capacity // STATIC_STEP) * STATIC_STEP)

    @torch.no_grad()
    def observe(self, step) -> None:
        # step.tokens, step.valid: [B, A]; step.hidden: one [B, A, D] per feature layer
        features, tokens, valid = self.model.fuse_features(step.hidden), step.following_tokens(), step.valid
        net = self.net
        if self._captured is not None:
            prompt = self.kv.size == 0  # the prompt's width is any: it runs uncaptured (and makes the layers)
            width = valid.shape[1] if prompt else observe_bucket(valid.shape[1])
            self._make_room(width)
            if not prompt:
                tokens, features, valid = _pad_block(width, tokens, features, valid)
                net = self._captured
        depth, ancestors, node_valid = prompt_tree(valid)  # one causal block over the valid slots
        start = self.kv.size
        hidden, logits = self.kv.forward_tree(net, depth, ancestors, node_valid, tokens, features)
        self.kv.commit_block(start, step.valid)  # the padding's slots, past the accepted ones, are dropped
        last = step.last_valid_index().clamp(min=0)
        rows = torch.arange(last.shape[0], device=last.device)
        self.last_hidden, self.last_logits = hidden[rows, last], logits[rows, last]  # [B, D], [B, V']
        self.root = step.next_tokens

    @torch.no_grad()
    def propose(self, budget: torch.Tensor) -> DraftTree:
        # budget: [B]
        b = self.root.shape[0]
        # sync_free (a GPU's step): no read of the budget; nodes past it are drafted invalid and rank last
        max_depth = self.max_depth if self.sync_free else min(self.max_depth, int(budget.max()))
        tokens, parents = [self.root[:, None]], [torch.full_like(self.root[:, None], -1)]
        scores = [torch.zeros(b, 1, device=self.root.device)]
        valid = [torch.ones(b, 1, dtype=torch.bool, device=self.root.device)]
        expanding = valid[0][:, 0]  # [B] rows still drafting deeper (min_confidence stops the others)
        # The frontier: nodes whose children are drafted next, with the drafter's output at each.
        f_node = torch.zeros_like(self.root[:, None])  # [B, F] node ids
        f_score = scores[0]  # [B, F] cumulative draft log-prob
        f_logp = torch.log_softmax(self.last_logits.float(), -1)[:, None]  # [B, F, V']
        f_hidden = self.last_hidden[:, None]  # [B, F, D]
        f_slot = None  # [B, F] cache slot of each frontier node (the root has none)
        # [B, F, d-1] cache slots of each frontier node's drafted ancestors
        f_anc = torch.zeros(b, 1, 0, dtype=torch.long, device=self.root.device)
        num_nodes, committed = 1, self.kv.size
        for d in range(1, max_depth + 1):
            c_tok, c_logp, c_from = self._children(d, f_logp)  # [B, C]: draft ids, log-probs, frontier index
            c_score = f_score.gather(1, c_from) + c_logp
            tokens.append(self.model.draft_to_target(c_tok))
            parents.append(f_node.gather(1, c_from))
            scores.append(c_score)
            valid.append((expanding & (d <= budget) if self.sync_free else expanding)[:, None].expand_as(c_tok))
            first, num_nodes = num_nodes, num_nodes + c_tok.shape[1]
            if self.log_min_confidence is not None:
                expanding = expanding & (c_score.max(1).values >= self.log_min_confidence)
            if d == max_depth or (not self.sync_free and not expanding.any()):
                break
            pick = self._next_frontier(d, c_score)  # [B, F'] indices into this depth's children
            if pick.shape[1] == 0:  # no deeper node could be kept
                break
            p_from = c_from.gather(1, pick)
            anc = f_anc.gather(1, p_from[..., None].expand(-1, -1, f_anc.shape[2]))
            if f_slot is not None:
                anc = torch.cat([anc, f_slot.gather(1, p_from)[..., None]], dim=2)
            hidden_in = f_hidden.gather(1, p_from[..., None].expand(-1, -1, f_hidden.shape[2]))
            f_slot = self.kv.size + torch.arange(pick.shape[1], device=pick.device).expand_as(pick)
            f_hidden, logits = self._draft_step(tokens[-1].gather(1, pick), hidden_in, d, anc)
            f_node, f_score, f_anc = first + pick, c_score.gather(1, pick), anc
            f_logp = torch.log_softmax(logits.float(), -1)
        self.kv.rollback(committed)
        tree = self._select(torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(scores, 1), torch.cat(valid, 1))
        return tree.prune_deeper_than(budget)

    def _children(self, d: int, f_logp: torch.Tensor):
        """Candidate children of every frontier node: (draft ids, their log-probs, frontier index), [B, C]."""
        b, f, v = f_logp.shape
        if self.static is None:
            k = min(self.tree["top_k"], v)
            top = f_logp.topk(k, dim=-1)  # [B, F, k]
            c_from = torch.arange(f, device=f_logp.device).repeat_interleave(k).expand(b, f * k)
            return top.indices.flatten(1), top.values.flatten(1), c_from
        pos, ranks = self.static.on(f_logp.device, "parent_pos", d), self.static.on(f_logp.device, "ranks", d)
        top = f_logp.topk(min(self.static.width[d], v), dim=-1)  # [B, F, R]
        ranks = ranks.clamp(max=top.indices.shape[2] - 1)
        return top.indices[:, pos, ranks], top.values[:, pos, ranks], pos.expand(b, -1)

    def _next_frontier(self, d: int, c_score: torch.Tensor) -> torch.Tensor:
        if self.static is None:
            return c_score.topk(self._frontier_size(d, c_score.shape[1]), dim=1).indices
        return self.static.on(c_score.device, "expand", d).expand(c_score.shape[0], -1)

    def pass_rows(self) -> tuple[int, ...]:
        """Rows of each drafter pass `propose` runs per batch row after the observe step (the frontier of
        depths 1, 2, ...), without the early stop: with the context, what a drafting step costs. Dynamic trees
        that differ only in `total_tokens` may differ here; `infer.tuning.timing.draft_costs` times each value."""
        if self.static is not None:
            return tuple(len(self.static.expand[d]) for d in range(1, self.max_depth))
        rows, frontier = [], 1
        for d in range(1, self.max_depth):
            frontier = self._frontier_size(d, frontier * self.tree["top_k"])
            if frontier == 0:
                break
            rows.append(frontier)
        return tuple(rows)

    def _frontier_size(self, d: int, candidates: int) -> int:
        """How many of the `candidates` depth-d nodes a dynamic tree expands. keep_best keeps a depth-(d+1)
        node only if fewer than `total_tokens` nodes rank before it, and its d ancestors do, as does every
        depth-d node scoring at least its parent (a child never scores above its parent, and shallower nodes
        come first in the stable sort). Below the best `total_tokens - d`, no child could be kept, and from
        depth `total_tokens` on none at all (0: drafting ends)."""
        return max(min(self.tree["top_k"], candidates, self.tree["total_tokens"] - d), 0)

    def _draft_step(self, tokens, hidden, d: int, ancestors):
        """Run the drafter on frontier nodes at depth d; they see the committed cache and their ancestors."""
        # tokens: [B, F] target ids; hidden: [B, F, D] parents' outputs; ancestors: [B, F, d-1] cache slots
        kv, (b, f) = self.kv, tokens.shape
        query_pos = (kv.length[:, None] + d - 1).expand(b, f)
        attend = torch.zeros(b, f, kv.size + f, dtype=torch.bool, device=tokens.device)
        attend[:, :, : kv.size] = kv.valid[:, None, :]
        attend.scatter_(2, ancestors, True)
        net = self.net if self._captured is None else self._captured
        return kv.forward(net, query_pos, attend, torch.zeros_like(tokens, dtype=torch.bool), tokens, hidden)

    def _select(self, tokens, parents, scores, valid) -> DraftTree:
        """Static: every node. Dynamic: the root and the `total_tokens` best valid nodes by cumulative
        log-prob (fewer when every row stopped early with fewer)."""
        if self.static is not None:
            return DraftTree(tokens, parents, valid, scores=scores)
        if self.sync_free:  # a fixed node count, padded with invalid nodes where rows stopped early
            return keep_best(tokens, parents, scores, self.tree["total_tokens"], valid, check=False)
        most_valid = int(valid.sum(1).max()) - 1
        return keep_best(tokens, parents, scores, min(self.tree["total_tokens"], most_valid), valid)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.kv.select_rows(rows)
        self.root, self.last_hidden, self.last_logits = self.root[rows], self.last_hidden[rows], \
            self.last_logits[rows]


def _pad_block(width: int, tokens, features, valid):
    """An observe block [B, A] padded to `width` slots: token 0, zero features, invalid (so they see only
    themselves, and `commit_block` of the unpadded width drops them)."""
    # tokens, valid: [B, A]; features: [B, A, D']
    b, a = tokens.shape
    if width == a:
        return tokens, features, valid
    padded = (tokens.new_zeros(b, width), features.new_zeros(b, width, features.shape[2]), valid.new_zeros(b, width))
    for full, part in zip(padded, (tokens, features, valid), strict=True):
        full[:, :a] = part
    return padded


def keep_best(tokens, parents, scores, total: int, valid=None, check: bool = True) -> DraftTree:
    """The root and the `total` drafted nodes of highest cumulative draft log-prob `scores`, invalid nodes
    last; the kept nodes' scores ride along in the tree. `check`: assert the kept set is ancestor-closed (a host
    read; the engine's step checks every tree anyway, `infer.tree.DraftTree.malformed`).

    A child never scores above its parent and comes after it, and an invalid node's children are invalid,
    so a stable descending sort ranks parents first and the kept set is ancestor-closed. Kept nodes stay in
    creation (depth) order."""
    # tokens, parents, scores, valid: [B, M]
    b, m = tokens.shape
    if valid is None:
        valid = torch.ones(b, m, dtype=torch.bool, device=tokens.device)
    if m - 1 <= total:
        return DraftTree(tokens, parents, valid, scores=scores)
    ranked = scores.masked_fill(~valid, -float("inf"))
    best = ranked[:, 1:].sort(dim=1, descending=True, stable=True).indices[:, :total]
    nodes = torch.cat([torch.zeros_like(best[:, :1]), (best + 1).sort(dim=1).values], dim=1)  # [B, n]
    new_id = torch.full_like(tokens, -1)
    new_id.scatter_(1, nodes, torch.arange(nodes.shape[1], device=nodes.device).expand_as(nodes))
    old_parent = parents.gather(1, nodes)
    new_parent = torch.where(old_parent >= 0, new_id.gather(1, old_parent.clamp(min=0)), -1)
    assert not check or (new_parent[:, 1:] >= 0).all(), "reranked draft tree is not ancestor-closed"
    return DraftTree(tokens.gather(1, nodes), new_parent, valid.gather(1, nodes), scores=scores.gather(1, nodes))
