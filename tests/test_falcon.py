"""Falcon's semi-autoregressive drafter (MoaConfig.block > 1): the relaxed causal mask and
glancing of training (cloud_server/training/sar.py), the edge drafting `block` tokens per step
from the exported graphs exactly as training computed them, split decoding with it identical
to plain greedy decoding, and each drafter refusing the other's bundle."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from cloud_server.engine.layer_outputs import LayerOutputs
from cloud_server.moa.config import MoaConfig, ServerInput
from cloud_server.moa.layers import additive_mask
from cloud_server.moa.weights import load_drafter
from cloud_server.reference import compare, plain_greedy
from cloud_server.training.sar import block_ends, glance, relaxed_mask
from edge_client.drafters.falcon import FalconDrafter
from edge_client.client import ClientOptions, EdgeClient
from edge_client.drafters.lookup_merge import LookupMerge
from edge_client.drafters.moa import MoaDrafter
from edge_client.drafters.moa_graphs import MoaGraphs
from edge_client.drafters.trained import trained_drafter
from edge_client.drafters.tree_search import TreeSearch
from edge_client.link import LinkError
from shared.drafter_bundle import FALCON_ARTIFACT, BundleError, Precision
from cloud_server.decoding.server_decoding import decode_in_process
from shared.acceptance import AcceptanceMode
from shared.drafting.base import DrafterName
from shared.messages import ActivationFormat, FinishReason, Limits, OpenRequest, Pace
from shared.draft_q import Proposal
from shared.sampling import SamplingParams
from shared.tree import ROOT, DraftTree
from testkit.tiny_falcon import PROMPT, falcon_parts
from tests.in_process import split_greedy
from cloud_server.config import ServerConfig
from tests.server_harness import ServerThread

def test_blocks_and_the_relaxed_mask():
    assert block_ends(7, 2, 0).tolist() == [1, 1, 3, 3, 5, 5, 7]
    assert block_ends(7, 3, 1).tolist() == [0, 3, 3, 3, 6, 6, 6]
    allowed = relaxed_mask(block_ends(4, 2, 0))[0, 0] == 0
    assert allowed.tolist() == [[True, True, False, False], [True, True, False, False],
                                [True, True, True, True], [True, True, True, True]]


def test_glancing_hands_chosen_block_starts_what_they_predict():
    ids = torch.arange(10)[None].repeat(2, 1)  # [2, 10]
    memory = torch.arange(10.0)[None, :, None].repeat(2, 1, 3)  # [2, 10, 3]
    wrong = torch.zeros(2, 10, dtype=torch.bool)
    wrong[0, :6] = True  # six wrong in row 0, none in row 1
    starts = torch.zeros(2, 10, dtype=torch.bool)
    starts[:, [0, 2, 4, 6]] = True
    new_ids, new_memory, glanced = glance(ids, memory, wrong, starts, 0.5, 2,
                                          torch.Generator().manual_seed(0))
    chosen = glanced[0].nonzero().flatten()
    assert len(chosen) == 3 and not glanced[1].any()
    assert (new_ids[0, chosen] == chosen + 2).all() and (new_memory[0, chosen, 0] == chosen + 2).all()
    assert (new_ids[:, ~glanced[0]] == ids[:, ~glanced[0]]).all()
    assert (ids == torch.arange(10)).all()  # the inputs are not changed in place


@torch.no_grad()
def training_chain(edge, ids: list[int], acts: torch.Tensor, steps: int) -> list[int]:
    """Greedy tokens the training forward gives, block after block: blocks aligned to end at
    the text's end, every query seeing the activations of the prompt."""
    ids = list(ids)
    for _ in range(steps):
        length = len(ids)
        ends = block_ends(length, edge.config.block, length % edge.config.block)
        verified = torch.arange(length)[None, :] < len(acts)
        memory = torch.cat((acts, torch.zeros(length - len(acts), acts.shape[1])))
        hidden, _ = edge(torch.tensor([ids]), memory[None], relaxed_mask(ends),
                      additive_mask(verified.expand(length, length))[None, None])
        rows = edge.logits(hidden[0, -edge.config.block:]).argmax(-1)
        ids += [int(edge.vocab_ids[r]) for r in rows]
    return ids[-steps * edge.config.block:]


