"""A drafter's acceptance on held-out prompts, and prompt lookup first timed against it.

Greedy acceptance does not depend on the machine: `measure_acceptance` drafts a wide tree (`wide_tree`) through the
engine while an `AcceptanceRecorder` counts which nodes the target accepts (per path of sibling ranks for a static
tree, per rank in the drafter's score order for EAGLE-2's dynamic tree); the statistics are stored with the drafter
(`config.calibration`, written by `scripts/calibrate.py --write`). `measure_lookup_first` times whole generations
instead, so what it finds holds for the machine it ran on. Held-out prompts come from a prompt file
(`load_prompts`).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from ..drafters.none import NoDrafter
from ..jsonfile import json_items
from .cache import device_name
from .candidates import prior_paths
from .plan import engine
from .timing import MAX_NODES, seconds, tree_depth

WIDE = 128  # drafted nodes of the tree acceptance is measured on; candidate trees are its subsets
PROMPT_FIELDS = ("turns", "prompt", "instruction")  # where a prompt file's objects hold the prompt
PROMPT_HELP = ("one prompt per line: a JSON string, or an object with 'turns' (MT-bench/Spec-Bench: the "
               "first turn is used), 'prompt', or 'instruction' (Alpaca, with an optional 'input')")


# ---------------------------------------------------------------------------------------------- prompts
def load_prompts(path: str | Path) -> list[str]:
    """Held-out prompts from a .jsonl file (see PROMPT_HELP) or a .json array of the same items."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no prompt file at {path}; pass --prompts with held-out prompts: {PROMPT_HELP}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start}); save it as UTF-8 "
                         "JSON Lines") from None
    prompts = [_prompt(item, where) for where, item in json_items(text, str(path), PROMPT_HELP)]
    if not prompts:
        raise ValueError(f"{path} holds no prompts (the file is empty); write {PROMPT_HELP}")
    return prompts


def _prompt(item, where: str) -> str:
    if isinstance(item, dict):
        field = next((f for f in PROMPT_FIELDS if f in item), None)
        if field is None:
            raise ValueError(f"{where}: an object without any of {list(PROMPT_FIELDS)} (it has {sorted(item)}); "
                             f"write {PROMPT_HELP}")
        value = item[field]
        if field == "turns":
            value = value[0] if isinstance(value, list) and value else None
        elif field == "instruction" and item.get("input"):
            value = f"{value}\n\n{item['input']}" if isinstance(value, str) else value
        item = value
        if not isinstance(item, str):
            raise ValueError(f"{where}: {field!r} must hold text (turns: a non-empty list of strings), got "
                             f"{item!r:.60}")
    if not isinstance(item, str):
        raise ValueError(f"{where}: a JSON {type(item).__name__}, not a prompt; write {PROMPT_HELP}")
    if not item.strip():
        raise ValueError(f"{where}: the prompt is empty; fill it in or remove it")
    return item


def encode_prompts(tokenizer, prompts: list[str]) -> list[torch.Tensor]:
    """[1, T] ids per prompt: a one-turn chat through the tokenizer's template when it has one, else the text."""
    if getattr(tokenizer, "chat_template", None):
        return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                              return_tensors="pt", return_dict=True)["input_ids"] for p in prompts]
    return [tokenizer(p, return_tensors="pt")["input_ids"] for p in prompts]



