"""The engine's defining property: greedy speculative output == the target's own greedy `generate`.

Every architecture, every drafter kind that needs no training, batch 1 and a left-padded batch; plus
scripted drafters that force never / always / partly accepted paths through trees.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import ARCHITECTURES, VOCAB, perturbed_copy, tiny_model

from infer import DraftModelDrafter, DraftTree, LookupFirstDrafter, SelfSpecModel
from infer.drafters import NgramDrafter
from infer.drafters.staged import StagedDrafter
from infer.drafting import Drafter, TargetStep
from infer.tree import ScoredNodes


def left_pad(seqs: list[list[int]], pad: int = 0):
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s)
        mask[i, width - len(s):] = 1
    return ids, mask


def prompts(batch: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [7] if batch == 1 else [5, 12, 8][:batch]
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


DRAFTERS = {
    "ngram": lambda target: "ngram",
    "none": lambda target: "none",  # no drafts: the engine's own forward, one token a step
    "draft_model": lambda target: perturbed_copy(target),
    "unrelated_draft_model": lambda target: tiny_model(target.config.model_type, seed=11),
    "lookup_first": lambda target: LookupFirstDrafter(DraftModelDrafter(perturbed_copy(target)), min_match=1),
    "adaptive_draft_model": lambda target: DraftModelDrafter(perturbed_copy(target), num_tokens=6, adaptive=True),
    # the target's own weights (infer/drafters/self_draft.py), reached by name
    "bf16": lambda target: "bf16",
    "int8": lambda target: "int8",
    "early_exit": lambda target: "early_exit:2",
    "int4": lambda target: "int4",
    "layerskip": lambda target: "layerskip",  # skip count searched per request
    "layerskip_fixed": lambda target: "layerskip:0.5",
    "staged": lambda target: "staged:bf16+ngram",
    "suffix": lambda target: "suffix",
    "suffix_fallback": lambda target: "suffix:early_exit:2",  # early exit where the suffix match is short
    "lookahead": lambda target: "lookahead",  # Fu et al.'s window 15, n-gram 5, 15 guesses
    "lookahead_small": lambda target: "lookahead:3,2,2",  # one window level, bigram guesses
}


def test_staged_drafting_saves_draft_forwards_and_stays_exact():
    """Prompt lookup guesses for the draft model; once the text repeats itself, the draft model confirms
    several guessed tokens per forward, and its drafts stay its own greedy tokens (output exact)."""

    def markov(model):  # attention outputs zeroed: the next token depends on the last one only, so
        with torch.no_grad():  # greedy text falls into a cycle that prompt lookup can predict
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
        return model

    target = markov(tiny_model("llama"))
    ids = torch.tensor([[5, 9, 14, 22, 31]])
    expected = target.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=[])
    plain = SelfSpecModel(target, DraftModelDrafter(markov(perturbed_copy(target)), num_tokens=6))
    staged = SelfSpecModel(target, StagedDrafter(markov(perturbed_copy(target)), num_tokens=6, adaptive=False))
    calls = {}
    for name, model in (("plain", plain), ("staged", staged)):
        calls[name] = 0

        def count(*_, name=name):
            calls[name] += 1

        hook = model.drafter.model.register_forward_pre_hook(count)
        assert torch.equal(model.generate(ids, max_new_tokens=40, eos_token_id=[]), expected)
        hook.remove()
    assert staged.last_stats["mean_accepted_length"] == pytest.approx(plain.last_stats["mean_accepted_length"])
    assert calls["staged"] < calls["plain"], calls


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_greedy_equals_target_generate(arch, drafter, batch):
    target = tiny_model(arch)
    ids, mask = left_pad(prompts(batch))
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    model = SelfSpecModel(target, DRAFTERS[drafter](target))
    got = model.generate(ids, attention_mask=mask, max_new_tokens=24)
    assert got.shape == expected.shape
    assert torch.equal(got, expected)
    stats = model.last_stats
    assert batch <= stats["new_tokens"] <= batch * 24
    assert stats["mean_accepted_length"] >= 1
    assert len(stats["accepted_lengths"]) >= stats["target_forwards"] - 1


def test_batch_matches_each_prompt_alone(arch):
    """Rows of a padded batch decode as they would alone (true semantics, sliding windows included)."""
    target = tiny_model(arch)
    seqs = prompts(3)
    ids, mask = left_pad(seqs)
    got = SelfSpecModel(target, perturbed_copy(target)).generate(ids, attention_mask=mask, max_new_tokens=30,
                                                                 eos_token_id=[])
    for row, seq in enumerate(seqs):
        alone = target.generate(torch.tensor([seq]), max_new_tokens=30, do_sample=False, eos_token_id=None,
                                pad_token_id=0)
        alone_new = alone[0, len(seq):]
        assert got[row, ids.shape[1]:ids.shape[1] + len(alone_new)].tolist() == alone_new.tolist()


def test_draft_model_copy_accepts_everything():
    target = tiny_model("llama")
    ids = torch.tensor([prompts(1)[0]])
    model = SelfSpecModel(target, tiny_model("llama"))  # same seed: an exact copy
    expected = target.generate(ids, max_new_tokens=21, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(model.generate(ids, max_new_tokens=21, eos_token_id=[]), expected)
    # 4 drafts + 1 bonus per verify: prefill gives 1 token, then 4 verifies of 5 tokens each.
    assert model.last_stats["accepted_lengths"] == [5, 5, 5, 5]
    assert model.last_stats["target_forwards"] == 5


class ScriptedTree(Drafter):
    """Proposes a fixed-shape tree whose nodes come from a reference continuation.

    `paths` lists tree nodes as (depth, correct?) choices: a node on the reference path gets the
    reference token, any other node gets a token the target would not choose.
    """

    def __init__(self, reference: list[int], parents: list[int], on_path: list[bool]):
        self.reference, self.parents, self.on_path = reference, parents, on_path

    def bind(self, target, sampling, batch_size, generator=None):
        super().bind(target, sampling, batch_size, generator)
        self.emitted = 0

    def observe(self, step: TargetStep) -> None:
        self.emitted += int(step.valid[0].sum()) if self.emitted else 1
        self.root = step.next_tokens

    def propose(self, budget):
        depth = [0]
        for p in self.parents[1:]:
            depth.append(depth[p] + 1)
        tokens = []
        for node, d in enumerate(depth):
            if node == 0:
                tokens.append(int(self.root[0]))
                continue
            truth = self.reference[self.emitted - 1 + d] if self.emitted - 1 + d < len(self.reference) else 0
            tokens.append(truth if self.on_path[node] else (truth + 1 + node) % VOCAB)
        return DraftTree(tokens=torch.tensor([tokens]), parents=torch.tensor([self.parents]),
                         valid=torch.ones(1, len(tokens), dtype=torch.bool))


@pytest.mark.parametrize("case,parents,on_path,accepted", [
    # never: two wrong siblings, each with a wrong child
    ("never", [-1, 0, 0, 1, 2], [True, False, False, False, False], 1),
    # always: the correct chain of depth 3 sits in the second branch
    ("always", [-1, 0, 0, 2, 3], [True, False, True, True, True], 4),
    # partly: correct at depth 1 and 2, then only wrong children
    ("partly", [-1, 0, 1, 2, 2, 0], [True, True, True, False, False, False], 3),
])
def test_scripted_trees(case, parents, on_path, accepted):
    target = tiny_model("qwen2")
    ids = torch.tensor([prompts(1)[0]])
    expected = target.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)
    reference = expected[0, ids.shape[1]:].tolist()
    model = SelfSpecModel(target, ScriptedTree(reference, parents, on_path))
    got = model.generate(ids, max_new_tokens=30, eos_token_id=[])
    assert torch.equal(got, expected)
    steps = model.last_stats["accepted_lengths"]
    assert all(s == accepted for s in steps[:-1]), steps  # the last step may be cut by max_new_tokens


def test_ngram_speculates_on_repetitive_output():
    target = tiny_model("gemma2")  # this random gemma2 falls into a repeating loop
    ids = torch.tensor([prompts(1)[0]])
    model = SelfSpecModel(target, NgramDrafter(num_tokens=8))
    expected = target.generate(ids, max_new_tokens=60, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(model.generate(ids, max_new_tokens=60, eos_token_id=[]), expected)
    assert model.last_stats["mean_accepted_length"] > 3.0


def test_ngram_lookup_finds_latest_match():
    d = NgramDrafter(num_tokens=3, max_ngram=2)
    ctx = np.array([5, 6, 7, 8, 5, 6, 9, 1, 5, 6])
    assert [x.tolist() if isinstance(x, np.ndarray) else x for x in d._lookup(ctx, 3)] == [[9, 1, 5], 2]
    # the later match has only 4 tokens after it
    assert [x.tolist() if isinstance(x, np.ndarray) else x for x in d._lookup(ctx, 5)] == [[7, 8, 5, 6, 9], 2]
    assert d._lookup(np.array([1, 2, 3]), 3)[1] == 0
    assert d._lookup(np.array([4, 2, 3, 2]), 3)[1] == 1


def _lookup_by_hand(ctx: list[int], k: int, max_ngram: int, min_ngram: int) -> tuple[list[int], int]:
    """Prompt lookup written out: the longest suffix (max_ngram down to min_ngram) that occurs earlier with a token
    after it; of its occurrences, the latest of those with the most tokens after them (at most k)."""
    for n in range(min(max_ngram, len(ctx) - 1), min_ngram - 1, -1):
        starts = [i for i in range(len(ctx) - n) if ctx[i:i + n] == ctx[-n:]]
        if starts:
            room = {i: min(len(ctx) - (i + n), k) for i in starts}
            best = max(i for i in starts if room[i] == max(room.values()))
            return ctx[best + n:best + n + k], n
    return [], 0


def test_ngram_lookup_is_the_lookup_written_out():
    rng = np.random.default_rng(0)
    for trial in range(300):
        ctx = rng.integers(0, 4, size=int(rng.integers(1, 40))).tolist()  # 4 tokens: many repeats
        k, max_ngram = int(rng.integers(1, 9)), int(rng.integers(1, 5))
        d = NgramDrafter(num_tokens=8, max_ngram=max_ngram)
        got, n = d._lookup(np.array(ctx, dtype=np.int64), k)
        assert (got.tolist(), n) == _lookup_by_hand(ctx, k, max_ngram, 1), (trial, ctx, k, max_ngram)


class RootAnd50(Drafter):
    """A scripted primary drafter for two rows: the root with one child, token 50."""

    pure_propose = True

    def observe(self, step):
        self.roots = step.next_tokens

    def propose(self, budget):
        return DraftTree(torch.stack([self.roots, self.roots * 0 + 50], 1), torch.tensor([[-1, 0]] * 2),
                         torch.ones(2, 2, dtype=torch.bool))


def test_lookup_first_takes_the_chain_only_on_a_long_enough_match():
    d = LookupFirstDrafter(RootAnd50(), min_match=2)
    d.bind(None, None, 2)
    # with their roots, row 0 ends in a repeated bigram (8 9), row 1 in a repeated unigram (2)
    seqs = torch.tensor([[7, 8, 9, 1, 7, 8], [7, 8, 9, 1, 2, 3]])
    d.observe(TargetStep(seqs, torch.ones_like(seqs, dtype=torch.bool), (), torch.tensor([9, 2])))
    tree = d.propose(torch.tensor([5, 5]))
    assert tree.tokens[0][tree.valid[0]].tolist() == [9, 1, 7, 8, 9]  # the copy of "7 8 | 9 1 7 8 ..."
    assert tree.tokens[1][tree.valid[1]].tolist() == [2, 50]  # a unigram match only: the primary's tree


def test_eos_stops_rows_and_pads_like_generate():
    target = tiny_model("qwen3")  # emits its eos (2) early for these prompts
    ids, mask = left_pad(prompts(3, seed=5))
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    got = SelfSpecModel(target, perturbed_copy(target)).generate(ids, attention_mask=mask, max_new_tokens=20)
    assert torch.equal(got, expected)


def test_several_eos_ids():
    target = tiny_model("llama")
    ids = torch.tensor([prompts(1)[0]])
    free = target.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    new = free[0, ids.shape[1]:].tolist()
    stops = [new[5], new[9]]
    expected = target.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=stops, pad_token_id=0)
    got = SelfSpecModel(target, tiny_model("llama")).generate(ids, max_new_tokens=20, eos_token_id=stops,
                                                              pad_token_id=0)
    assert torch.equal(got, expected)
    assert got.shape[1] == ids.shape[1] + 6


def test_context_length_caps_generation():
    target = tiny_model("llama", max_position_embeddings=16)
    ids = torch.tensor([prompts(1)[0]])  # 7 tokens
    got = SelfSpecModel(target, "ngram").generate(ids, max_new_tokens=50, eos_token_id=[])
    assert got.shape[1] == 16


def test_streamer_sees_every_token():
    class Collect:
        def __init__(self):
            self.chunks = []
            self.ended = False

        def put(self, value):
            self.chunks.append(value.tolist())

        def end(self):
            self.ended = True

    target = tiny_model("llama")
    ids = torch.tensor([prompts(1)[0]])
    streamer = Collect()
    got = SelfSpecModel(target, tiny_model("llama")).generate(ids, max_new_tokens=12, streamer=streamer,
                                                              eos_token_id=[])
    assert streamer.chunks[0] == ids.tolist()
    assert sum(streamer.chunks[1:], []) == got[0, ids.shape[1]:].tolist()
    assert streamer.ended


def test_text_streamer_from_transformers(capsys):
    from transformers import TextStreamer

    class Tok:  # the least a TextStreamer needs
        def decode(self, ids, **kw):
            return "".join(f"<{i}>" for i in ids)

    target = tiny_model("llama")
    ids = torch.tensor([prompts(1)[0]])
    got = SelfSpecModel(target, "ngram").generate(ids, max_new_tokens=6, eos_token_id=[],
                                                  streamer=TextStreamer(Tok(), skip_prompt=True))
    printed = capsys.readouterr().out
    assert printed.strip() == "".join(f"<{i}>" for i in got[0, ids.shape[1]:].tolist())


def test_typical_acceptance_is_opt_in():
    target = tiny_model("llama")
    assert SelfSpecModel(target, "ngram").typical_acceptance is False
    ids = torch.tensor([prompts(1)[0]])
    out = SelfSpecModel(target, perturbed_copy(target), typical_acceptance=True).generate(
        ids, max_new_tokens=10, do_sample=True, eos_token_id=[], generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, ids.shape[1] + 10)


# ------------------------------------------------------------------ bad input
@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


class _Sink:
    def put(self, value):
        pass

    def end(self):
        pass


@pytest.mark.parametrize("kwargs,match", [
    (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), "non-empty prompt"),
    (dict(input_ids=torch.ones(1, 5, dtype=torch.long), max_new_tokens=0), "max_new_tokens"),
    (dict(input_ids=torch.ones(1, 5, dtype=torch.long), max_new_tokens=-3), "max_new_tokens"),
    (dict(input_ids=torch.ones(1, 5, dtype=torch.long), attention_mask=torch.ones(1, 4)), "attention_mask shape"),
    (dict(input_ids=torch.ones(1, 5, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 1, 0, 0]])),
     "left-padded"),
    (dict(input_ids=torch.ones(2, 3, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]])),
     "empty"),
    (dict(input_ids=torch.ones(1, 300, dtype=torch.long)), "context"),
    (dict(input_ids=torch.full((1, 3), VOCAB, dtype=torch.long)), "vocabulary"),
    (dict(input_ids=torch.ones(1, 3, dtype=torch.long), do_sample=True, temperature=0.0), "temperature"),
    (dict(input_ids=torch.ones(1, 3, dtype=torch.long), do_sample=True, top_p=1.5), "top_p"),
    (dict(input_ids=torch.ones(2, 3, dtype=torch.long), streamer=_Sink()), "batch size 1"),
])
def test_bad_generate_input(llama, kwargs, match):
    kwargs.setdefault("max_new_tokens", 5)
    with pytest.raises(ValueError, match=match):
        SelfSpecModel(llama, "ngram").generate(**kwargs)


def test_float_ids_rejected(llama):
    with pytest.raises(TypeError, match="LongTensor"):
        SelfSpecModel(llama, "ngram").generate(torch.ones(1, 3), max_new_tokens=3)


def test_unknown_drafter(llama):
    with pytest.raises(ValueError, match="unknown drafter"):
        SelfSpecModel(llama, "medusa-please")
    with pytest.raises(TypeError, match="cannot draft"):
        SelfSpecModel(llama, 42)


def test_draft_model_with_other_vocab(llama):
    with pytest.raises(ValueError, match="vocab_size"):
        SelfSpecModel(llama, tiny_model("llama", vocab_size=VOCAB + 5))


def test_unsupported_generation_config(llama):
    from transformers import GenerationConfig

    with pytest.raises(ValueError, match="num_beams"):
        SelfSpecModel(llama, "ngram").generate(torch.ones(1, 3, dtype=torch.long),
                                               generation_config=GenerationConfig(num_beams=4, max_new_tokens=3))


def test_attention_without_4d_masks_runs_sdpa_during_generate_only():
    target = tiny_model("llama")
    ids = torch.tensor([[5, 9, 14, 5]])
    expected = target.generate(ids, max_new_tokens=8, do_sample=False)
    target.config._attn_implementation = "flash_attention_2"  # as if loaded that way; not installed here
    with pytest.warns(UserWarning, match="runs with 'sdpa' during generate"):
        model = SelfSpecModel(target, "ngram")
    assert target.config._attn_implementation == "flash_attention_2"
    assert torch.equal(model.generate(ids, max_new_tokens=8), expected)
    assert target.config._attn_implementation == "flash_attention_2"  # the user's setting, back


@pytest.mark.parametrize("arch_name", sorted(ARCHITECTURES))
def test_eager_attention_too(arch_name):
    target = tiny_model(arch_name, attn_implementation="eager")
    ids, mask = left_pad(prompts(3))
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    got = SelfSpecModel(target, perturbed_copy(target)).generate(ids, attention_mask=mask, max_new_tokens=12)
    assert torch.equal(got, expected)


# ------------------------------------------------------------------ scored nodes (never accepted)
class WithScored(Drafter):
    """Another drafter's trees plus scored nodes: `make(tree, context, gen)` returns (tokens, offsets,
    attend, valid) for them, or None for none. Records every step's scored logits with what they saw."""

    def __init__(self, inner: Drafter, make):
        self.inner, self.make = inner, make
        self.feature_layers = inner.feature_layers

    def bind(self, target, sampling, batch_size, generator=None):
        super().bind(target, sampling, batch_size, generator)
        self.inner.bind(target, sampling, batch_size, generator)
        self.gen = torch.Generator().manual_seed(0)
        self.context = [[] for _ in range(batch_size)]
        self.sizes, self.records, self.last = [], [], None

    def observe(self, step: TargetStep) -> None:
        if step.scored_logits is not None:
            self.records.append((self.last, [list(c) for c in self.context], step.scored_logits.clone(),
                                 step.scored_valid.clone()))
        for b, ctx in enumerate(self.context):
            ctx.extend(step.tokens[b][step.valid[b]].tolist())
        self.inner.observe(step)

    def propose(self, budget):
        tree = self.inner.propose(budget)
        self.sizes.append(tree.num_nodes)
        made = self.make(tree, self.gen)
        if made is None:
            return tree
        tree = DraftTree(tree.tokens, tree.parents, tree.valid, tree.q, ScoredNodes(*made))
        self.last = tree
        return tree

    def select_rows(self, rows):
        self.inner.select_rows(rows)
        self.context = [self.context[int(r)] for r in rows]


