"""The processes of a tensor-parallel target and how they meet: rank 0 is the server's own
process; it starts ranks 1 .. N-1 as children (`python -m cloud_server.engine.rank_worker`),
hands each its spec on its stdin and from then on every message (a forward's jobs) down the
same pipe, one write a rank a message. The ranks meet on torch.distributed: a TCPStore on
loopback for the rendezvous, then a process group for the collectives (gloo on the CPU, NCCL
on CUDA), as torchrun would set them up, without its agent.

Deadlines: a rank waits for its next message on its pipe, not in a collective, so an idle
server holds no collective open, and the pipe's end (rank 0 gone) ends the rank. Every
collective waits at most the group's timeout (`COLLECTIVE_S`). Rank 0 watches its children: one
that exits unasked is a lost rank; the others are killed, every later message is refused
with the reason (shared.errors.Unavailable) and `on_lost` is told, once. Knows nothing of
models: what a message means is parallel_engine.py's.
"""
from __future__ import annotations

import atexit
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import IO, Any, BinaryIO, Callable

import torch.distributed as dist

from shared.errors import SplitDecodingError, Unavailable

STARTUP_S = 600.0  # a rank loading its shard of a large checkpoint
COLLECTIVE_S = 60.0  # one collective inside a forward: far above any forward's time
STOP_S = 10.0  # a rank's exit once its pipe is closed
REAP_S = 2.0  # how long a failed collective waits to see whether a rank exited
LOAD_POLL_S = 0.2  # how often the start looks whether a loading rank said it is done
LOOPBACK = "127.0.0.1"

OnLost = Callable[[str], None]
Group = Any  # a torch.distributed backend over all ranks: ProcessGroupGloo, ProcessGroupNCCL


@dataclass(frozen=True)
class RankSpec:
    """What rank `rank` of `ranks` is told on its stdin: where to meet, the deadline of each
    collective, its CPU threads and what to build (`job`, parallel_engine.ShardJob)."""

    rank: int
    ranks: int
    store_port: int
    collective_s: float
    threads: int
    job: Any


def loaded_key(rank: int) -> str:
    return f"splitdec/loaded/{rank}"


def join(store: dist.TCPStore, rank: int, ranks: int, backend: str, collective_s: float,
         default: bool = False) -> Group:
    """The group the ranks' collectives run in, each waiting at most `collective_s`. Made
    as a group of its own rather than torch.distributed's default one, which a process holds
    once (a test process starts and stops several), unless `default`: transformers' tensor
    parallel plan runs on the default group (Ranks.stop ends it)."""
    prefixed = dist.PrefixStore("splitdec/tp", store)
    timeout = timedelta(seconds=collective_s)
    if default:
        dist.init_process_group(backend, store=prefixed, rank=rank, world_size=ranks,
                                timeout=timeout)
        return dist.distributed_c10d._get_default_group()
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, ranks, options)
    return dist.ProcessGroupGloo(prefixed, rank, ranks, timeout)


def rank_store(port: int) -> dist.TCPStore:
    return dist.TCPStore(LOOPBACK, port, is_master=False, timeout=timedelta(seconds=STARTUP_S))


