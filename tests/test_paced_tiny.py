"""Server-paced sessions (cloud_server/decoding/pacing.py) on the tiny target: the text is exactly plain
greedy decoding whatever the pace, drafts join the server's forwards, the edge does what each
Verdict tells it (Verdict.next: draft, or rest), and flow control holds."""
from __future__ import annotations

import asyncio
import time

import pytest

from cloud_server.reference import compare, plain_greedy
from edge_client.client import ClientOptions, EdgeClient
from edge_client.reporting import SilentListener
from cloud_server.config import PacingPolicy
from shared.drafting.base import DrafterName
from shared.messages import FinishReason, Limits, Next, Pace
from netsim import LinkProfile, NetworkConditions, ProxyThread
from cloud_server.config import ServerConfig
from tests.server_harness import ServerThread
from testkit.tiny_prompts import MAX_NEW, PROMPTS


def paced_outputs(address: str, drafter: str, pace: Pace, tree_nodes: int | None = None,
                  lead: int = 0):
    async def go():
        options = ClientOptions(drafter, tree_nodes, MAX_NEW, pace=pace, lead=lead)
        async with EdgeClient(address, options) as client:
            return [await client.generate(options.open_request(prompt_ids=p)) for p in PROMPTS]
    return asyncio.run(go())


@pytest.mark.parametrize("pace", [Pace.SERVER, Pace.AUTO])
@pytest.mark.parametrize("drafter", ["pld", "aded"])
def test_paced_greedy_equals_plain(tiny_server, tiny_target, pace, drafter):
    results = paced_outputs(tiny_server.address, drafter, pace)
    # the pace asked for, whatever the drafter reads, and the result says so
    assert {result.pace for result in results} == {pace}
    for prompt, result in zip(PROMPTS, results):
        plain = plain_greedy(tiny_target, prompt, MAX_NEW)
        assert compare(tiny_target, prompt, result.output_ids, plain).lossless, (prompt, pace)
        assert result.finish_reason in (FinishReason.LENGTH, FinishReason.STOP_TOKEN)
        # Every forward streams a Verdict; the client's accepted nodes are among its tokens.
        assert result.rounds + 1 <= len(result.output_ids) + 1
        assert result.accepted_tokens <= len(result.output_ids)
        # the prefill's time is kept apart: the link's lines are drawn at the mean forward after it
        assert 0 < result.prefill_s < result.verify_s


def test_paced_with_the_servers_own_recycled_candidates_equals_plain(tiny_target):
    """Token Recycling as the server's own drafter: its candidates merge with the edge's
    re-rooted drafts, and the text stays plain greedy decoding."""
    limits = Limits(max_tree_nodes=16, max_tree_depth=8, max_new_tokens=64)
    pacing = PacingPolicy(drafter=DrafterName.RECYCLE)
    with ServerThread(tiny_target, ServerConfig(limits, pacing=pacing)) as server:
        results = paced_outputs(server.address, "pld", Pace.SERVER)
    for prompt, result in zip(PROMPTS, results):
        plain = plain_greedy(tiny_target, prompt, MAX_NEW)
        assert compare(tiny_target, prompt, result.output_ids, plain).lossless, prompt


def test_client_drafts_join_the_forwards(tiny_target):
    """With auto pace on loopback the client's answer comes well within a step: its drafts
    are verified and accepted (the repeating prompts make lookup drafts hit). The server runs
    no drafter of its own here: its recycled candidates, at a 2 ms tiny step, commit most of
    what the client would propose before the draft arrives, and whether the client gets any
    node in first is then a race the test would lose now and then."""
    limits = Limits(max_tree_nodes=16, max_tree_depth=8, max_new_tokens=64)
    config = ServerConfig(limits, pacing=PacingPolicy(drafter=None))
    with ServerThread(tiny_target, config) as server:
        results = paced_outputs(server.address, "pld", Pace.AUTO)
    generated = sum(len(r.output_ids) for r in results)
    assert sum(r.accepted_tokens for r in results) > generated // 4
    # What became of the drafts adds up: a draft whose nodes were accepted was used, and
    # a draft used earns at most what was accepted of it.
    for r in results:
        assert r.drafts.settled and r.drafts.earned <= r.drafts.used
        assert r.drafts.earned <= r.accepted_tokens and bool(r.drafts.earned) == bool(
            r.accepted_tokens)


def test_lockstep_is_the_rounds_of_old(tiny_server):
    for r in paced_outputs(tiny_server.address, "pld", Pace.LOCKSTEP, tree_nodes=16):
        assert r.rounds + r.accepted_tokens <= len(r.output_ids) <= 1 + r.rounds + r.accepted_tokens
        d = r.drafts  # the server waits for every lock-step draft: each one is used
        assert d.used == r.rounds and d.late == d.wrong == 0


def _decoder_after_prefill(tiny_target, own: str | None, prompt: list[int]):
    """A forward builder on the tiny target, the server's own drafter `own`, `prompt` prefilled."""
    from cloud_server.decoding.forward_builder import ForwardBuilder
    from cloud_server.decoding.server_decoding import ServerDecoder, own_drafter
    from cloud_server.decoding.session import Session
    from shared.messages import OpenRequest

    session = Session.open(tiny_target, Limits(), OpenRequest(prompt_ids=tuple(prompt),
                                                              max_new_tokens=MAX_NEW))
    decoder = ForwardBuilder(session, ServerDecoder(session, own_drafter(own, Limits()), 0, ()), ())
    session.prefill()
    return session, decoder


def test_a_forward_without_a_client_draft_credits_the_client_with_nothing(tiny_target):
    """The server's own lookup candidates get accepted, but a Verdict names only the client's
    accepted nodes: the edge counts its drafts' share of the text from them."""
    import time

    session, decoder = _decoder_after_prefill(tiny_target, "pld", PROMPTS[1])
    verdicts = []
    while not session.finished:
        verdicts.append(tiny_target.drive(decoder.stepping(None, time.perf_counter())).verdict)
    assert sum(len(v.tokens) for v in verdicts) > len(verdicts)  # lookups were accepted
    assert all(v.accepted_nodes == () for v in verdicts)


def test_work_handed_in_before_a_takeover_runs_no_forward(tiny_target):
    """A resume raised the session's epoch after a forward was handed in: that forward does
    not run, so nothing is committed behind the resume's catch-up."""
    import time

    session, decoder = _decoder_after_prefill(tiny_target, None, PROMPTS[0])
    committed = list(session.committed)
    work = decoder.stepping(None, time.perf_counter())
    session.epoch += 1  # what SessionTable.take_over does
    assert tiny_target.drive(work) is None and session.committed == committed
    assert tiny_target.drive(decoder.stepping(None, time.perf_counter())) is None
    resumed = type(decoder)(session, decoder.own, ())  # the resuming stream's
    assert tiny_target.drive(resumed.stepping(None, time.perf_counter()))
    assert len(session.committed) > len(committed)


def _step(tiny_target, decoder, draft_id: int, tree):
    import time

    from shared.messages import DraftRequest
    draft = DraftRequest(draft_id, len(decoder.session.committed), tree)
    return tiny_target.drive(decoder.stepping(draft, time.perf_counter()))


@pytest.mark.parametrize("wrong_forwards", [0, 6])
def test_a_verdict_names_the_clients_accepted_nodes_wherever_the_merge_put_them(
        tiny_target, wrong_forwards):
    """After drafts wrong from their first node, the server's own candidates go first in the
    merged tree (Precedence); a right draft after that still gets its nodes named by their
    index in the draft, and `alone` says what the server's tree alone would have committed."""
    from shared.tree import DraftTree

    session, decoder = _decoder_after_prefill(tiny_target, "pld", PROMPTS[1])
    truth = plain_greedy(tiny_target, PROMPTS[1], MAX_NEW)
    for n in range(1, wrong_forwards + 1):
        at = len(session.committed) - len(PROMPTS[1])
        wrong = (truth[at] + 1) % tiny_target.vocab_size
        assert _step(tiny_target, decoder, n, DraftTree.chain([wrong])).verdict.accepted_nodes == ()
    assert decoder._precedence.own_first() is (wrong_forwards > 0)
    at = len(session.committed) - len(PROMPTS[1])
    # A wrong first child, then the right chain below a sibling: the accepted nodes are 1, 2
    tree = DraftTree(((truth[at] + 1) % tiny_target.vocab_size, truth[at], truth[at + 1]),
                     (-1, -1, 1))
    forwarded = _step(tiny_target, decoder, wrong_forwards + 1, tree)
    verdict = forwarded.verdict
    assert verdict.tokens[:2] == (truth[at], truth[at + 1])
    assert verdict.accepted_nodes == (1, 2) and verdict.draft_id == wrong_forwards + 1
    assert 1 <= forwarded.alone <= len(verdict.tokens)
    assert session.committed[len(PROMPTS[1]):] == truth[:len(session.committed) - len(PROMPTS[1])]


@pytest.mark.parametrize("own_reach, client_reach", [(2, 1), (2, 2), (1, 3), (0, 1)])
def test_a_merged_forward_says_what_the_servers_own_candidates_alone_would_have_committed(
        tiny_target, monkeypatch, own_reach, client_reach):
    """Forwarded.alone, what auto pace weighs a client's drafts against (pacing.py): the
    tokens the server's own tree would have committed in the same forward, its accepted
    nodes and the target's token, however far the client's draft went."""
    from cloud_server.decoding.server_decoding import ServerDecoder
    from shared.draft_q import Proposal
    from shared.tree import DraftTree

    session, decoder = _decoder_after_prefill(tiny_target, "pld", PROMPTS[1])
    truth = plain_greedy(tiny_target, PROMPTS[1], MAX_NEW)
    at = len(session.committed) - len(PROMPTS[1])
    monkeypatch.setattr(ServerDecoder, "propose", lambda self, context, nodes=None: Proposal(
        DraftTree.chain(truth[at: at + own_reach])))
    forwarded = _step(tiny_target, decoder, 1, DraftTree.chain(truth[at: at + client_reach]))
    assert len(forwarded.verdict.accepted_nodes) == client_reach
    assert len(forwarded.verdict.tokens) == max(own_reach, client_reach) + 1
    assert forwarded.alone == own_reach + 1