def random_scored(count: int):
    """Random tokens, offsets and attention rows (not a tree), some nodes invalid."""

    def make(tree, gen):
        b, n = tree.tokens.shape
        tokens = torch.randint(0, VOCAB, (b, count), generator=gen)
        offsets = torch.randint(0, 8, (b, count), generator=gen)
        attend = torch.rand(b, count, n + count, generator=gen) < 0.5
        valid = torch.rand(b, count, generator=gen) < 0.8
        return tokens, offsets, attend, valid

    return make


@pytest.mark.parametrize("batch", [1, 3])
def test_scored_nodes_change_neither_output_nor_tree_logits(arch, batch):
    """Random scored nodes in every verify forward: output still equals target.generate, and the tree
    nodes' logits are those of the same run without them."""
    target = tiny_model(arch)
    ids, mask = left_pad(prompts(batch))
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    draft = perturbed_copy(target)
    logits = {}
    for count in (0, 7):
        drafter = WithScored(DraftModelDrafter(draft), random_scored(count) if count else lambda t, g: None)
        seen = []
        hook = target.register_forward_hook(lambda m, a, out, seen=seen: seen.append(out.logits.clone()))
        got = SelfSpecModel(target, drafter).generate(ids, attention_mask=mask, max_new_tokens=20)
        hook.remove()
        assert torch.equal(got, expected)
        # seen[0] is the prefill; then one forward per proposed tree, its first N positions the tree nodes
        logits[count] = [out[:, :n] for out, n in zip(seen[1:], drafter.sizes, strict=True)]
        if count:
            assert drafter.records and all(r[2].shape[1] == count for r in drafter.records)
    assert len(logits[0]) == len(logits[7])
    for plain, scored in zip(logits[0], logits[7], strict=True):
        torch.testing.assert_close(scored, plain, atol=1e-4, rtol=1e-4)


