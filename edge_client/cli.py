"""`edge-client`: answer one prompt with live output, a JSONL file of prompts (`run`), or
serve an OpenAI-compatible HTTP endpoint (`serve`).

    edge-client --server HOST:PORT "prompt"
    edge-client run --server HOST:PORT --prompts IN.jsonl --out OUT.jsonl
    edge-client serve --server HOST:PORT [--port 8000]
"""
from __future__ import annotations

import os

# Before grpc is imported: grpc core logs a dropped link at INFO ("Got goaway ... ping_timeout");
# the CLI reports link events itself, in one line a user can read. Set GRPC_VERBOSITY to see
# grpc's own again. Only the program does this: importing the edge_client library does not.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import argparse
import asyncio
import contextlib
import sys
from pathlib import Path
from typing import Iterator

from edge_client.batch_mode import BadInput, run_batch
from edge_client.client import DEFAULT_DRAFTER, DEFAULT_PACE, ClientOptions, EdgeClient
from edge_client.drafter_source import TreeShape
from edge_client.display import TerminalView
from edge_client.reporting import GenerationResult
from edge_client.link import LinkConfig, LinkError
from edge_client.openai_compat.admission import PER_CORE, QUEUE_PER_SLOT
from edge_client.security import ClientSecurity
from edge_client.offline import LinkPolicy, OfflinePolicy
from edge_client.server_only import SERVER_DRAFTER, Mode
from shared import progress
from shared.auth import TOKEN_VARIABLE, read_token
from shared.acceptance import AcceptanceMode
from shared.drafting import SERVER_DRAFTERS
from shared.drafting.base import DrafterName
from shared.messages import ActivationFormat, ChatMessage, Pace
from netsim import CONDITIONS_HELP, NetworkConditions, ProxyThread, parse_conditions
from shared.sampling import SamplingParams