def test_edge_drafts_what_training_computed(tiny_target, tiny_falcon_dir, tiny_falcon_bundle):
    """A greedy chain of 6 tokens takes 3 steps of 2 on the edge, and equals the relaxed-mask
    training forward run block by block; the bundle says its block in a format older edges
    refuse."""
    edge, _, acts = falcon_parts(tiny_target, tiny_falcon_dir)
    drafter = FalconDrafter(MoaGraphs(tiny_falcon_bundle, Precision.FP32),
                            TreeSearch(max_depth=6, beam=1, branch=1))
    assert '"format": 3' in (tiny_falcon_bundle / "bundle.json").read_text()
    drafter.reset(PROMPT)
    drafter.add_activations(0, acts.numpy())
    calls = []
    run_step = drafter.graphs.step
    drafter.graphs.step = (  # type: ignore[method-assign]
        lambda *a, **k: calls.append(len(a[0])) or run_step(*a, **k))
    for context in (PROMPT + [30], PROMPT + [30, 31, 32]):
        calls.clear()
        tree = drafter.propose(context, max_nodes=6)
        assert tree == DraftTree.chain(tree.tokens) and len(tree) == 6
        assert tree.tokens == tuple(training_chain(edge, context, acts, 3))
        assert len(calls) == 3 and calls[1:] == [2, 2]  # the text's new tokens, 2 blocks of 2


def test_split_decoding_with_falcon_equals_plain_greedy(tiny_target, tiny_falcon_dir,
                                                        tiny_falcon_bundle):
    """Every round verifies a Falcon tree, and the text is plain greedy's (the near-tie rule,
    cloud_server/reference.py); how many drafts get accepted is the trained network's
    business."""
    _, server, _ = falcon_parts(tiny_target, tiny_falcon_dir)
    plain = plain_greedy(tiny_target, PROMPT, 32)
    for merge in (False, True):
        drafter = trained_drafter(tiny_falcon_bundle, DrafterName.FALCON,
                                  TreeSearch(max_depth=6, beam=4, branch=4, merge=merge),
                                  precision=Precision.FP32)
        sizes: list[int] = []
        propose = drafter.propose
        drafter.propose = lambda *a: sizes.append(len(t := propose(*a))) or t  # type: ignore
        tokens, _ = split_greedy(tiny_target, server, drafter, PROMPT, 32, max_nodes=16)
        verdict = compare(tiny_target, PROMPT, tokens, plain)
        assert verdict.lossless, (merge, verdict, tokens, plain)
        assert sizes and all(sizes), sizes  # with the prompt's rows fed, it always drafts


def test_each_drafter_refuses_the_others_bundle(tiny_falcon_bundle, tiny_bundle):
    with pytest.raises(BundleError, match="--drafter falcon"):
        MoaDrafter(MoaGraphs(tiny_falcon_bundle, Precision.FP32))
    with pytest.raises(BundleError, match="--drafter moa"):
        FalconDrafter(MoaGraphs(tiny_bundle))


def test_a_falcon_drafter_is_not_recurrent(tiny_target):
    with pytest.raises(ValueError, match="semi-autoregressive"):
        MoaConfig.from_target(tiny_target.model.config, block=2, recurrent=True,
                              server_input=ServerInput.LAST_HIDDEN)
    with pytest.raises(ValueError, match="at least one token"):
        MoaConfig.from_target(tiny_target.model.config, block=0)


@pytest.mark.parametrize("argv, message", [
    (["--method", "falcon", "--recurrent", "--server-input", "last"], "takes no --recurrent"),
    (["--method", "falcon", "--block", "1"], "--block >= 2"),
    (["--method", "falcon", "--glance", "1.5"], "--glance is a rate")])
def test_train_drafter_refuses_a_falcon_it_cannot_train(tmp_path, capsys, argv, message):
    from cloud_server.training.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(tmp_path), *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@torch.inference_mode()