# Scored node k sees the root and the scored nodes SEES[k] (itself last), at offsets OFFSETS: a chain of
# three after the root, a sibling of its second node, and one that sees the chain's first node from five
# positions ahead of the root (a gap).
SEES = [[0], [0, 1], [0, 1, 2], [0, 3], [0, 4]]
OFFSETS = [1, 2, 3, 2, 5]


def chain_and_sibling(tree, gen):
    b, n = tree.tokens.shape
    tokens = torch.randint(3, VOCAB, (b, 5), generator=gen)
    attend = torch.zeros(b, 5, n + 5, dtype=torch.bool)
    attend[:, :, 0] = True  # the root
    for k, seen in enumerate(SEES):
        attend[:, k, [n + j for j in seen]] = True
    return tokens, torch.tensor(OFFSETS).expand(b, 5), attend, torch.ones(b, 5, dtype=torch.bool)


@pytest.mark.parametrize("arch_name", ["llama", "gpt2", "gemma2"])
def test_scored_logits_are_the_targets_for_what_each_node_sees(arch_name):
    """Each scored node's logits are the target's own after the committed context, the root and the nodes
    its row names, at the positions given (rows of a padded batch as if alone)."""
    target = tiny_model(arch_name)
    ids, mask = left_pad(prompts(3))
    window = getattr(target.config, "sliding_window", None) or float("inf")
    drafter = WithScored(NgramDrafter(), chain_and_sibling)
    SelfSpecModel(target, drafter).generate(ids, attention_mask=mask, max_new_tokens=12)
    assert len(drafter.records) >= 3
    for tree, context, scored_logits, scored_valid in drafter.records[:3]:
        assert scored_valid.all()
        for b, ctx in enumerate(context):
            for k, seen in enumerate(SEES):
                seq = ctx + [int(tree.tokens[b, 0])] + [int(tree.scored.tokens[b, j]) for j in seen]
                pos = list(range(len(ctx) + 1)) + [len(ctx) + OFFSETS[j] for j in seen]
                if pos[-1] >= window and pos[-1] != len(pos) - 1:
                    continue  # transformers' reference windows by index, the engine by position: a gap differs
                with torch.no_grad():
                    ref = target(torch.tensor([seq]), position_ids=torch.tensor([pos])).logits[0, -1]
                torch.testing.assert_close(scored_logits[b, k], ref, atol=1e-4, rtol=1e-4)