EXIT_USAGE, EXIT_LINK = 2, 3
# What the edge's drafting reads: --mode split only (the baselines draft on the server or not
# at all); --server-drafter is read by --mode server-spec only.
SPLIT_ONLY = ("drafter", "activations", "tree_nodes", "tree", "pace", "lead", "draft_graphs",
              "race_aware", "no_pipeline")


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", required=True, help="HOST:PORT of a cloud-server")
    edge_drafters = [d.value for d in DrafterName if d is not DrafterName.RECYCLE]
    p.add_argument("--drafter", choices=edge_drafters, default=DEFAULT_DRAFTER,
                   help="split: 'moa', 'falcon': the trained drafter the server offers (fetched "
                        "once, cached; falcon drafts several tokens a step); pld, aded: "
                        "training-free; 'auto': the trained drafter the server offers, else "
                        "pld (default %(default)s)")
    p.add_argument("--activations", choices=[f.name.lower() for f in ActivationFormat],
                   default="fp16", help="split: how the MoA drafter's activations travel")
    p.add_argument("--max-new-tokens", type=positive, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 (default): off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 (default): off")
    p.add_argument("--seed", type=int, default=None,
                   help="makes a sampled answer reproducible (docs/usage.md, Sampling: which rules "
                        "replay from which drafts)")
    p.add_argument("--stop", action="append", default=[], metavar="STRING",
                   help="end the answer with the token that completes STRING (repeatable)")
    p.add_argument("--acceptance", choices=[m.value for m in AcceptanceMode], default=None,
                   help="verification rule; default: greedy, or when sampling the drafter's "
                        "measured best (topk-drafts for pld and aded)")
    p.add_argument("--network", type=network_conditions, default=None, metavar="SPEC",
                   help="route through a simulated network (netsim/): "
                        + CONDITIONS_HELP)
    p.add_argument("--offline-policy", choices=[m.value for m in OfflinePolicy],
                   default=OfflinePolicy.DRAFT.value,
                   help="when the link drops: 'draft' (default) goes on with the drafter alone "
                        "and has the server check that text when the link is back; 'wait' "
                        "drafts nothing; 'keep' drafts and, if the server never returns, keeps "
                        "the unverified text (and says so)")
    p.add_argument("--offline-limit", type=positive, default=LinkPolicy.offline_limit,
                   help="unverified tokens to draft at most before waiting (default %(default)s)")
    p.add_argument("--reconnect-timeout", type=float, default=LinkPolicy.reconnect_timeout_s,
                   metavar="S", help="give up after S seconds without the server (default "
                                     "%(default)s; 0: fail at the first drop)")
    p.add_argument("--mode", choices=[m.value for m in Mode], default=Mode.SPLIT.value,
                   help="'split' (default): draft here, verify on the server; the baselines "
                        "through the same link: 'server-spec' (the server speculates with its "
                        "own drafter, --server-drafter) and 'plain-api' (the server decodes "
                        "token by token)")
    p.add_argument("--server-drafter", choices=SERVER_DRAFTERS, default=SERVER_DRAFTER,
                   help="server-spec: what the server drafts with; 'recycle' (Token Recycling) "
                        "needs a server that runs it (default %(default)s)")
    p.add_argument("--pace", choices=[m.value for m in Pace], default=DEFAULT_PACE.value,
                   help="split: 'auto' (default): the server runs forward after forward and "
                        "waits for a draft in flight only while that pays; 'server': it never "
                        "waits; 'lockstep': one forward per draft, the fewest forwards")
    p.add_argument("--lead", type=positive, default=None, metavar="N",
                   help="paced split: tokens the server may commit past what this client has "
                        "received (default: the server's --lead)")
    p.add_argument("--draft-graphs", action="store_true",
                   help="moa: merge a token drafted twice at one depth into one node and send "
                        "each repeated subtree once (GSD draft graphs); off by default, as "
                        "measured it does not pay (results log, draft_graphs)")
    p.add_argument("--race-aware", action="store_true",
                   help="moa, falcon under --acceptance exponential-race: rank each node's "
                        "children by how likely the session's race picks each, from log q and "
                        "the race's noise as fitted on the committed text (ERSD); off by "
                        "default, as it costs drafting time for little tau "
                        "(results log, moa_tau_gpu)")
    p.add_argument("--tree", choices=[t.value for t in TreeShape],
                   default=TreeShape.DYNAMIC.value,
                   help="moa, falcon: 'dynamic' (default): EAGLE-2's tree, grown each round by "
                        "the drafter's confidence; 'designed': the static tree designed for the "
                        "drafter from its measured ranks (Falcon's CDDT), if its bundle carries "
                        "one; they tied (results log, drafter_ablation_cddt)")
    p.add_argument("--no-pipeline", action="store_true",
                   help="lockstep: do not draft the next tree while a round is in flight")
    p.add_argument("--tls", action="store_true",
                   help="connect over TLS, checking the server against the system's roots")
    p.add_argument("--tls-ca", metavar="PEM",
                   help="connect over TLS, checking the server against this CA certificate")
    p.add_argument("--tls-cert", metavar="PEM",
                   help="mutual TLS: this client's certificate (cloud-server --tls-client-ca)")
    p.add_argument("--tls-key", metavar="PEM", help="mutual TLS: the certificate's private key")
    p.add_argument("--auth-token-file", metavar="FILE",
                   help="send the token in this file with every call (cloud-server "
                        f"--auth-token-file); without it, the token in {TOKEN_VARIABLE}, if set")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar for the drafter's download (a pipe gets none either)")
    p.add_argument("--tree-nodes", type=tree_nodes, default=None,
                   help="split: draft nodes per round, or 'auto' (default): sized each round "
                        "from the server's measured verify cost and the drafter's measured "
                        "acceptance")


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def network_conditions(text: str) -> NetworkConditions:
    try:
        return parse_conditions(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


@contextlib.contextmanager
def server_path(args: argparse.Namespace) -> Iterator[str]:
    """The address to dial: the server itself, or a netsim proxy in front of it."""
    if args.network is None:
        yield args.server
        return
    with ProxyThread(args.server, args.network) as proxy:
        print(f"[network: {args.network.describe()}]", file=sys.stderr)
        yield proxy.address


def tree_nodes(text: str) -> int | None:
    return None if text == "auto" else positive(text)


def parse_args(argv: list[str]) -> argparse.Namespace:
    if argv[:1] == ["run"]:
        p = argparse.ArgumentParser(prog="edge-client run", description="batch mode")
        add_common(p)
        p.add_argument("--prompts", type=Path, required=True, help="input JSONL")
        p.add_argument("--out", type=Path, required=True, help="output JSONL")
        args = p.parse_args(argv[1:])
        args.command = "run"
        return args
    if argv[:1] == ["serve"]:
        p = argparse.ArgumentParser(
            prog="edge-client serve",
            description="an OpenAI-compatible endpoint (/v1/chat/completions, /v1/completions, "
                        "/v1/models) backed by split decoding; a field a request leaves out "
                        "takes the value of the flag below")
        add_common(p)
        p.add_argument("--host", default="127.0.0.1", help="address to listen on")
        p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
        p.add_argument("--max-concurrent", type=positive, default=None, metavar="N",
                       help="requests answered at once, each with a drafter of its own over "
                            f"the one link (default: {PER_CORE} per core, at most the server's "
                            "session limit)")
        p.add_argument("--max-queue", type=non_negative, default=None, metavar="N",
                       help="requests waiting for a turn past those; one more is refused with "
                            f"429 and Retry-After (default: {QUEUE_PER_SLOT} per "
                            "--max-concurrent)")
        args = p.parse_args(argv[1:])
        args.command = "serve"
        return args
    p = argparse.ArgumentParser(prog="edge-client", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(p)
    p.add_argument("--no-chat-template", action="store_true",
                   help="send the prompt's tokens as they are, without the chat template")
    p.add_argument("prompt")
    args = p.parse_args(argv)
    args.command = "ask"
    return args


def stats_line(r: GenerationResult, drafter: str) -> str:
    line = (f"[{drafter}: {len(r.output_ids)} tokens, {r.tokens_per_s:.1f} tok/s, "
            f"{r.rounds} rounds, tau {r.tau:.2f}, {r.server_calls} server calls, "
            f"{r.bytes_up} B up / {r.bytes_down} B down, ttft {r.ttft_s * 1000:.0f} ms")
    if r.drafts.settled:
        d = r.drafts
        line += f", drafts {d.used} used ({d.earned} earned), {d.late} late, {d.wrong} wrong"
    if r.speculations:
        line += (f", pipelined {r.speculation_hits}/{r.speculations} rounds "
                 f"({1000 * r.hidden_draft_s:.0f} ms drafting hidden)")
    if r.reconnects or r.offline_tokens:
        line += (f", {r.reconnects} reconnects, {r.outage_s:.1f} s offline, "
                 f"{r.offline_tokens} offline tokens ({r.kept_tokens} kept, "
                 f"{r.corrected_tokens} corrected)")
    if r.unverified_ids:
        line += f", {len(r.unverified_ids)} tokens UNVERIFIED (server never returned)"
    return line + f", {r.finish_reason.name.lower()}]"


async def ask(args: argparse.Namespace, options: ClientOptions, address: str) -> int:
    async with EdgeClient(address, options, link_config(args)) as client:
        if args.no_chat_template:
            request = client.options.open_request(prompt_ids=client.encode(args.prompt))
        else:
            request = client.options.open_request(chat=(ChatMessage("user", args.prompt),))
        view = TerminalView(client.tokenizer, sys.stdout, sys.stderr)
        result = await client.generate(request, view)
        view.kept_unverified(result.unverified_ids)
    print(flush=True)
    label = client.options.drafter if options.mode is Mode.SPLIT else options.mode.value
    print(stats_line(result, label), file=sys.stderr)
    return 0


async def batch(args: argparse.Namespace, options: ClientOptions, address: str) -> int:
    async with EdgeClient(address, options, link_config(args)) as client:
        ok, failed = await run_batch(client, args.prompts, args.out)
    print(f"[{ok} done, {failed} failed -> {args.out}]", file=sys.stderr)
    return 0 if failed == 0 else 1


async def serve(args: argparse.Namespace, options: ClientOptions, address: str) -> int:
    from edge_client.openai_compat.serving import Capacity, serve as serve_http

    await serve_http(address, options, args.host, args.port, link_config(args),
                     Capacity(args.max_concurrent, args.max_queue))
    return 0


def link_config(args: argparse.Namespace) -> LinkConfig:
    """The link's security from the flags; files are read here, so a bad path fails early."""
    if (args.tls_cert is None) != (args.tls_key is None):
        raise BadInput("--tls-cert and --tls-key go together")
    try:
        security = ClientSecurity(
            tls=args.tls, root_certificates=_read(args.tls_ca), auth_token=auth_token(args),
            certificate_chain=_read(args.tls_cert), private_key=_read(args.tls_key))
    except ValueError as err:
        raise BadInput(str(err)) from None
    return LinkConfig(security=security)


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


def auth_token(args: argparse.Namespace) -> str | None:
    """From --auth-token-file, else the environment (never a flag: a process list shows those)."""
    if args.auth_token_file is not None:
        return read_token(args.auth_token_file)
    return os.environ.get(TOKEN_VARIABLE, "").strip() or None


def unread_flags(args: argparse.Namespace) -> list[str]:
    """The flags given a value other than their default that `--mode` does not read, so a user
    comparing modes is told, not left to believe, that e.g. `--drafter moa` shaped a
    server-spec run."""
    mode = Mode(args.mode)
    unread: tuple[str, ...] = () if mode is Mode.SPLIT else SPLIT_ONLY
    if mode is not Mode.SERVER_SPEC:
        unread += ("server_drafter",)
    defaults = argparse.ArgumentParser()
    add_common(defaults)
    return ["--" + dest.replace("_", "-") for dest in unread
            if getattr(args, dest) != defaults.get_default(dest)]


def options_from(args: argparse.Namespace) -> ClientOptions:
    acceptance = None if args.acceptance is None else AcceptanceMode(args.acceptance)
    if not args.reconnect_timeout >= 0:
        raise BadInput(f"--reconnect-timeout must be >= 0, got {args.reconnect_timeout}")
    policy = LinkPolicy(offline=OfflinePolicy(args.offline_policy),
                        offline_limit=args.offline_limit,
                        reconnect_timeout_s=args.reconnect_timeout,
                        pipeline=not args.no_pipeline)
    try:  # sampling settings, or a combination of flags, the options refuse
        sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
        return ClientOptions(DrafterName(args.drafter), args.tree_nodes, args.max_new_tokens,
                             sampling, acceptance, tuple(args.stop), policy,
                             ActivationFormat[args.activations.upper()], Mode(args.mode),
                             Pace(args.pace), args.lead or 0, draft_graphs=args.draft_graphs,
                             race_aware=args.race_aware, server_drafter=args.server_drafter,
                             tree=TreeShape(args.tree))
    except ValueError as err:
        raise BadInput(str(err)) from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.quiet:
        progress.set_quiet()
    try:
        options = options_from(args)
    except BadInput as err:
        print(f"edge-client: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    if unread := unread_flags(args):
        print(f"edge-client: note: --mode {args.mode} does not read {', '.join(unread)}",
              file=sys.stderr)
    command = {"ask": ask, "run": batch, "serve": serve}[args.command]
    try:
        with server_path(args) as address:
            return asyncio.run(command(args, options, address))
    except (LinkError, BadInput, OSError) as err:
        print(f"edge-client: error: {err}", file=sys.stderr)
        return EXIT_LINK if isinstance(err, LinkError) else EXIT_USAGE
    except KeyboardInterrupt:
        print("\nedge-client: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
