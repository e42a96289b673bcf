"""Acceptance: which path of a verified tree the target keeps, and the target's own next token.

Greedy keeps the deepest path whose every token is the target's argmax after its parent. Sampling is
multi-draft rejection sampling (SpecInfer, Miao et al. 2024; EAGLE, Li et al. 2024): at a node with
target distribution p, the children are tried in order; a child drawn from q is accepted with probability
min(1, p(x)/q(x)), and on rejection p becomes normalize(max(0, p - q)) for the next sibling. Deterministic
drafts (top-k, lookup) are the q = one-hot case: accept with p(x), else zero p(x) and renormalize. If
every child is rejected, the bonus token is sampled from what is left of p. This keeps the output
distribution exactly the target's.

A tree of deterministic drafts only (no q) is accepted in an equivalent way that draws no differently from
decoding without drafts: at each node the target samples its own token from p, one draw a token, and the
child that drafted it, if any, is kept. A child x is then kept with probability p(x) and the bonus follows p
without the children, as above; and the tokens are those the same draws give with no drafts at all, so a
seeded sample never depends on what such a drafter proposed (suffix's earlier responses, a lookup's matches).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .sampling import SamplingParams, logits_to_probs, sample
from .tree import DraftTree


@dataclass
class Acceptance:
    path: torch.Tensor  # [B, A] node indices of the kept path, root first; padded past `length`
    length: torch.Tensor  # [B] nodes kept (>= 1: the root is always kept)
    bonus: torch.Tensor  # [B] the target's next token after the path
    # [B] bool or None: the row's probabilities were not a distribution (NaN, all zero), read with the lengths
    invalid: torch.Tensor | None = None
    # given the lengths once read: put back the random draws the walk did not use (None: nothing to put back)
    rewind: Callable[[list[int]], None] | None = None

    @property
    def keep(self) -> torch.Tensor:  # [B, A]
        a = self.path.shape[1]
        return torch.arange(a, device=self.path.device)[None, :] < self.length[:, None]

    def trimmed(self, width: int) -> Acceptance:
        """The same acceptance with paths `width` wide (at least the longest `length`, which the caller read)."""
        return Acceptance(path=self.path[:, :width], length=self.length, bonus=self.bonus, invalid=self.invalid,
                          rewind=self.rewind)


def _path_to(nodes: torch.Tensor, ancestors: torch.Tensor) -> Acceptance:
    """The root-to-`nodes[b]` paths as index tables as wide as the tree, padded past each `length` (bonus left
    unset). The width is the tree's, not the longest path's, so that finding it reads nothing on the host; the
    engine trims the paths once it has read the lengths."""
    b, n = ancestors.shape[:2]
    on_path = ancestors[torch.arange(b, device=nodes.device), nodes]  # [B, N]; parents precede children: index = depth
    length = on_path.sum(1)
    order = torch.where(on_path, torch.arange(n, device=nodes.device), n).sort(1).values
    return Acceptance(path=order.clamp(max=n - 1), length=length, bonus=nodes.new_zeros(b))


def accept_greedy(tree: DraftTree, logits: torch.Tensor, ancestors: torch.Tensor, depth: torch.Tensor):
    # logits: [B, N, V]; ancestors: [B, N, N]; depth: [B, N]
    target_next = logits.argmax(-1)  # [B, N]
    parent_choice = target_next.gather(1, tree.parents.clamp(min=0))
    match = (tree.tokens == parent_choice) & tree.valid
    match[:, 0] = True
    whole_path_matches = ~(ancestors & ~match[:, None, :]).any(-1)
    best = torch.where(whole_path_matches, depth, -1).argmax(1)  # deepest; ties -> earliest node
    acc = _path_to(best, ancestors)
    acc.bonus = target_next.gather(1, best[:, None])[:, 0]
    return acc


def accept_greedy_host(tree: DraftTree, logits: torch.Tensor):
    """`accept_greedy`'s choice (the deepest node whose whole path is the target's argmax, ties to the earliest node)
    found by walking the tree on the host, from one read of the target's argmax per node and of the tree: on a CPU a
    read costs nothing and the walk fewer calls than the tensor ops. Returns the acceptance and, per row, the kept
    path's node indices and its new tokens (the accepted drafts, then the bonus); or None where a valid node's parent
    is none or comes after it (the walk needs a rooted tree, parents first; `accept_greedy` takes any table). A valid
    node below an invalid one raises ValueError(tree.MALFORMED). logits: [B, N, V]"""
    from .tree import MALFORMED

    b, n = tree.tokens.shape
    argmax, parents, tokens, valid = (t.tolist() for t in (logits.argmax(-1), tree.parents, tree.tokens, tree.valid))
    paths, new_tokens = [], []
    for par, tok, ok, nxt in zip(parents, tokens, valid, argmax, strict=True):
        depth, matched, whole = [0] * n, [True] + [False] * (n - 1), [True] + [False] * (n - 1)
        best = 0
        for node in range(1, n):
            parent = par[node]
            if not ok[node]:
                continue
            if not 0 <= parent < node:  # not a tree in parents-first order: accept_greedy's to judge
                return None
            if not whole[parent]:
                raise ValueError(MALFORMED)
            whole[node] = True  # the node and all its ancestors valid
            depth[node] = depth[parent] + 1
            matched[node] = matched[parent] and tok[node] == nxt[parent]
            if matched[node] and depth[node] > depth[best]:
                best = node
        path = [best]
        while path[-1] != 0:
            path.append(par[path[-1]])
        path.reverse()
        paths.append(path)
        new_tokens.append([tok[node] for node in path[1:]] + [nxt[best]])
    width = max(len(p) for p in paths)
    device = tree.tokens.device
    acc = Acceptance(path=torch.tensor([p + [n - 1] * (width - len(p)) for p in paths], device=device),
                     length=torch.tensor([len(p) for p in paths], device=device),
                     bonus=torch.tensor([t[-1] for t in new_tokens], device=device))
    return acc, paths, new_tokens


def _children(tree: DraftTree, row: int) -> list[list[int]]:
    parents = tree.parents[row].tolist()
    valid = tree.valid[row].tolist()
    kids: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents):
        if parent >= 0 and valid[node]:
            kids[parent].append(node)
    return kids


def accept_sampled(tree: DraftTree, logits: torch.Tensor, ancestors: torch.Tensor, params: SamplingParams,
                   generator: torch.Generator | None = None) -> Acceptance:
    """Lossless rejection sampling over the tree (see module docstring)."""
    probs = logits_to_probs(logits, params)  # [B, N, V]
    if tree.q is None:
        return _accept_deterministic(tree, probs, ancestors, generator)
    b = probs.shape[0]
    ends, bonus = [], []
    for row in range(b):
        kids = _children(tree, row)
        node = 0
        while True:
            p = probs[row, node].clone()
            accepted = None
            for child in kids[node]:
                x = int(tree.tokens[row, child])
                q = None if tree.q is None else tree.q[row, child]
                qx = 1.0 if q is None else float(q[x])
                u = torch.rand((), generator=generator, device=p.device)
                if qx > 0 and u * qx <= p[x]:  # u < p(x)/q(x), written without dividing
                    accepted = child
                    break
                residual = p.clone()
                if q is None:
                    residual[x] = 0
                else:
                    residual = (residual - q).clamp(min=0)
                total = residual.sum()
                if total > 0:  # == 0 only when p == q up to rounding: then rejection had probability 0
                    p = residual / total
            if accepted is None:
                bonus.append(sample(p, generator)[None])
                ends.append(node)
                break
            node = accepted
    return _walked(ends, bonus, ancestors)


def _accept_deterministic(tree: DraftTree, probs: torch.Tensor, ancestors: torch.Tensor,
                          generator: torch.Generator | None) -> Acceptance:
    """Deterministic drafts: the target's own sample at each node, the child that drafted it kept (see module
    docstring). probs: [B, N, V]"""
    ends, bonus = [], []
    for row in range(probs.shape[0]):
        kids = _children(tree, row)
        tokens = tree.tokens[row].tolist()
        node = 0
        while True:
            token = sample(probs[row, node], generator)
            child = next((c for c in kids[node] if tokens[c] == int(token)), None)
            if child is None:
                bonus.append(token[None])
                ends.append(node)
                break
            node = child
    return _walked(ends, bonus, ancestors)


def _walked(ends: list[int], bonus: list[torch.Tensor], ancestors: torch.Tensor) -> Acceptance:
    """The acceptance a row-by-row walk found: each row's last kept node and its bonus token ([1] each)."""
    acc = _path_to(torch.tensor(ends, device=ancestors.device), ancestors)
    acc.bonus = torch.cat(bonus)
    return acc