def test_scored_nodes_past_the_budget_are_invalid():
    # learned absolute positions: a scored node placed past the 40-position context would fail
    target = tiny_model("gpt2", n_positions=40)
    ids = torch.tensor([prompts(1)[0]])
    far = lambda tree, gen: (torch.full((1, 2), 5), torch.tensor([[1, 20]]),  # noqa: E731
                             torch.ones(1, 2, tree.num_nodes + 2, dtype=torch.bool), torch.ones(1, 2, dtype=torch.bool))
    drafter = WithScored(NgramDrafter(), far)
    expected = target.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(SelfSpecModel(target, drafter).generate(ids, max_new_tokens=30, eos_token_id=[]), expected)
    valid = [r[3][0].tolist() for r in drafter.records]
    assert valid[0] == [True, True] and [True, False] in valid  # 20 ahead fits early on only


def test_scored_nodes_through_lookup_first():
    """Rows that take the lookup chain keep the primary's scored nodes only where those see no tree node
    but the shared root; output stays exact."""
    target = tiny_model("llama")
    ids, mask = left_pad(prompts(3))
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    for make in (random_scored(6), chain_and_sibling):
        primary = WithScored(DraftModelDrafter(perturbed_copy(target)), make)
        got = SelfSpecModel(target, LookupFirstDrafter(primary, min_match=1)).generate(
            ids, attention_mask=mask, max_new_tokens=40)
        assert torch.equal(got, expected)
        early = primary.records[:4]  # the budget (>= 19) prunes none of them yet
        valid = torch.cat([r[3] for r in early])
        proposed = torch.cat([r[0].scored.valid for r in early])
        sees_tree = torch.cat([r[0].scored.attend[..., 1:r[0].num_nodes].any(-1) for r in early])
        assert torch.equal(valid[~sees_tree], proposed[~sees_tree]) and not (valid & ~proposed).any()
        if make is not chain_and_sibling:
            assert (proposed & sees_tree & ~valid).any()  # some row took the chain


