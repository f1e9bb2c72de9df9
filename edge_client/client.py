"""What the CLI and batch mode share: connect, check the server, fetch the tokenizer, generate."""
from __future__ import annotations

import sys
import time
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import Sequence

from tokenizers import Tokenizer

from shared.drafting.budget import TreeBudget
from edge_client.drafter_source import (
    TRAINED, DrafterPool, TreeShape, drafter_pool, resolve_drafter, sampling_acceptance,
)
from edge_client.generate import split_generate
from edge_client.reporting import GenerationResult, Listener
from edge_client.link import LinkConfig, LinkError, ServerLink
from edge_client.offline import LinkPolicy
from edge_client.server_only import SERVER_DRAFTER, Mode, server_generate
from edge_client.tokenizer import load_tokenizer
from shared import gc_freeze
from shared.acceptance import AcceptanceMode
from shared.drafter_bundle import BundleError
from shared.drafting.base import DrafterName
from shared.messages import (
    PROTOCOL_VERSION, ActivationFormat, ChatMessage, OpenRequest, Pace, ServerInfo,
)
from shared.sampling import SamplingParams

# The CLI's pace: the server paces and the edge's drafts join (docs/usage.md, "Pacing"). Library
# callers that leave ClientOptions.pace unset get the server's default (lockstep).
DEFAULT_PACE = Pace.AUTO
DEFAULT_DRAFTER = DrafterName.AUTO  # moa when the server offers it (measured best: moa_tau_gpu)


@dataclass(frozen=True)
class ClientOptions:
    drafter: DrafterName = DEFAULT_DRAFTER
    tree_nodes: int | None = None  # None: sized each round from measured costs (budget.py)
    max_new_tokens: int = 256
    sampling: SamplingParams = SamplingParams()
    acceptance: AcceptanceMode | None = None  # None: greedy, or the drafter's sampling mode
    stop_strings: tuple[str, ...] = ()
    link_policy: LinkPolicy = LinkPolicy()
    # For a drafter fed by the server half (MoA): how its activations travel.
    activation_format: ActivationFormat = ActivationFormat.FP16
    mode: Mode = Mode.SPLIT  # or a baseline the server runs alone (server_only.py)
    pace: Pace | None = None  # None: the server's default
    lead: int = 0  # paced sessions: tokens the server may run ahead; 0: the server's default
    # MoA: draft graphs (GSD), a token repeated at one depth drafted once and its subtree sent
    # once. Off by default: measured, it did not pay (results log, draft_graphs).
    draft_graphs: bool = False
    # MoA, Falcon under exponential-race: rank children by the session's race run on q (ERSD).
    # Off by default: little tau for much drafting time (results log, moa_tau_gpu).
    race_aware: bool = False
    server_drafter: str = SERVER_DRAFTER  # what the server drafts with under mode server-spec
    # A trained drafter's tree: the dynamic one, or the one designed for it, if its bundle
    # carries one (drafter_source.TreeShape).
    tree: TreeShape = TreeShape.DYNAMIC

    def __post_init__(self) -> None:
        # The library's boundary: a caller may name the drafter and the tree as text ("pld").
        object.__setattr__(self, "drafter", DrafterName(self.drafter))
        object.__setattr__(self, "tree", TreeShape(self.tree))
        if self.drafter is DrafterName.RECYCLE:
            raise ValueError("recycle drafts from the target's logits, so only the server runs "
                             "it: mode server-spec with server_drafter='recycle'")
        if (self.mode is Mode.SPLIT and self.tree is TreeShape.DESIGNED
                and self.drafter not in (*TRAINED, DrafterName.AUTO)):
            raise ValueError(f"{self.drafter} has no designed tree: --tree designed needs a "
                             "trained drafter (moa, falcon, or auto)")

    def open_request(self, prompt_ids: Sequence[int] | None = None,
                     chat: tuple[ChatMessage, ...] | None = None) -> OpenRequest:
        return OpenRequest(prompt_ids=None if prompt_ids is None else tuple(prompt_ids),
                           chat=chat, max_new_tokens=self.max_new_tokens,
                           sampling=self.sampling, acceptance=self._acceptance(),
                           stop_strings=self.stop_strings, pace=self.pace, lead=self.lead)

    def _acceptance(self) -> AcceptanceMode | None:
        if self.acceptance is not None or self.sampling.greedy:
            return self.acceptance
        return sampling_acceptance(self.drafter)