# ---------------------------------------------------------------------------------------------- acceptance
class AcceptanceRecorder:
    """A `SelfSpecModel` step observer counting which drafted nodes the target accepts.

    Static trees: per path (node i of the verified tree is path i - 1 in `tree_from_paths` order, the order
    every static drafter builds). Dynamic trees: per rank of the node in the drafter's score order among the
    nodes no deeper than d, for every depth limit d (a tree drafted d deep keeping its N best nodes keeps
    ranks 0..N-1). A row whose tree the token budget cut (a generation's last steps) is left out of the
    statistics, as its deep nodes were never drafted; `accepted` lists every row's accepted drafts."""

    def __init__(self, mode: str, *, paths: list | None = None, depth: int | None = None,
                 max_nodes: int = MAX_NODES):
        if mode not in ("static", "dynamic"):
            raise ValueError(f"mode must be 'static' or 'dynamic', got {mode!r}")
        self.mode, self.max_nodes = mode, max_nodes
        if mode == "static":
            self.paths = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
            self.hits = torch.zeros(len(self.paths), dtype=torch.float64)
            self.depth = max(len(p) for p in self.paths)
        else:
            self.hits = torch.zeros(depth, max_nodes, dtype=torch.float64)  # [depth limit, rank]
            self.depth = depth
        self.steps = 0  # (step, row) pairs counted
        self.counted_accepted = 0  # drafted tokens accepted in them
        self.accepted: list[int] = []  # drafted tokens accepted per (step, row), in the engine's order

    def __call__(self, tree, acc, budget) -> None:
        # budget: [B] the depth each row's tree was cut to
        lengths = acc.length.tolist()
        self.accepted.extend(n - 1 for n in lengths)
        whole = (budget >= self.depth) & tree.valid.all(1)  # [B]
        if not whole.any():
            return
        if self.mode == "static" and tree.num_nodes != len(self.paths) + 1:
            raise ValueError(f"the drafter verified {tree.num_nodes - 1} nodes, not the {len(self.paths)} paths "
                             "being calibrated: pass it the same static tree")
        if self.mode == "dynamic" and tree.scores is None:
            raise ValueError("dynamic calibration ranks nodes by the drafter's scores, and this drafter's trees "
                             "carry none: calibrate EAGLE's dynamic tree, or a static tree (mode='static')")
        depth = tree.depth_and_ancestors()[0] if self.mode == "dynamic" else None
        for row in whole.nonzero()[:, 0].tolist():
            nodes = acc.path[row, 1:lengths[row]].cpu()  # accepted drafted nodes, shallowest first
            self.steps += 1
            self.counted_accepted += len(nodes)
            if self.mode == "static":
                self.hits[nodes - 1] += 1
            else:
                self._count_ranks(tree.scores[row].cpu(), depth[row].cpu(), nodes)

    def _count_ranks(self, scores: torch.Tensor, depth: torch.Tensor, nodes: torch.Tensor) -> None:
        # scores, depth: [N] per node of the verified tree; nodes: the accepted drafted ones
        order = scores[1:].sort(descending=True, stable=True).indices + 1  # drafted nodes, best first (keep_best's)
        for limit in range(1, self.hits.shape[0] + 1):
            ranked = order[depth[order] <= limit]
            rank = torch.full_like(scores, -1, dtype=torch.long)
            rank[ranked] = torch.arange(len(ranked))
            r = rank[nodes]
            r = r[(r >= 0) & (r < self.max_nodes)]
            self.hits[limit - 1, r] += 1

    def statistics(self) -> dict:
        """{"mode", "steps", "mean_accepted" (drafts per counted step, the wide tree's) and "p_accept"
        (static, per path) or "p_rank" (dynamic, per depth limit and rank)}."""
        if self.steps == 0:
            raise ValueError("no verify step could be counted (every tree was cut by the token budget): give "
                             "more prompts or a larger max_new_tokens")
        p = [round(x, 6) for x in (self.hits / self.steps).flatten().tolist()]
        out = {"mode": self.mode, "steps": self.steps, "mean_accepted": round(self.counted_accepted / self.steps, 6)}
        if self.mode == "static":
            return {**out, "p_accept": p}
        width = self.hits.shape[1]
        return {**out, "p_rank": [p[i:i + width] for i in range(0, len(p), width)]}


def calibratable(config) -> bool:
    """Whether calibration can choose this drafter's tree: static paths or EAGLE's dynamic tree (a block
    drafter's chain has no paths to choose among)."""
    return "paths" in config.TREE_DEFAULTS


def wide_tree(config, mode: str | None = None, *, wide: int = WIDE, depth: int | None = None,
              top_k: int | None = None) -> dict:
    """The tree settings acceptance is measured on: the `wide` best paths of a generous prior for a static
    tree (Medusa, EAGLE-1), or for EAGLE-2's dynamic tree its `wide` best-scored nodes. `depth` and `top_k`
    default to the drafter's own; the early stop is off (its tree would depend on the confidence)."""
    tree, known = config.tree, config.TREE_DEFAULTS
    if not calibratable(config):
        raise ValueError(f"calibration chooses static paths or EAGLE's dynamic tree; a {config.model_type} "
                         f"drafter's tree has settings {sorted(known)}")
    dynamic_capable = "mode" in known
    mode = mode or (tree["mode"] if dynamic_capable else "static")
    if mode == "dynamic" and not dynamic_capable:
        raise ValueError(f"a {config.model_type} drafter drafts static trees only; calibrate with mode='static'")
    if mode == "dynamic":
        return {"mode": "dynamic", "top_k": top_k or tree["top_k"],
                "depth": depth or max(tree["depth"], _measured_depth(config)), "total_tokens": wide,
                "min_confidence": 0.0}
    if mode != "static":
        raise ValueError(f"calibration mode must be 'static' or 'dynamic', got {mode!r}")
    if depth is None:
        depth = max(len(p) for p in tree["paths"]) if tree.get("paths") else tree["depth"]
    paths = [list(p) for p in prior_paths(depth, wide, top1=0.8, decay=0.9, spread=0.3)]
    return {"mode": "static", "paths": paths, "min_confidence": 0.0} if dynamic_capable else {"paths": paths}