@pytest.mark.parametrize("path", [[0, 1], [0, 2], [0]], ids=["first-child", "second-child", "root-only"])
def test_commit_keeps_exactly_the_accepted_path(path):
    """A commit keeps the accepted path's K/V at the block's start, moved there when it is not already the
    block's first slots, and drops the rest: the cache then equals a plain forward over the kept tokens."""
    from infer.attention import prompt_tree
    from infer.kv import KVState, forward_block

    target = tiny_model("llama")
    ids = torch.tensor([[5, 9, 14, 22, 31]])
    tokens = torch.tensor([[40, 41, 42]])  # root 40 with children 41 and 42
    kv = KVState(1, ids.device, target.config)
    with torch.no_grad():
        depth, ancestors, valid = prompt_tree(torch.ones_like(ids))
        forward_block(target, kv, depth, ancestors, valid, input_ids=ids)
        kv.commit_block(0, valid)
        start = kv.size
        forward_block(target, kv, torch.tensor([[0, 1, 1]]),
                      torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool),
                      torch.ones_like(tokens, dtype=torch.bool), input_ids=tokens)
        kv.commit(start, torch.tensor([path]), torch.ones(1, len(path), dtype=torch.bool))
        kept = torch.cat([ids, tokens[:, path]], dim=1)
        reference = target(kept, use_cache=True)
    assert kv.size == kept.shape[1] and kv.pos[0].tolist() == list(range(kept.shape[1]))
    for layer, ref in zip(kv.cache.layers, reference.past_key_values.layers, strict=True):
        torch.testing.assert_close(layer.keys, ref.keys)
        torch.testing.assert_close(layer.values, ref.values)