def accept_drawn(tree: DraftTree, probs: torch.Tensor, ancestors: torch.Tensor, depth: torch.Tensor, deepest: int,
                 generator: torch.Generator | None = None) -> Acceptance:
    """`_accept_deterministic` without a host read (deterministic drafts: `tree.q` None), for a GPU's step.

    The walk's draws are made before it: one uniform per depth up to `deepest` (a bound on the tree's depth), each
    its own draw of the shape the walk's `sample` makes, and every node samples the target's token with its depth's
    uniform, by the inverse of its cumulative distribution as `sample` does. The kept path is then the one whose
    every node drafted the token its parent sampled, found as greedy acceptance finds its path. Once the lengths are
    read, `rewind` puts back the draws past the path, so at batch 1 the generator ends where the walk leaves it and a
    seeded sample is the one without drafts; at several rows the uniforms are drawn at once and none put back, and
    the sample, still the target's distribution, is another than the walk's. probs: [B, N, V]; depth: [B, N]"""
    b, n, v = probs.shape
    gen = generator if generator is not None else _default_generator(probs.device)
    states = []
    if b == 1:  # the walk's own draws, one by one, each state kept (a host copy, no read of the device) to rewind to
        draws = []
        for _ in range(deepest + 1):
            states.append(gen.get_state())
            draws.append(torch.rand((1, 1), generator=gen, dtype=torch.float64, device=probs.device))
        states.append(gen.get_state())
        u = torch.cat(draws, dim=1)  # [1, D + 1]
    else:  # no rewind at several rows: one draw for all
        u = torch.rand((b, deepest + 1), generator=gen, dtype=torch.float64, device=probs.device)
    cdf = probs.double().cumsum(-1)  # [B, N, V]
    total = cdf[..., -1:]
    token = torch.searchsorted(cdf, u.gather(1, depth.clamp(max=deepest))[..., None] * total, right=True)[..., 0]
    # a draw within an ulp of the total finds no token: the last of nonzero probability, as `sample` takes
    last = v - 1 - (probs.flip(-1) > 0).int().argmax(-1)
    token = torch.where(token == v, last, token)  # [B, N]
    match = (tree.tokens == token.gather(1, tree.parents.clamp(min=0))) & tree.valid
    match[:, 0] = True
    reached = ~(ancestors & ~match[:, None, :]).any(-1)
    end = torch.where(reached, depth, -1).argmax(1)  # siblings are distinct: one node reached per depth
    acc = _path_to(end, ancestors)
    acc.bonus = token.gather(1, end[:, None])[:, 0]
    visited = ancestors[torch.arange(b, device=probs.device), end]  # [B, N]: the nodes the walk samples at
    acc.invalid = (visited & ~(torch.isfinite(total[..., 0]) & (total[..., 0] > 0) & (probs >= 0).all(-1))).any(1)

    def rewind(lengths: list[int]) -> None:
        if b == 1:
            gen.set_state(states[lengths[0]])

    acc.rewind = rewind
    return acc


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