def falcon_rows(target, drafter_dir, ids: list[int]) -> np.ndarray:
    """[len(ids), width]: the server half's activations of every position of `ids`, computed
    here in fp32 from one forward of the whole text."""
    config, server_half, _ = load_drafter(drafter_dir, target.model)
    assert server_half is not None and config.hidden_layers  # it reads layer outputs
    with LayerOutputs(target.model, config.hidden_layers) as seen:
        target.model(input_ids=torch.tensor([ids]))
        return server_half(seen.stacked()[0].float()).numpy()


@pytest.mark.parametrize("pace", [Pace.LOCKSTEP, Pace.SERVER])
def test_falcon_through_the_server(tiny_target, tiny_falcon_dir, pace, tmp_path, monkeypatch):
    """A server given a Falcon drafter lists its bundle as drafter-falcon; 'auto' picks it,
    fetches it and stays lossless at either pace, the rows it is fed being the server half's
    activations of the positions they claim; 'moa' is refused with what to use."""
    monkeypatch.setenv("SPLITDEC_CACHE", str(tmp_path))
    limits = Limits(max_tree_nodes=16, max_tree_depth=8, max_new_tokens=64)
    prompts = [(1, 46, 47, 48, 49), (1, 60, 61, 62)]

    fed: list[list[tuple[int, np.ndarray]]] = []  # per generation: (start, rows) as fed
    add = FalconDrafter.add_activations

    def recorded(self, start: int, activations: np.ndarray) -> None:
        fed[-1].append((start, np.array(activations, dtype=np.float32)))
        add(self, start, activations)
    monkeypatch.setattr(FalconDrafter, "add_activations", recorded)

    async def go(drafter: str):
        async with EdgeClient(server.address, ClientOptions(
                drafter, 16, 32, pace=pace, activation_format=ActivationFormat.FP16)) as client:
            results = []
            for p in prompts:
                fed.append([])
                results.append(await client.generate(client.options.open_request(prompt_ids=p)))
            return client.options.drafter, results

    with ServerThread(tiny_target, ServerConfig(limits, drafter_dir=tiny_falcon_dir)) as server:
        assert FALCON_ARTIFACT in {a.name for a in server.service.info().artifacts}
        chosen, results = asyncio.run(go("auto"))
        with pytest.raises(LinkError, match="offers the falcon drafter, not moa"):
            asyncio.run(go("moa"))
    assert chosen == "falcon" and len(fed) == len(prompts)
    for prompt, result, rows in zip(prompts, results, fed):
        plain = plain_greedy(tiny_target, list(prompt), 32)
        assert compare(tiny_target, prompt, result.output_ids, plain).lossless
        want = falcon_rows(tiny_target, tiny_falcon_dir, [*prompt, *result.output_ids])
        for start, got in rows:  # fp16 keeps each value to 2^-11 of it
            got = got[:max(0, len(want) - start)]  # past the text: drafts a length limit cut
            expected = want[start:start + len(got)]
            scale = np.abs(expected).max(axis=1, keepdims=True)  # [n, 1]
            assert (np.abs(got - expected) <= scale / 500 + 1e-4).all(), start
    # Lock-step and server pace ask for a draft in every Verdict (Verdict.next): every
    # position but the last token's was fed in lock-step; paced, at least the prompt's.
    first = set().union(*(range(start, start + len(got)) for start, got in fed[0]))
    text = len(prompts[0]) + len(results[0].output_ids)
    assert first >= set(range(text - 1 if pace is Pace.LOCKSTEP else len(prompts[0])))


def test_inside_a_block_every_node_is_expanded(tiny_target, tiny_falcon_dir, tiny_falcon_bundle):
    """Children inside a block come from rows already computed, so the beam limits only the
    nodes that end a block: both first-level nodes are expanded, one of the second level's."""
    _, _, acts = falcon_parts(tiny_target, tiny_falcon_dir)
    drafter = FalconDrafter(MoaGraphs(tiny_falcon_bundle, Precision.FP32),
                            TreeSearch(max_depth=3, beam=1, branch=2))
    drafter.reset(PROMPT)
    drafter.add_activations(0, acts.numpy())
    tree = drafter.propose(PROMPT + [30], max_nodes=64)
    assert sorted(tree.depths()) == [0] * 2 + [1] * 4 + [2] * 2