# ------------------------------------------------------------------------------------ the prompt's K/V
@pytest.mark.parametrize("drafter", ["early_exit:2", "int8", "bf16"])
def test_self_drafters_take_the_prompts_kv_from_the_target(drafter, monkeypatch):
    """A self-drafter's layers are the target's (or copies of them), so its prefill copies the target's K/V for the
    prompt rather than running the draft model over it; early exit's first layers give the same K/V exactly."""
    target = tiny_model("llama")
    ids = torch.tensor([[5, 9, 14, 5, 9, 14, 5, 9, 20, 33]])
    expected = target.generate(ids, max_new_tokens=16, do_sample=False)
    model = SelfSpecModel(target, drafter)
    draft, blocks = model.drafter, []
    run = draft._runner
    monkeypatch.setattr(draft, "_runner", lambda: blocks.append(1) or run())
    seen = {}
    observe = type(draft).observe

    def spy(self, step):
        first = self.kv.size == 0
        observe(self, step)
        if first:
            seen["target"] = [(layer.keys[:, :, :10].clone(), layer.values[:, :, :10].clone())
                              for layer in step.prompt_cache.layers]
            seen["draft"] = [(layer.keys.clone(), layer.values.clone()) for layer in self.kv.cache.layers]
            seen["blocks"] = len(blocks)

    monkeypatch.setattr(type(draft), "observe", spy)
    assert torch.equal(model.generate(ids, max_new_tokens=16), expected)
    assert seen["blocks"] == 0  # no draft forward over the prompt
    assert len(seen["draft"]) == draft.model.config.num_hidden_layers
    for (k, v), (tk, tv) in zip(seen["draft"], seen["target"], strict=False):
        assert k.dtype == draft.model.dtype
        assert torch.equal(k, tk.to(k.dtype)) and torch.equal(v, tv.to(v.dtype))


def test_a_draft_model_of_its_own_computes_the_prompts_kv_and_a_short_cache_is_not_copied():
    from infer.drafters.draft_model import PromptKV

    target = tiny_model("llama")
    ids = torch.tensor([[5, 9, 14, 5, 9, 14, 5, 9, 20, 33]])
    draft = DraftModelDrafter(perturbed_copy(target), num_tokens=3)  # not told its layers are the target's
    model = SelfSpecModel(target, draft)
    assert torch.equal(model.generate(ids, max_new_tokens=12), target.generate(ids, max_new_tokens=12, do_sample=False))
    assert not draft.prompt_kv_from_target

    class Layer:
        def __init__(self, slots):
            self.keys = self.values = torch.zeros(1, 2, slots, 8)

    class Cache:
        def __init__(self, *slots):
            self.layers = [Layer(s) for s in slots]

    layers = target.config.num_hidden_layers
    assert PromptKV.of(Cache(*[10] * layers), target, 10) is not None
    assert PromptKV.of(Cache(*[10] * (layers - 1), 4), target, 10) is None  # a window kept only 4 slots
    assert PromptKV.of(Cache(*[10] * (layers - 1)), target, 10) is None  # fewer layers than the draft's
    assert PromptKV.of(None, target, 10) is None
