"""`make demo`: the product on one machine standing in for two, in under a minute once set up.

A cloud-server on core 0, and this process, the edge, on core 1 (a deployment has them on
separate machines), joined by a simulated `4g` link (netsim/). One prompt answered three ways:
the server's plain API (one target forward a token: the baseline), server-side speculation (the
server drafts alone) and split decoding (the edge drafts, the server verifies). Then split again
through a link that drops once OUTAGE_AFTER answer tokens have reached the edge: the edge writes
alone while it is down, and once it is back the server's text keeps what agrees and rewinds the
rest. Ends with a table, and says where split decoding pays on this machine and where it does
not.
"""
from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import dataclass
from typing import Callable

from tokenizers import Tokenizer

from benchmarks.common import cloud_server, netsim_on_cue, netsim_proxy
from edge_client.cli import stats_line
from edge_client.client import DEFAULT_PACE, ClientOptions, EdgeClient
from edge_client.display import TerminalView
from edge_client.reporting import GenerationResult, SilentListener
from edge_client.server_only import Mode
from netsim import PROFILES, NetworkConditions
from shared.messages import ChatMessage

PROMPT = "Explain in a few sentences why the sky is blue, then list three related facts."
MAX_NEW_TOKENS = 128
LINK = "4g"
WAYS = (Mode.PLAIN_API, Mode.SERVER_SPEC, Mode.SPLIT)
OUTAGE_S = 2.0
# Answer tokens at the edge when the link drops: counted, not timed, so that the outage falls
# mid-answer on any machine, whether or not the drafter bundle was fetched first.
OUTAGE_AFTER = 16
SERVER_CORE, EDGE_CORE = frozenset({0}), frozenset({1})


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class Shown(SilentListener):
    """Streams the committed text as it comes (dimmed offline drafts on a terminal, as
    `edge-client` shows them) and keeps the offline text as it was written, from answer token
    `offline_at` on. Given `cut`, calls it once OUTAGE_AFTER answer tokens have come."""

    def __init__(self, view: TerminalView, cut: Callable[[], None] | None = None) -> None:
        self.view = view
        self.cut = cut
        self.received = 0
        self.offline: list[int] = []
        self.offline_at = 0

    def committed(self, ids: list[int]) -> None:
        self.view.committed(ids)
        self.received += len(ids)
        if self.cut is not None and self.received >= OUTAGE_AFTER:
            self.view.link_event(f"{self.received} answer tokens in: the demo drops the link "
                                 f"for {OUTAGE_S:g} s")
            self.cut()
            self.cut = None

    def unverified(self, ids: list[int]) -> None:
        if not self.offline:
            self.offline_at = self.received
        self.offline += ids
        self.view.unverified(ids)

    def withdraw(self) -> None:
        self.view.withdraw()

    def link_event(self, text: str) -> None:
        self.view.link_event(text)


@dataclass
class Answer:
    way: str
    result: GenerationResult


async def answer(link: str, mode: Mode, label: str, cut: Callable[[], None] | None = None
                 ) -> Answer:
    """One answer to PROMPT through `link` by `mode`, streamed with its stats line; `cut`
    drops the link mid-answer."""
    say(f"\n--- {label} ---")
    options = ClientOptions(max_new_tokens=MAX_NEW_TOKENS, mode=mode, pace=DEFAULT_PACE)
    async with EdgeClient(link, options) as client:
        shown = Shown(TerminalView(client.tokenizer, sys.stdout, sys.stderr), cut)
        request = options.open_request(chat=(ChatMessage("user", PROMPT),))
        result = await client.generate(request, shown)
        name = client.options.drafter if mode is Mode.SPLIT else mode.value
        say("\n" + stats_line(result, str(name)))
        if result.reconnects:
            say(offline_text(client.tokenizer, shown, result))
    return Answer(label, result)


def offline_text(tokenizer: Tokenizer, shown: Shown, result: GenerationResult) -> str:
    """What the edge wrote while the link was down, as it wrote it (never shown as the
    answer), then the target's text over the same tokens: the answer as verified."""
    if not shown.offline:
        return ("the edge wrote nothing while the link was down: its drafter found no "
                "continuation of the text so far")
    start, end = shown.offline_at, shown.offline_at + len(shown.offline)
    written = tokenizer.decode(shown.offline, skip_special_tokens=True)
    final = tokenizer.decode(result.output_ids[start:end], skip_special_tokens=True)
    return (f"written offline, unverified ({len(shown.offline)} tokens from answer token "
            f"{start}):\n  {written!r}\nthe target's text there, the answer "
            f"({result.kept_tokens} of them kept, {result.corrected_tokens} rewound):\n"
            f"  {final!r}")


