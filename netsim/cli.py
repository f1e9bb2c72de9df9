"""`netsim`: a TCP proxy that puts delay, jitter, bandwidth limits and outages between an edge
client and a cloud server (the model is in the package docstring, netsim/__init__.py).

    netsim --target 127.0.0.1:50051 --profile 4g
    netsim --listen 127.0.0.1:0 --target 127.0.0.1:50051 --profile delay=50,jitter=10,bw=20 \\
           --outage 5:3 --outage-mode blackhole
    netsim --target 127.0.0.1:50051 --profile 4g --signal-outage 2   # kill -USR1 cuts the link

Prints `listening on HOST:PORT` as its first line on stdout: point the edge client there. Delays
are one-way (RTT = 2 x delay). With --signal-outage, each SIGUSR1 begins an outage at once: for a
script that drops the link at a moment of the generation's, not of the clock's (`make demo`).
Stops on SIGTERM or SIGINT and prints its byte counts on stderr.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from dataclasses import replace
from typing import Callable, NoReturn, TypeVar

from netsim.conditions import (CONDITIONS_HELP, NetworkConditions, Outage, parse_address,
                               parse_conditions, parse_outage, parse_outage_mode)
from netsim.proxy import NetSimProxy

EXIT_USAGE = 2
T = TypeVar("T")


class _Parser(argparse.ArgumentParser):
    """Bad arguments print one line on stderr (not the usage block) and exit 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def _user_type(parse: Callable[[str], T]) -> Callable[[str], T]:
    """Wraps a parser from netsim.conditions so argparse shows its ValueError message."""
    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return convert


def _address(text: str) -> str:
    parse_address(text)
    return text


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _seconds(text: str) -> float:
    seconds = _number(text)
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return seconds


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _Parser(prog="netsim", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listen", type=_user_type(_address), default="127.0.0.1:0",
                   help="HOST:PORT to accept on (default 127.0.0.1:0, a free port)")
    p.add_argument("--target", type=_user_type(_address), required=True,
                   help="HOST:PORT of the server to forward to")
    p.add_argument("--profile", type=_user_type(parse_conditions),
                   default=NetworkConditions(), help=CONDITIONS_HELP + " (default: no delay)")
    p.add_argument("--outage", type=_user_type(parse_outage), action="append", default=[],
                   metavar="START:DURATION",
                   help="an outage START s after the proxy starts, DURATION s long; repeatable")
    p.add_argument("--outage-rate", type=_number, metavar="PER_MIN",
                   help="random outages per minute of up-time")
    p.add_argument("--outage-duration", type=_number, metavar="S",
                   help="length of each random outage in seconds")
    p.add_argument("--outage-mode", type=_user_type(parse_outage_mode), metavar="cut|blackhole",
                   help="cut: reset connections and refuse new ones; blackhole: pass nothing")
    p.add_argument("--signal-outage", type=_seconds, metavar="S",
                   help="each SIGUSR1 begins an outage of S seconds at once, in the outage mode")
    p.add_argument("--seed", type=int, help="seed of the jitter and the random outages")
    args = p.parse_args(argv)
    try:
        args.conditions = conditions_from(args)
    except ValueError as err:
        p.error(str(err))
    return args


def conditions_from(args: argparse.Namespace) -> NetworkConditions:
    """--profile, with the outage options added to or overriding what it says."""
    conditions: NetworkConditions = args.profile
    outages: tuple[Outage, ...] = conditions.outages + tuple(args.outage)
    overrides = {"outage_rate_per_min": args.outage_rate,
                 "outage_duration_s": args.outage_duration,
                 "outage_mode": args.outage_mode,
                 "seed": args.seed}
    given = {name: value for name, value in overrides.items() if value is not None}
    return replace(conditions, outages=outages, **given)


async def serve(listen: str, target: str, conditions: NetworkConditions,
                signal_outage_s: float | None = None) -> None:
    """Proxies until SIGTERM or SIGINT; with `signal_outage_s`, each SIGUSR1 begins an outage
    that long."""
    proxy = NetSimProxy(target, conditions, listen)
    await proxy.start()
    # Signals are caught before the address is printed: a stop or a cue may follow it at once.
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    described = conditions.describe()
    if signal_outage_s is not None:
        # the proxy holds each outage_now() task (and cancels it on stop) once it runs
        loop.add_signal_handler(signal.SIGUSR1,
                                lambda: loop.create_task(proxy.outage_now(signal_outage_s)))
        described += (f", on SIGUSR1 a {conditions.outage_mode.value} outage of "
                      f"{signal_outage_s:g} s")
    print(f"listening on {proxy.address}", flush=True)
    print(f"netsim: {proxy.address} -> {target}: {described}", file=sys.stderr, flush=True)
    await stopping.wait()
    await proxy.stop()
    s = proxy.stats()
    print(f"netsim: stopped: {s.connections} connections, {s.bytes_up} B up, "
          f"{s.bytes_down} B down, {s.outages} outages", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="netsim: %(message)s", stream=sys.stderr)
    try:
        asyncio.run(serve(args.listen, args.target, args.conditions, args.signal_outage))
    except OSError as err:
        print(f"netsim: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