class EdgeClient:
    def __init__(self, address: str, options: ClientOptions, config: LinkConfig = LinkConfig(),
                 drafting: Executor | None = None, drafters: DrafterPool | None = None):
        """`drafting`: the threads split generations draft on, so that generations at once
        over this one link each draft on a thread of their own while the event loop streams
        the others' tokens (`edge-client serve`); None: on the event loop. `drafters`: a
        pool lent by the caller in place of the drafter the options name (benchmarks'
        drafters that cost nothing, testkit/profile_oracle.py)."""
        self.options = options
        self.drafting = drafting
        self._lent = drafters
        self.link = ServerLink(address, config)
        self._info: ServerInfo | None = None
        self._tokenizer: Tokenizer | None = None
        self._rtt_s = 0.0  # the link's round trip, as last measured (Open.rtt_ms)

    @property
    def info(self) -> ServerInfo:
        if self._info is None:
            raise LinkError("not connected: use the client as `async with EdgeClient(...)`")
        return self._info

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise LinkError("not connected: use the client as `async with EdgeClient(...)`")
        return self._tokenizer

    async def __aenter__(self) -> "EdgeClient":
        self._info = info = await self.link.info()
        if info.protocol_version != PROTOCOL_VERSION:
            raise LinkError(f"server speaks protocol v{info.protocol_version}, "
                            f"this client v{PROTOCOL_VERSION}")
        start = time.perf_counter()  # the channel is up: a second Info times the link alone
        await self.link.info()
        self._rtt_s = time.perf_counter() - start
        self._tokenizer = await load_tokenizer(self.link, info)
        if self.options.draft_graphs and not info.draft_graphs:
            raise LinkError(f"the server at {self.link.address} does not unroll draft graphs: "
                            "update it, or leave out --draft-graphs")
        self.link.draft_graphs = self.options.draft_graphs
        if self._lent is not None:
            self._drafters = self._lent
        elif self.options.mode is Mode.SPLIT:  # else the server drafts, if anyone does
            drafter = resolve_drafter(self.options.drafter, self.info)
            # first the pool: it says what the server lacks ('auto' with no trained drafter
            # and tree designed) before the options would refuse the resolved name
            try:
                self._drafters = await self._pool(drafter)
            except BundleError as err:  # the generation goes on, drafted as without a bundle
                print(f"the {drafter} drafter cannot run here ({err}); drafting with "
                      f"{DrafterName.PLD} instead", file=sys.stderr, flush=True)
                drafter = DrafterName.PLD
                self._drafters = await self._pool(drafter)
            self.options = replace(self.options, drafter=drafter)
        gc_freeze.freeze_loaded()  # the tokenizer and drafters: no pass walks them again
        return self

    async def _pool(self, drafter: DrafterName) -> DrafterPool:
        return await drafter_pool(drafter, self.link, self.info, self.options.draft_graphs,
                                  self.options.race_aware, self.options.tree)

    async def __aexit__(self, *exc) -> None:
        await self.link.__aexit__(*exc)

    def budget(self) -> TreeBudget:
        return TreeBudget(self.info.verify_costs, self.info.limits.max_tree_nodes,
                          fixed=self.options.tree_nodes)

    async def generate(self, request: OpenRequest,
                       listener: Listener | None = None) -> GenerationResult:
        if self.options.mode is not Mode.SPLIT:
            return await server_generate(self.link, request, self.options.mode, listener,
                                         self.options.server_drafter)
        if self._drafters.needs_activations:
            request = replace(request, activations=self.options.activation_format)
        # the server's pace starts from it: on a link too slow for drafts, no rows cross
        request = replace(request, rtt_ms=max(1, round(1000 * self._rtt_s)))
        with self._drafters.checkout() as drafter:
            result = await split_generate(
                self.link, drafter, request, self.budget(), listener, self.options.link_policy,
                self.info.limits, self.drafting)
        self._rtt_s = result.rtt_s or self._rtt_s
        return result

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids
