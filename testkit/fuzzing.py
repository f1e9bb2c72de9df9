"""The Decode contract's fuzzer, shared by `tests/test_fuzz_contract.py` (a few hundred cases in
`make test`) and `benchmarks/reliability.py` (ten thousand and more): hypothesis strategies for
client messages, sequences of them and mutated wire bytes; `play` sends one to a server and
returns the status the call ended with; `fuzz` runs a strategy many times and tallies."""
from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge_client.client import ClientOptions, EdgeClient
from edge_client.link import LinkError
from shared.messages import PROTOCOL_VERSION
from shared.pb.splitdec.v1 import splitdec_pb2 as pb
from shared.pb.splitdec.v1 import splitdec_pb2_grpc as pb_grpc

HEALTHY_PROMPT = (5, 6, 7, 8, 5, 6, 7)
# A status the server owes a bad message; anything else (INTERNAL, UNKNOWN, a deadline: a hang)
# is a defect. One exception, on the client's side: grpcio's aio client reports INTERNAL
# "Internal error from Core" when it is still writing as the server ends the call (measured:
# the server had refused all 100 of 100 such calls with INVALID_ARGUMENT); the server's own
# count of internal errors (metrics) then decides.
CLEAR = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
         grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND,
         grpc.StatusCode.OUT_OF_RANGE}
CLIENT_RACE = (grpc.StatusCode.INTERNAL, "Internal error from Core")
CLIENT_RACE_NAME = "refused while the client still wrote (client-side INTERNAL)"

ids = st.one_of(st.integers(-3, 330), st.sampled_from([-2**31, 2**31 - 1, 0, 1, 2]))
uint32 = st.one_of(st.integers(0, 70), st.sampled_from([2**32 - 1, 2**31, 4096, 100_000]))
floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
enums = st.integers(0, 7)  # past the last value too: proto3 keeps unknown enum numbers
# Mostly this protocol's version, so that Opens get past the version check to the rest
versions = st.one_of(st.just(PROTOCOL_VERSION), st.just(PROTOCOL_VERSION), uint32)
# Strings a protobuf library can serialize (no lone surrogates); raw bytes are mutated below.
texts = st.text(st.characters(exclude_categories=("Cs",)), max_size=20)


@st.composite
def opens(draw) -> pb.Open:
    msg = pb.Open(max_new_tokens=draw(uint32), acceptance=draw(enums),
                  activations=draw(enums), pace=draw(enums), lead=draw(uint32),
                  protocol_version=draw(versions), rtt_ms=draw(uint32),
                  stop_token_ids=draw(st.lists(ids, max_size=3)),
                  stop_strings=draw(st.lists(texts, max_size=3)),
                  sampling=pb.Sampling(temperature=draw(floats), top_k=draw(uint32),
                                       top_p=draw(floats)))
    if draw(st.booleans()):
        msg.sampling.seed = draw(st.integers(0, 2**64 - 1))
    if draw(st.booleans()):
        msg.input_ids.ids.extend(draw(st.lists(ids, max_size=12)))
    else:
        msg.chat.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in draw(
            st.lists(st.tuples(st.sampled_from(["user", "system", "robot", ""]),
                               texts), max_size=3)))
    if draw(st.booleans()):
        msg.resume.session_id = draw(texts)
        msg.resume.generated_ids.extend(draw(st.lists(ids, max_size=8)))
    return msg


@st.composite
def drafts(draw) -> pb.Draft:
    n = draw(st.integers(0, 10))
    msg = pb.Draft(round_id=draw(uint32), base_length=draw(uint32),
                   tokens=draw(st.lists(ids, min_size=n, max_size=n)),
                   parents=draw(st.lists(st.integers(-3, 12), min_size=n,
                                         max_size=draw(st.sampled_from([n, n, n + 1])))))
    for _ in range(draw(st.integers(0, 2))):
        msg.q.append(pb.DraftQ(node=draw(st.integers(-2, 12)),
                               tokens=draw(st.lists(ids, max_size=4)),
                               probs=draw(st.lists(floats, max_size=4))))
    return msg


@st.composite
def plausible_starts(draw) -> list[pb.ClientMessage]:
    """A valid Open, then lock-step drafts that get past the stream checks to verification:
    where the deeper bugs would be."""
    prompt = draw(st.lists(st.integers(3, 319), min_size=1, max_size=12))
    new = draw(st.integers(1, 8))
    msg = pb.Open(input_ids=pb.TokenIds(ids=prompt), max_new_tokens=new,
                  sampling=pb.Sampling(temperature=draw(st.sampled_from([0.0, 0.7]))),
                  acceptance=draw(st.integers(0, 4)), pace=draw(st.integers(0, 3)),
                  lead=draw(st.integers(0, 4)), protocol_version=PROTOCOL_VERSION,
                  rtt_ms=draw(st.integers(0, 200)))
    if msg.sampling.temperature:
        msg.sampling.seed = draw(st.integers(0, 99))
    out = [pb.ClientMessage(open=msg)]
    for round_id in range(1, draw(st.integers(0, 3)) + 1):
        draft = draw(drafts())
        draft.round_id, draft.base_length = round_id, len(prompt) + round_id
        out.append(pb.ClientMessage(draft=draft))
    return out