def forwards_per_token(r: GenerationResult) -> float:
    return r.rounds / max(1, len(r.output_ids))


def table(answers: list[Answer]) -> str:
    plain = answers[0].result
    rows = ["| way | tokens | tok/s | x plain API | forwards/token | edge's drafts used/late/"
            "wrong | offline tokens written/kept/rewound | text = plain API |", "|---" * 8 + "|"]
    for a in answers:
        r, d = a.result, a.result.drafts
        drafts = f"{d.used}/{d.late}/{d.wrong}" if d.settled else "-"
        offline = (f"{r.offline_tokens}/{r.kept_tokens}/{r.corrected_tokens}" if r.reconnects
                   else "-")
        # a paced server goes on alone while the link is down: the edge sees fewer forwards
        forwards = "-" if r.reconnects else f"{forwards_per_token(r):.2f}"
        rows.append(f"| {a.way} | {len(r.output_ids)} | {r.tokens_per_s:.1f} | "
                    f"{r.tokens_per_s / plain.tokens_per_s:.2f}x | {forwards} | {drafts} | "
                    f"{offline} | "
                    f"{'yes' if r.output_ids == plain.output_ids else 'NO'} |")
    return "\n".join(rows)


def verdict(plain: GenerationResult, spec: GenerationResult, split: GenerationResult,
            rtt_ms: float) -> str:
    """Where split decoding stands against server-side speculation here, and why."""
    step_ms = 1000 * plain.wall_s / max(1, plain.rounds)
    d = split.drafts
    ratio = split.tokens_per_s / spec.tokens_per_s
    if d.earned:
        outcome = (f"Split decoding ran {ratio:.2f}x server-side speculation here, at "
                   f"{forwards_per_token(split):.2f} target forwards a token against "
                   f"{forwards_per_token(spec):.2f}")
    else:
        outcome = (f"No draft of the edge's got a token accepted, so split decoding ran as "
                   f"server-side speculation does (its {ratio:.2f}x that speed is one "
                   f"prompt's noise)")
    drafts = (f"of the edge's drafts {d.used} were used, {d.late} came late and {d.wrong} "
              f"were wrong" if split.drafted_tokens else "the edge sent no draft")
    return (f"{outcome}; {drafts}. On this machine the server is a CPU: a tree forward costs "
            f"several decoding steps (results log, verify_cost_q4), so it verifies small trees, "
            f"and a draft costs a {rtt_ms:.0f} ms round trip, {rtt_ms / step_ms:.0f} of its "
            f"{step_ms:.0f} ms steps, in which its own candidates move on. So on a CPU split "
            f"decoding at best ties server-side speculation. It pays on a GPU node, where a tree "
            f"of 64 nodes costs about one step and verifying the edges' drafts is drafting the "
            f"server no longer does (docs/performance.md).")


async def demo(server: str) -> int:
    with netsim_proxy(server, LINK, cores=EDGE_CORE) as link:
        answers = [await answer(link, mode, mode.value) for mode in WAYS]
    with netsim_on_cue(server, LINK, OUTAGE_S, cores=EDGE_CORE) as (link, cut):
        answers.append(await answer(link, Mode.SPLIT, f"split, the link down {OUTAGE_S:g} s "
                                    f"after {OUTAGE_AFTER} tokens", cut))
    say("\n" + table(answers))
    rtt_ms = NetworkConditions.symmetric(PROFILES[LINK]).rtt_ms
    plain, spec, split = (a.result for a in answers[:3])
    say("\n" + verdict(plain, spec, split, rtt_ms))
    same = all(a.result.output_ids == answers[0].result.output_ids for a in answers)
    say("every answer is the plain API's text" if same else "an answer DIFFERS from the plain "
        "API's: split decoding must be lossless, please report it")
    landed = answers[-1].result.reconnects > 0
    if not landed:
        say("the link did not drop during the last answer: the demo missed its outage, please "
            "report it")
    return 0 if same and landed else 1


def main() -> int:
    separate = len(os.sched_getaffinity(0)) >= 2
    if separate:
        os.sched_setaffinity(0, EDGE_CORE)
    say("starting cloud-server (" + ("on core 0, the edge (this process) and the link on core 1"
                                     if separate else "one core: the server and the edge share it")
        + "; the first start converts the embedded model and builds the drafter bundle, about "
        "a minute)...")
    with cloud_server(cores=SERVER_CORE if separate else None) as server:
        say(f"cloud-server at {server}, the edge behind a simulated {LINK} link\n\n> {PROMPT}")
        return asyncio.run(demo(server))


if __name__ == "__main__":
    sys.exit(main())