def accept_typical(tree: DraftTree, logits: torch.Tensor, ancestors: torch.Tensor, depth: torch.Tensor,
                   params: SamplingParams, threshold: float = 0.09, alpha: float = 0.3,
                   generator: torch.Generator | None = None) -> Acceptance:
    """Medusa's typical acceptance (Cai et al. 2024, sec. 2.3.1). LOSSY: opt-in only.

    A draft x is accepted when p(x) > min(threshold, alpha * exp(-H(p))) under the target's processed
    distribution p at its parent; the deepest such path is kept and the bonus is sampled from p. Faster
    than rejection sampling at high temperature, but the output no longer follows the target exactly. Under
    greedy decoding (`params.do_sample` False) there is nothing to loosen: it is greedy acceptance.
    """
    if not params.do_sample:
        return accept_greedy(tree, logits, ancestors, depth)
    probs = logits_to_probs(logits, params)  # [B, N, V]
    entropy = -(probs * probs.clamp(min=1e-30).log()).sum(-1)  # [B, N]
    cutoff = torch.minimum(torch.full_like(entropy, threshold), alpha * torch.exp(-entropy))
    parents = tree.parents.clamp(min=0)
    p_at_parent = probs.gather(1, parents[..., None].expand(-1, -1, probs.shape[-1]))  # [B, N, V]
    p_x = p_at_parent.gather(2, tree.tokens[..., None])[..., 0]
    match = (p_x > cutoff.gather(1, parents)) & tree.valid
    match[:, 0] = True
    whole_path_matches = ~(ancestors & ~match[:, None, :]).any(-1)
    best = torch.where(whole_path_matches, depth, -1).argmax(1)
    acc = _path_to(best, ancestors)
    last = probs[torch.arange(probs.shape[0]), best]
    acc.bonus = sample(last, generator)
    return acc
