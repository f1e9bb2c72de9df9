"""The training-free drafters and their trie: valid trees within budget, the expected drafts on
repeated text, and more than one accepted draft per round against a simulated greedy target."""
from __future__ import annotations

import random
from typing import Sequence

import pytest

from shared.drafting import DRAFTERS, make_drafter
from shared.drafting.base import Drafter, ReadsActivations, reads_activations
from shared.drafting.trie import TokenTrie
from shared.tree import ROOT, DraftTree

VOCAB = 1000
MAX_DEPTH = 64


def random_text(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def phrase_text(n: int, seed: int, phrases: int = 6, phrase_len: int = 8) -> list[int]:
    """Text stitched from a few fixed phrases in random order: repetitive, yet branching."""
    rng = random.Random(seed)
    book = [random_text(phrase_len, VOCAB, seed * 100 + i) for i in range(phrases)]
    text: list[int] = []
    while len(text) < n:
        text.extend(rng.choice(book))
    return text[:n]


def paths(tree: DraftTree) -> set[tuple[int, ...]]:
    return {tuple(tree.path_tokens(i)) for i in range(len(tree))}


def greedy_accept(tree: DraftTree, target: Sequence[int], start: int) -> tuple[int, ...]:
    """Walks the tree along `target` from position `start`, as greedy verification would,
    leaving the last target token for the target's own (bonus) token."""
    accepted: list[int] = []
    node, pos = ROOT, start
    while pos < len(target) - 1:
        match = [c for c in tree.children(node) if tree.tokens[c] == target[pos]]
        if not match:
            break
        node = match[0]
        accepted.append(node)
        pos += 1
    return tuple(accepted)


def simulate(drafter: Drafter, target: Sequence[int], prompt_len: int, max_nodes: int) -> float:
    """Mean accepted drafts per round when `target` is what the target model would say."""
    context = list(target[:prompt_len])
    drafter.reset(context)
    context.append(target[prompt_len])  # the prefill's token: no verdict reports it to observe
    rounds = accepted_total = 0
    while len(context) < len(target):
        tree = drafter.propose(context, max_nodes) or DraftTree.chain([context[-1]])
        tree.validate(VOCAB, max_nodes, MAX_DEPTH)
        accepted = greedy_accept(tree, target, len(context))
        tokens = (*(tree.tokens[n] for n in accepted), target[len(context) + len(accepted)])
        drafter.observe(list(context), tree, accepted, tokens)
        context.extend(tokens)
        rounds += 1
        accepted_total += len(accepted)
    assert context == list(target)
    return accepted_total / rounds


@pytest.mark.parametrize("name", sorted(DRAFTERS))
@pytest.mark.parametrize("max_nodes", [1, 2, 7, 32, 64])
@pytest.mark.parametrize("kind", ["random", "repetitive"])
def test_trees_are_valid_and_within_budget(name: str, max_nodes: int, kind: str):
    text = random_text(600, 40, seed=1) if kind == "random" else phrase_text(600, seed=1)
    drafter = make_drafter(name)
    drafter.reset(text[:200])
    for end in range(201, 600, 37):
        tree = drafter.propose(text[:end], max_nodes)
        assert len(tree) <= max_nodes
        if len(tree):
            tree.validate(VOCAB, max_nodes, MAX_DEPTH)
        drafter.observe(text[:end], tree, (), (text[end],))
    if kind == "repetitive":
        assert len(tree) >= min(max_nodes, 8)


def test_pld_proposes_what_followed_the_last_ngram():
    context = [1, 2, 5, 6, 7, 8, 9, 10, 3, 4, 6, 7, 11, 12, 3, 5, 6, 7]
    drafter = make_drafter("pld")
    drafter.reset(context)
    tree = drafter.propose(context, 16)
    assert tree.tokens[:2] == (8, 9)  # the longest, 3-token match ranks first
    assert (8, 9, 10, 3, 4) in paths(tree)
    assert (11, 12) in paths(tree)  # the shorter "6 7" match adds a branch


def test_pld_index_follows_the_growing_context():
    drafter = make_drafter("pld")
    drafter.reset([1, 2, 3])
    assert len(drafter.propose([1, 2, 3], 8)) == 0
    tree = drafter.propose([1, 2, 3, 4, 1, 2], 8)  # grown without an observe
    assert (3, 4, 1, 2) in paths(tree)


def test_aded_learns_a_pattern_from_committed_text():
    prompt = random_text(50, VOCAB, seed=3)
    pattern = [900, 901, 902, 903, 904, 905]
    drafter = make_drafter("aded")
    drafter.reset(prompt)
    context = list(prompt)
    assert len(drafter.propose(context + pattern[:2], 8)) == 0  # not in the prompt
    for token in pattern * 3:
        tree = drafter.propose(context, 8)
        drafter.observe(list(context), tree, (), (token,))
        context.append(token)
    tree = drafter.propose(context + pattern[:2], 8)
    assert tuple(tree.tokens[:4]) == (902, 903, 904, 905)


def test_aded_forgets_old_counts():
    old, new = [7, 8, 9], [7, 8, 10]
    filler = random_text(800, 500, seed=4)
    text = old * 3 + filler + new * 2 + [7, 8]
    drafter = make_drafter("aded")
    drafter.reset(text)
    tree = drafter.propose(text, 2)
    assert tree.tokens[0] == 10  # two recent sightings outweigh three long-decayed ones


def test_trie_merges_shared_prefixes():
    trie = TokenTrie()
    trie.add_path([1, 2, 3], [1.0, 1.0, 1.0])
    trie.add_path([1, 2, 4], [1.0, 1.0, 0.5])
    trie.add_path([1, 2, 3], [1.0, 1.0, 1.0])
    tree = trie.best_tree(10)
    assert tree == DraftTree((1, 2, 3, 4), (ROOT, 0, 1, 1))
    tree.validate(VOCAB, 10, MAX_DEPTH)


def test_trie_keeps_the_best_nodes_parents_first():
    trie = TokenTrie()
    trie.add_path([1, 2, 3], [1.0, 1.0, 1.0])
    trie.add_path([5, 6], [2.0, 2.0])
    assert trie.best_tree(2) == DraftTree((5, 6), (ROOT, 0))
    assert trie.best_tree(3) == DraftTree((5, 6, 1), (ROOT, 0, ROOT))
    deep = TokenTrie()
    deep.add_path([1, 2], [0.1, 5.0])  # a child scored above its parent still waits for it
    deep.add_path([3], [1.0])
    assert deep.best_tree(1) == DraftTree((3,), (ROOT,))
    assert deep.best_tree(3) == DraftTree((3, 1, 2), (ROOT, ROOT, 1))
    assert len(deep.best_tree(0)) == 0


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_a_training_free_drafter_only_proposes_and_observes(name: str):
    """Reading the server's activations is a capability of its own (ReadsActivations), which
    the text-only drafters lack."""
    drafter = make_drafter(name)
    assert not isinstance(drafter, ReadsActivations) and not reads_activations(drafter)
    assert not reads_activations(None)


def test_make_drafter_rejects_unknown_names():
    assert sorted(DRAFTERS) == ["aded", "pld"]
    with pytest.raises(ValueError, match="unknown drafter 'x'; choose from: aded, pld"):
        make_drafter("x")


@pytest.mark.parametrize("name", sorted(DRAFTERS))
@pytest.mark.parametrize("depth_limit", [1, 3, 64])
def test_depth_limit_caps_tree_depth(name: str, depth_limit: int):
    text = phrase_text(400, seed=2)
    drafter = make_drafter(name, depth_limit=depth_limit)
    drafter.reset(text)
    tree = drafter.propose(text, 64)
    tree.validate(VOCAB, 64, depth_limit)
    assert drafter.max_depth <= depth_limit


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_more_than_one_draft_accepted_per_round_on_repetitive_text(name: str):
    target = phrase_text(1200, seed=5)
    assert simulate(make_drafter(name), target, prompt_len=60, max_nodes=16) > 1.0


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_simulation_is_deterministic(name: str):
    target = phrase_text(300, seed=6)
    runs = [simulate(make_drafter(name), target, prompt_len=40, max_nodes=8) for _ in range(2)]
    assert runs[0] == runs[1]