messages = st.one_of(opens().map(lambda m: pb.ClientMessage(open=m)),
                     drafts().map(lambda m: pb.ClientMessage(draft=m)),
                     st.just(pb.ClientMessage(close=pb.Close())))
sequences = st.one_of(
    st.tuples(plausible_starts(), st.lists(messages, max_size=2)).map(lambda t: t[0] + t[1]),
    st.tuples(opens().map(lambda m: pb.ClientMessage(open=m)),
              st.lists(messages, max_size=4)).map(lambda t: [t[0], *t[1]]),
    st.lists(messages, min_size=1, max_size=4))


@st.composite
def mutated(draw) -> list[bytes]:
    """The bytes of a plausible sequence with some flipped, cut or inserted: corrupt wire
    format, invalid UTF-8 in strings, fields the schema never had."""
    raws = [m.SerializeToString() for m in draw(plausible_starts())]
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(raws) - 1))
        raw = bytearray(raws[i])
        at = draw(st.integers(0, len(raw)))
        action = draw(st.sampled_from(["flip", "cut", "insert"]))
        if action == "flip" and at < len(raw):
            raw[at] ^= draw(st.integers(1, 255))
        elif action == "cut":
            del raw[at:]
        else:
            raw[at:at] = draw(st.binary(min_size=1, max_size=6))
        raws[i] = bytes(raw)
    return raws


async def play(address: str, sequence: list[pb.ClientMessage] | list[bytes]
               ) -> tuple[grpc.StatusCode, str]:
    """Sends the sequence (messages, or raw bytes as they would be on the wire), half-closes,
    reads to the end: the status the call ended with."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = (channel.stream_stream("/splitdec.v1.SplitDecoding/Decode")(timeout=10)
                if sequence and isinstance(sequence[0], bytes)
                else pb_grpc.SplitDecodingStub(channel).Decode(timeout=10))
        # The server may end the call before the client has written everything.
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            for msg in sequence:
                if call.done():
                    break
                await call.write(msg)
            await call.done_writing()
        with contextlib.suppress(grpc.aio.AioRpcError):
            async for _ in call:
                pass
        return await call.code(), await call.details()


def is_clear(code: grpc.StatusCode, details: str) -> bool:
    return code is grpc.StatusCode.OK or code in CLEAR or (code, details) == CLIENT_RACE


@dataclass
class Tally:
    """What a fuzzing run tried and how the calls ended."""
    sequences: int = 0
    messages: int = 0
    codes: Counter = field(default_factory=Counter)  # status name -> calls

    def summary(self) -> str:
        return ", ".join(f"{c} {n}" for c, n in self.codes.most_common())


def fuzz(address: str, strategy: Any, examples: int, tally: Tally) -> None:
    """Plays `examples` cases drawn from `strategy` against the server at `address`, counting
    them in `tally`; raises AssertionError (after hypothesis shrinks it) on the first call that
    ends without a clear status."""
    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def one(sequence: list[pb.ClientMessage] | list[bytes]) -> None:
        code, details = asyncio.run(play(address, sequence))
        tally.sequences += 1
        tally.messages += len(sequence)
        tally.codes[CLIENT_RACE_NAME if (code, details) == CLIENT_RACE else code.name] += 1
        if tally.sequences % 1000 == 0:
            print(f"  {tally.sequences} cases: {tally.summary()}", file=sys.stderr, flush=True)
        assert is_clear(code, details), (code, details, sequence)

    one()


class Healthy(threading.Thread):
    """Greedy generations of HEALTHY_PROMPT, one after another, until stopped. When the
    fuzzer's orphaned sessions fill the server's table, an Open is refused RESOURCE_EXHAUSTED
    until the idle timeout frees them: counted in `refused`, retried as the status asks."""

    def __init__(self, address: str, new_tokens: int):
        super().__init__(daemon=True)
        self.address, self.new_tokens = address, new_tokens
        self.stop, self.outputs, self.refused = threading.Event(), [], 0

    def run(self) -> None:
        async def generations() -> None:
            async with EdgeClient(self.address, ClientOptions("pld", 4, self.new_tokens)) as client:
                while not self.stop.is_set():
                    try:
                        result = await client.generate(
                            client.options.open_request(prompt_ids=HEALTHY_PROMPT))
                    except LinkError as err:
                        if err.code != "resource_exhausted":
                            raise
                        self.refused += 1
                        await asyncio.sleep(0.5)  # the backoff the refusal asks of a client
                        continue
                    self.outputs.append(result.output_ids)
        asyncio.run(generations())
