"""Server-paced sessions (cloud_server/decoding/pacing.py) on the tiny target: the text is exactly plain
greedy decoding whatever the pace, drafts join the server's forwards, and flow control holds."""
from __future__ import annotations

import asyncio
import time

import pytest

from cloud_server.reference import compare, plain_greedy
from edge_client.client import ClientOptions, EdgeClient
from edge_client.reporting import SilentListener
from cloud_server.decoding.pacing import PacingPolicy
from shared.drafting.base import DrafterName
from shared.messages import FinishReason, Limits, Pace
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
    # auto is server pace for a drafter that reads the text alone, and the result says so
    assert {result.pace for result in results} == {Pace.SERVER}
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


@pytest.mark.parametrize("own_reach, client_reach, redundant", [(2, 1, True), (2, 2, True),
                                                                 (1, 3, False), (0, 1, False)])
def test_a_verdict_says_when_the_servers_own_candidates_had_the_clients_accepted_tokens(
        tiny_target, monkeypatch, own_reach, client_reach, redundant):
    """Verdict.draft_redundant: the client's accepted nodes added nothing to what the server's
    own tree alone would have committed in the same forward (a text-only edge then rests)."""
    from cloud_server.decoding.server_decoding import ServerDecoder
    from shared.draft_q import Proposal
    from shared.tree import DraftTree

    session, decoder = _decoder_after_prefill(tiny_target, "pld", PROMPTS[1])
    truth = plain_greedy(tiny_target, PROMPTS[1], MAX_NEW)
    at = len(session.committed) - len(PROMPTS[1])
    monkeypatch.setattr(ServerDecoder, "propose", lambda self, context: Proposal(
        DraftTree.chain(truth[at: at + own_reach])))
    verdict = _step(tiny_target, decoder, 1, DraftTree.chain(truth[at: at + client_reach])).verdict
    assert len(verdict.accepted_nodes) == client_reach
    assert verdict.draft_redundant is redundant


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


def test_at_server_pace_the_edge_leaves_mere_acknowledgements_unsent(tiny_server):
    """The server never waits for its answers (Verdict.answer_awaited unset): a prompt-lookup
    edge sends its drafts, an acknowledgement once per quarter of the lead, and nothing for
    the other Verdicts; each answer would cost the server a read on its core."""
    results = paced_outputs(tiny_server.address, "pld", Pace.SERVER)
    # Answering every Verdict: the Open, an answer to each but the last, the Close
    assert sum(r.messages_up for r in results) < sum(r.rounds for r in results)



def test_a_prompt_lookup_edge_gets_the_text_only_spacing_and_keeps_it(tiny_server):
    """The client gives an edge whose drafter reads no activation rows the spacing that rests
    from drafts that added nothing (DraftSpacing.reads_rows False, test_paced_drafts.py has what
    it does), and carries it to the next generation."""
    async def go():
        options = ClientOptions("pld", None, MAX_NEW, pace=Pace.SERVER)
        async with EdgeClient(tiny_server.address, options) as client:
            opened = client._spacing.reads_rows
            await client.generate(options.open_request(prompt_ids=PROMPTS[0]))
            return opened, client._spacing.reads_rows
    assert asyncio.run(go()) == (False, False)