@pytest.mark.parametrize("acceptance", [AcceptanceMode.SAMPLED_DRAFTS,
                                        AcceptanceMode.TOPK_DRAFTS])
def test_falcon_drafts_when_sampling(tiny_target, tiny_falcon_dir, tiny_falcon_bundle,
                                     acceptance):
    """Every round sends a tree and the text finishes. Sampled trees come with q at every
    node that has children and at no other, each child drawn from its parent's q; the root's
    q is the first row of the round's block step and each first-level node's is the second
    row of that same step (inside a block, children come from rows already computed).
    Top-k trees go without q. Each Verdict accepts a path of its tree down from the root and
    then adds the target's token. (How many of Falcon's drafts the rules accept is the trained
    network's business; that they accept drafts right by construction, tests/test_moa_split.py.)"""
    _, server, _ = falcon_parts(tiny_target, tiny_falcon_dir)
    falcon = FalconDrafter(MoaGraphs(tiny_falcon_bundle, Precision.FP32), TreeSearch(max_depth=6))
    drafter = LookupMerge(falcon)
    assert falcon.graphs.block == 2
    sent: list[tuple[Proposal, tuple[np.ndarray, np.ndarray] | None]] = []  # each round's
    propose, propose_sampled = drafter.propose, drafter.propose_sampled

    def proposed(*args) -> DraftTree:
        sent.append((Proposal(tree := propose(*args)), None))
        return tree

    def sampled(*args) -> Proposal:
        proposal = propose_sampled(*args)
        logprobs, ids = falcon._first_rows  # the round's block step: [block, top_k] each
        sent.append((proposal, (logprobs.copy(), ids.copy())))
        return proposal

    drafter.propose, drafter.propose_sampled = proposed, sampled  # type: ignore[method-assign]
    request = OpenRequest(prompt_ids=tuple(PROMPT), max_new_tokens=32, acceptance=acceptance,
                          sampling=SamplingParams(temperature=0.3, seed=3))
    run = decode_in_process(tiny_target, request, drafter, 16, server)
    assert run.verdicts[-1].finish_reason in (FinishReason.LENGTH, FinishReason.STOP_TOKEN)
    assert len(sent) == len(run.verdicts) - 1 and all(len(p.tree) for p, _ in sent)

    def softmax(logprobs: np.ndarray) -> np.ndarray:
        q = np.exp(logprobs - logprobs.max())
        return q / q.sum()

    first_level_q = 0  # first-level nodes given q, over all rounds
    for (proposal, rows), verdict in zip(sent, run.verdicts[1:]):
        tree = proposal.tree
        path = verdict.accepted_nodes
        assert [tree.parents[n] for n in path] == [ROOT, *path][:len(path)], (tree, path)
        assert verdict.tokens[:len(path)] == tuple(tree.tokens[n] for n in path)
        assert len(verdict.tokens) == len(path) + 1 or verdict.finish_reason is not \
            FinishReason.NOT_FINISHED
        if acceptance is AcceptanceMode.TOPK_DRAFTS:
            assert rows is None and proposal.q == ()
            continue
        assert rows is not None
        qs = {q.node: q for q in proposal.q}
        assert len(qs) == len(proposal.q) and set(qs) == set(tree.parents)
        for token, parent in zip(tree.tokens, tree.parents):
            q = qs[parent]
            assert token in q.tokens and q.probs[q.tokens.index(token)] > 0
        logprobs, ids = rows
        for node, row in [(ROOT, 0)] + [(n, 1) for n in tree.children(ROOT) if n in qs]:
            first_level_q += row
            assert qs[node].tokens == tuple(int(t) for t in ids[row])
            np.testing.assert_allclose(qs[node].probs, softmax(logprobs[row]), rtol=1e-5,
                                       atol=1e-7)
    if acceptance is AcceptanceMode.SAMPLED_DRAFTS:
        assert first_level_q > 0  # a first-level node was expanded in some round