def use_loopback() -> None:
    """gloo binds the interface GLOO_SOCKET_IFNAME names, else the address the host name
    resolves to: the ranks are one node, so loopback unless the operator says otherwise."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


class Ranks:
    """Rank 0's handle on the other ranks: `send` a message to all, `lost` once one is gone."""

    def __init__(self, procs: list[subprocess.Popen], store: dist.TCPStore, group: Group,
                 backend: str, on_lost: OnLost | None, default: bool = False):
        self.procs = procs
        self._default = default  # the group is torch.distributed's default one
        self.store = store  # the rendezvous, which the group's setup reads
        self.group = group
        self.backend = backend
        self.lost: str | None = None
        self._on_lost = on_lost
        self._stopping = False
        self._lock = threading.Lock()
        for rank, proc in enumerate(procs, start=1):
            threading.Thread(target=self._watch, args=(rank, proc), daemon=True,
                             name=f"rank-{rank}").start()
        atexit.register(self.stop)

    @property
    def count(self) -> int:
        return len(self.procs) + 1

    @classmethod
    def start(cls, ranks: int, job: Any, backend: str, threads: int,
              collective_s: float = COLLECTIVE_S, on_lost: OnLost | None = None) -> "Ranks":
        """Starts ranks 1 .. `ranks` - 1, each building `job`, and joins them as rank 0 once
        each has loaded its part; a rank that exits first fails the start with its code. A
        job that `joins_first` (its loading runs collectives) is joined at once, on the
        default group: the caller loads its own part, then calls `await_loaded`."""
        use_loopback()
        store = dist.TCPStore(LOOPBACK, 0, ranks, is_master=True,
                              timeout=timedelta(seconds=STARTUP_S), wait_for_workers=False)
        procs = [subprocess.Popen([sys.executable, "-m", "cloud_server.engine.rank_worker"],
                                  stdin=subprocess.PIPE) for _ in range(1, ranks)]
        first = job.joins_first
        try:
            for rank, proc in enumerate(procs, start=1):
                _write(proc.stdin, RankSpec(rank, ranks, store.port, collective_s, threads, job))
            if not first:
                _await_loads(store, procs)
            group = join(store, 0, ranks, backend, collective_s, default=first)
        except BaseException:
            _kill(procs)
            raise
        return cls(procs, store, group, backend, on_lost, default=first)

    def await_loaded(self) -> None:
        """Until every other rank has loaded its part (Ranks.start's `joins_first`)."""
        try:
            _await_loads(self.store, self.procs)
        except BaseException:
            self.stop()
            raise

    def send(self, message: Any) -> None:
        """`message` to every other rank, or Unavailable once a rank is lost."""
        if self.lost is not None:
            raise Unavailable(self.lost)
        data = pickle.dumps(message)
        for rank, proc in enumerate(self.procs, start=1):
            try:
                assert proc.stdin is not None
                proc.stdin.write(data)
                proc.stdin.flush()
            except (OSError, ValueError) as err:  # its pipe broke, or was closed as it died
                raise self.lose(f"rank {rank} of {self.count} took no message ({err})") from err

    def together(self, message: Any, mine: Callable[[], None]) -> None:
        """Sends `message`, then runs rank 0's part. Once it is sent, a failure on rank 0 is
        a lost group (the others wait in collectives it will not reach), but for a refusal
        that every rank makes at the same point (a full slot: Overloaded)."""
        self.send(message)
        try:
            mine()
        except SplitDecodingError:
            raise
        except Exception as err:
            raise self.failed(err) from err

    def lose(self, why: str) -> Unavailable:
        """Marks the group lost (the first reason stays), stops the ranks left and tells
        `on_lost`; returns the error to raise where the loss was found."""
        with self._lock:
            first = self.lost is None and not self._stopping
            if first:
                self.lost = f"tensor parallel: {why}; the server is stopping"
        if first:
            print(self.lost, file=sys.stderr, flush=True)
            for proc in self.procs:  # one may be inside a collective, or hung: no pipe
                if proc.poll() is None:  # reaches it
                    proc.kill()
            self._end_all()
            if self._on_lost is not None:
                self._on_lost(self.lost)  # type: ignore[arg-type]
        return Unavailable(self.lost or why)

    def failed(self, err: Exception) -> Unavailable:
        """A collective failed on rank 0: lost, by a rank that exited if one did (a peer's
        closed connection shows before its exit does), else by `err` (a missed deadline)."""
        deadline = time.monotonic() + REAP_S
        for rank, proc in enumerate(self.procs, start=1):
            try:
                code = proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                continue
            return self.lose(f"rank {rank} of {self.count} {_exit(code)}")
        return self.lose(f"a collective failed on rank 0 ({err})")

    def stop(self) -> None:
        """Ends every rank: their pipes closed, each exits at once."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        self._end_all()
        if self._default and dist.is_initialized():
            dist.destroy_process_group()

    def _end_all(self) -> None:
        for proc in self.procs:
            if proc.stdin is not None and not proc.stdin.closed:
                try:
                    proc.stdin.close()
                except OSError:  # its pipe broke with it
                    pass
        for proc in self.procs:
            try:
                proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self._stopping:
            self.lose(f"rank {rank} of {self.count} {_exit(code)}")


def _await_loads(store: dist.TCPStore, procs: list[subprocess.Popen]) -> None:
    for rank, proc in enumerate(procs, start=1):
        _await_load(store, rank, len(procs) + 1, proc)


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()


def _await_load(store: dist.TCPStore, rank: int, ranks: int, proc: subprocess.Popen) -> None:
    """Until the rank says it has loaded; one that exits first, or takes past STARTUP_S,
    fails the start."""
    deadline = time.monotonic() + STARTUP_S
    while not store.check([loaded_key(rank)]):
        try:
            code = proc.wait(LOAD_POLL_S)
        except subprocess.TimeoutExpired:
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {rank} of {ranks} did not load the target in "
                                   f"{STARTUP_S:.0f} s") from None
            continue
        raise RuntimeError(f"rank {rank} of {ranks} {_exit(code)} while loading the target "
                           "(its lines above)")


def follow(pipe: BinaryIO, handle: Callable[[Any], None]) -> None:
    """On a rank r > 0: `handle`s rank 0's messages from `pipe` until it ends (rank 0
    stopped, or is gone)."""
    while True:
        try:
            message = pickle.load(pipe)
        except EOFError:
            return
        handle(message)


def _write(pipe: IO[bytes] | None, message: Any) -> None:
    assert pipe is not None
    pipe.write(pickle.dumps(message))
    pipe.flush()


def _exit(code: int) -> str:
    if code < 0:
        return f"was killed ({signal.Signals(-code).name})"
    return f"exited with code {code}"