def test_a_merged_forward_asks_the_servers_own_drafter_for_no_more_than_it_keeps(
        tiny_target, monkeypatch):
    """The merged tree is cut to the forward's budget, so the server's own drafter (Token
    Recycling's heap grows node by node in Python) drafts at most that many nodes, not as
    many as its own budget would ask for a forward of its own."""
    from cloud_server.decoding.server_decoding import ServerDecoder
    from shared.tree import DraftTree

    asked: list[int | None] = []
    propose = ServerDecoder.propose
    monkeypatch.setattr(ServerDecoder, "propose", lambda self, context, nodes=None: (
        asked.append(nodes) or propose(self, context, nodes)))
    session, decoder = _decoder_after_prefill(tiny_target, "recycle", PROMPTS[1])
    truth = plain_greedy(tiny_target, PROMPTS[1], MAX_NEW)
    for draft_id in (1, 2, 3):
        budget = decoder.draft_nodes()
        at = len(session.committed) - len(PROMPTS[1])
        _step(tiny_target, decoder, draft_id, DraftTree.chain(truth[at: at + 2]))
        assert asked[-1] == budget


class _LastToken(SilentListener):
    def __init__(self) -> None:
        self.at = 0.0

    def committed(self, ids: list[int]) -> None:
        self.at = time.perf_counter()


def test_the_wall_time_ends_with_the_answer_not_the_close_after_it(tiny_server):
    """The answer is complete when Done arrives, with the last tokens; the Close after it
    costs a round trip (500 ms here) that the user does not wait on, and a server-only
    stream does not have (before, `edge-client --mode` compared split decoding with it)."""
    async def go(address: str) -> tuple[float, float, float]:
        options = ClientOptions("pld", None, MAX_NEW, pace=Pace.SERVER)
        last = _LastToken()
        async with EdgeClient(address, options) as client:
            start = time.perf_counter()
            result = await client.generate(options.open_request(prompt_ids=PROMPTS[0]), last)
            returned_s = time.perf_counter() - start
        return result.wall_s, last.at - start, returned_s
    slow = NetworkConditions.symmetric(LinkProfile(delay_ms=250))
    with ProxyThread(tiny_server.address, slow) as proxy:
        wall_s, last_token_s, returned_s = asyncio.run(go(proxy.address))
    # Floors only, which a busy machine cannot break: the simulated delays are minimums, so
    # generate returns at least the Close's round trip (0.5 s) after the answer ends, and the
    # answer cannot end before its last tokens arrive.
    assert last_token_s <= returned_s - 0.45
    assert wall_s <= returned_s - 0.45, "the wall time waited for the Close"
    assert wall_s >= 0.5, "an answer takes at least the Open's round trip"


def test_told_to_draft_the_edge_answers_every_verdict(tiny_server):
    """Server pace asks for a draft in every Verdict (Verdict.next): a prompt-lookup edge
    answers each but the last, with a draft, or an acknowledgement while its last draft still
    continues the text. Sent: the Open, the answers, the Close."""
    results = paced_outputs(tiny_server.address, "pld", Pace.SERVER)
    assert all(r.messages_up == r.rounds + 2 for r in results)
    assert sum(r.drafted_tokens for r in results) > 0


def test_told_to_rest_the_edge_drafts_nothing_and_acknowledges_now_and_then(
        tiny_server, tiny_target, monkeypatch):
    """Auto pace tells the client to rest in every Verdict: the edge drafts nothing (a draft
    from such a Verdict would be refused) and acknowledges once per quarter of the lead, so
    that the lead never stops the server; the text is plain greedy decoding still."""
    from cloud_server.decoding.pacing import AutoPace

    monkeypatch.setattr(AutoPace, "decide", lambda self, busy: Next.REST)
    lead = 16
    results = paced_outputs(tiny_server.address, "pld", Pace.AUTO, lead=lead)
    for prompt, result in zip(PROMPTS, results):
        plain = plain_greedy(tiny_target, prompt, MAX_NEW)
        assert compare(tiny_target, prompt, result.output_ids, plain).lossless, prompt
        assert result.drafted_tokens == 0 and result.drafts.settled == 0
        # the Open, the Close, an acknowledgement of the prefill's Verdict and one per
        # lead // 4 tokens; one forward may commit several past the mark
        assert 2 < result.messages_up <= 3 + len(result.output_ids) // (lead // 4)