def _measured_depth(config) -> int:
    """The deepest tree an earlier calibration measured acceptance on (0: none). `--write` stores the tree it
    chose, which may be shallow on a machine where verifying is dear; measuring again only that deep would
    keep a later calibration, on a machine where deeper trees pay, from ever seeing them."""
    measured = (getattr(config, "calibration", None) or {}).get("measured") or []
    return max((tree_depth(m["tree"]) for m in measured if "tree" in m), default=0)


def measure_acceptance(target, drafter, prompts: list[torch.Tensor], tree: dict, *, max_new_tokens: int = 64,
                       max_nodes: int = MAX_NODES, tokenizer=None, prepack: bool | None = None) -> dict:
    """Greedy generation of every prompt ([1, T] ids) with `drafter` (a heads model) drafting `tree`; the
    acceptance statistics as one entry of `config.calibration["measured"]`."""
    mode = tree.get("mode", "static")
    if mode == "dynamic" and tree["total_tokens"] < max_nodes:
        raise ValueError(f"a dynamic tree keeping {tree['total_tokens']} nodes cannot rank {max_nodes}: measure "
                         f"with total_tokens >= max_nodes")
    recorder = AcceptanceRecorder(mode, paths=tree.get("paths"), depth=tree.get("depth"), max_nodes=max_nodes)
    model = engine(target, drafter, tokenizer=tokenizer, tree=tree, cpu_prepack=prepack, lookup_first=False,
                   step_observer=recorder, draft_batches=True)  # the recorder needs drafts
    for ids in prompts:
        model.generate(ids, max_new_tokens=max_new_tokens)
    return {**recorder.statistics(), "tree": tree}


def measure_lookup_first(target, drafter, prompts: list[torch.Tensor], tree: dict, *, max_new_tokens: int = 64,
                         tokenizer=None, prepack: bool | None = None) -> dict:
    """Whether prompt lookup first (`infer.drafters.LookupFirstDrafter`) makes `drafter` (a heads model)
    drafting `tree` faster on this machine, and whether drafting pays at all: greedy generation of every prompt
    three ways, the drafter alone, with lookup first, and with no drafts (`infer.drafters.NoDrafter`: one token a
    target forward through the same engine), interleaved prompt by prompt with the order turning, after a warm-up
    of each. Returns per way the new tokens, target forwards and seconds; `pays`: lookup first made more tokens a
    second than the drafter alone; `drafting_pays`: the faster of those two made more than no drafts. Unlike the
    tree, this is a timing of whole generations, so it holds for the machine it ran on."""
    if not prompts:
        raise ValueError("measuring prompt lookup first needs at least one held-out prompt")
    models = {way: engine(target, drafter, tokenizer=tokenizer, tree=tree, cpu_prepack=prepack,
                          lookup_first=way == "lookup_first") for way in ("alone", "lookup_first")}
    models["no_drafts"] = engine(target, NoDrafter(), tokenizer=tokenizer, cpu_prepack=prepack)
    totals = {way: {"new_tokens": 0, "target_forwards": 0, "seconds": 0.0} for way in models}
    for model in models.values():
        model.generate(prompts[0], max_new_tokens=min(8, max_new_tokens))
    ways = list(models)
    for i, ids in enumerate(prompts):
        for way in ways[i % len(ways):] + ways[:i % len(ways)]:
            run = functools.partial(models[way].generate, ids, max_new_tokens=max_new_tokens)
            totals[way]["seconds"] += seconds(run, target.device)
            stats = models[way].last_stats
            totals[way]["new_tokens"] += stats["new_tokens"]
            totals[way]["target_forwards"] += stats["target_forwards"]
    for entry in totals.values():
        entry["tokens_per_second"] = entry["new_tokens"] / entry["seconds"]
    speed = {way: entry["tokens_per_second"] for way, entry in totals.items()}
    return {**totals, "pays": speed["lookup_first"] > speed["alone"],
            "drafting_pays": max(speed["alone"], speed["lookup_first"]) > speed["no_drafts"], "tree": tree,
            "prompts": len(prompts), "max_new_tokens": max_new_tokens, "device": device_name(target.device),
            "threads": torch.get_num_threads()}


