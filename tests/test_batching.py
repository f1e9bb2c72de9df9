"""Batched verification: sessions of different lengths and tree sizes share forwards, and each
one's output is what it would be alone, greedy and seeded sampling alike."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from cloud_server.decoding.batching import Batcher
from cloud_server.model_thread import ModelThread
from cloud_server.decoding.server_decoding import ServerDecoder, decode_in_process, own_drafter
from cloud_server.decoding.session import Session
from cloud_server.target import PREFILL_CHUNK
from shared.acceptance import AcceptanceMode
from shared.drafting.base import DrafterName
from shared.messages import OpenRequest
from shared.sampling import SamplingParams
from shared.tree import DraftTree
from testkit.batched_runs import LIMITS, run_together
from testkit.device_under_test import load_target


def random_tree(rng: np.random.Generator, n: int, vocab: int) -> DraftTree:
    parents = tuple(-1 if i < 2 else int(rng.integers(-1, i)) for i in range(n))
    return DraftTree(tuple(int(t) for t in rng.integers(3, vocab, n)), parents)


def test_a_forward_hands_every_session_its_reads_in_one_copy_to_the_host(tiny_target,
                                                                         monkeypatch):
    """Each greedy job's argmax a row and each watching job's top-k come from one copy of the
    forward's results to the host: on a GPU one sync a forward, not one a session."""
    rng = np.random.default_rng(2)
    vocab = tiny_target.vocab_size
    jobs = []
    for n, greedy, k in ((3, True, 0), (9, True, 4), (5, False, 2), (4, False, 0)):
        cache, _ = tiny_target.prefill([int(t) for t in rng.integers(3, vocab, 6)])
        job = tiny_target.tree_job(cache, 5, random_tree(rng, n, vocab))
        job.greedy, job.successors_k = greedy, k
        jobs.append(job)
    copies = []
    copy = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **kw: copies.append(t) or copy(t))
    tiny_target.run(jobs)
    monkeypatch.undo()
    assert len(copies) == 1
    for job, (greedy, k) in zip(jobs, ((True, 0), (True, 4), (False, 2), (False, 0))):
        rows = job.logits.argmax(-1).numpy()
        assert (job.choices is not None) is greedy
        assert not greedy or job.choices.tolist() == rows.tolist()
        assert (job.successors is not None) is bool(k)
        if k:
            assert job.successors.tolist() == job.logits.topk(k, dim=-1).indices.tolist()


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Repetitive prompts (lookup drafts get accepted) of quite different lengths."""
    rng = np.random.default_rng(seed)
    return [[1, *[int(t) for t in rng.integers(3, 60, 8)] * (1 + 3 * i)] for i in range(count)]


def test_a_ragged_forward_gives_each_session_its_own_logits(tiny_target):
    rng = np.random.default_rng(1)
    vocab = tiny_target.vocab_size
    sessions = [(list(rng.integers(3, vocab, length)), random_tree(rng, n, vocab))
                for length, n in ((5, 0), (40, 3), (17, 12), (90, 7))]

    def jobs():
        made = []
        for ids, tree in sessions:
            cache, _ = tiny_target.prefill([int(t) for t in ids])
            made.append(tiny_target.tree_job(cache, int(ids[-1]), tree, capture=(0, 1)))
        return made

    alone = jobs()
    for job in alone:
        tiny_target.run([job])
    together = jobs()
    tiny_target.run(together)
    for a, b in zip(alone, together):
        torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-5)
        assert b.hidden is not None and a.hidden is not None
        torch.testing.assert_close(b.hidden, a.hidden, rtol=1e-5, atol=1e-5)
        assert b.cache.get_seq_length() == a.cache.get_seq_length()
        for la, lb in zip(a.cache.layers, b.cache.layers):
            torch.testing.assert_close(lb.keys, la.keys, rtol=1e-5, atol=1e-5)


def test_a_prompt_chunk_batched_with_a_tree_continues_like_a_whole_prefill(tiny_target):
    """A prompt longer than a chunk goes in pieces, each causal over what is cached; its final
    logits and cache match one prefill, whatever shares its forwards."""
    rng = np.random.default_rng(2)
    long = [int(t) for t in rng.integers(3, tiny_target.vocab_size, PREFILL_CHUNK + 40)]
    _, whole = tiny_target.prefill(long)
    other, _ = tiny_target.prefill(long[:30])
    cache = tiny_target.new_cache()
    work = tiny_target.prefill_jobs(cache, long)
    try:
        while True:
            job = next(work)
            tiny_target.run([job, tiny_target.tree_job(other, 5, random_tree(rng, 4, 300))])
            tiny_target.keep_path(other, 29, ())
    except StopIteration as done:
        last, _ = done.value
    torch.testing.assert_close(last.logits[-1], whole, rtol=1e-5, atol=1e-5)
    assert cache.get_seq_length() == len(long)


def alone(target, request: OpenRequest, drafter: DrafterName | None) -> list[int]:
    run = decode_in_process(target, request, own_drafter(drafter, LIMITS), 0, limits=LIMITS)
    return [t for v in run.verdicts for t in v.tokens]


@pytest.mark.parametrize("drafter", [pytest.param(None, marks=pytest.mark.slow), DrafterName.PLD])
def test_greedy_sessions_together_write_what_each_writes_alone(tiny_target, drafter):
    requests = [OpenRequest(prompt_ids=tuple(p), max_new_tokens=24 + 8 * i)
                for i, p in enumerate(prompts(5))]
    together, most = run_together(tiny_target, requests, drafter)
    assert most >= 3  # they really shared forwards
    assert together == [alone(tiny_target, r, drafter) for r in requests]


@pytest.mark.parametrize("mode", [  # one rule in make test, the others in make test-all
    AcceptanceMode.TOPK_DRAFTS, pytest.param(AcceptanceMode.SAMPLED_DRAFTS, marks=pytest.mark.slow),
    pytest.param(AcceptanceMode.EXPONENTIAL_RACE, marks=pytest.mark.slow)])
def test_seeded_sampling_together_writes_what_it_writes_alone(tiny_target, mode):
    requests = [OpenRequest(prompt_ids=tuple(p), max_new_tokens=32, acceptance=mode,
                            sampling=SamplingParams(temperature=0.8, seed=100 + i))
                for i, p in enumerate(prompts(4, seed=3))]
    together, most = run_together(tiny_target, requests, DrafterName.PLD)
    assert most >= 2
    assert together == [alone(tiny_target, r, DrafterName.PLD) for r in requests]


def test_without_batching_each_forward_runs_one_session(tiny_target):
    requests = [OpenRequest(prompt_ids=tuple(p), max_new_tokens=16) for p in prompts(3)]
    together, most = run_together(tiny_target, requests, DrafterName.PLD, max_tokens=0)
    assert most == 1
    assert together == [alone(tiny_target, r, DrafterName.PLD) for r in requests]


def test_work_starts_only_when_its_forward_runs(tiny_target):
    """Unbatched, sessions queue for the model: each one's work (and the clock its Verdict's
    verify_ms reads) starts with its own forward, not with the forwards it waits behind."""
    forwards = [0]

    def counted(_sessions: int, _tokens: int, _s: float) -> None:
        forwards[0] += 1

    def work():
        before = forwards[0]
        yield from tiny_target.prefill_jobs(tiny_target.new_cache(), [1, 5, 6, 7])
        return forwards[0] - before

    async def go() -> list[int]:
        batcher = Batcher(ModelThread(), tiny_target, 0, counted)
        try:
            return list(await asyncio.gather(*(batcher.run(work()) for _ in range(3))))
        finally:
            batcher.model_thread.shutdown()
    assert asyncio.run(go()) == [1, 1, 1]


def test_a_forward_takes_no_more_new_tokens_than_its_budget(tiny_target):
    """A budget smaller than two sessions' steps: still one at a time, all finish."""
    requests = [OpenRequest(prompt_ids=tuple(p), max_new_tokens=12) for p in prompts(3)]
    together, most = run_together(tiny_target, requests, None, max_tokens=1)
    assert most == 1
    assert together == [alone(tiny_target, r, None) for r in requests]


def test_one_sessions_error_leaves_the_others_running(tiny_target):
    good = OpenRequest(prompt_ids=tuple(prompts(1)[0]), max_new_tokens=16)

    def broken():
        raise ValueError("bad work")
        yield  # a generator: its error comes from the model thread, as a session's would

    async def go():
        batcher = Batcher(ModelThread(), tiny_target)
        try:
            session = await batcher.model_thread.run(Session.open, tiny_target, LIMITS, good)
            results = await asyncio.gather(batcher.run(broken()),
                                           batcher.run(session.prefilling()),
                                           return_exceptions=True)
            while not session.finished:
                await batcher.run(ServerDecoder(session, None, 0, ()).stepping())
            return results, session.committed[len(session.prompt_ids):]
        finally:
            batcher.model_thread.shutdown()
    results, generated = asyncio.run(go())
    assert isinstance(results[0], ValueError)
    assert generated == alone(tiny_target, good, None)


@pytest.mark.slow  # fp32 is the one the server runs by default: make test-all checks these
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_half_precision_target_batches_and_speculates_like_its_plain_decoding(
        tiny_model_dir, precision):
    """--dtype on the CPU (the GPU path's precisions): the model loads in it, and batched
    speculative sessions write what plain decoding in that precision writes."""
    target = load_target(str(tiny_model_dir), "tiny-llama", precision=precision)
    assert target.model.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    requests = [OpenRequest(prompt_ids=tuple(p), max_new_tokens=20) for p in prompts(3)]
    together, most = run_together(target, requests, DrafterName.PLD)
    assert most >= 2
    assert together == [alone(target, r, None) for r in requests]


def test_a_target_loads_in_fp32_unless_asked_on_a_gpu_too():
    """Only fp32 is token for token on a GPU (docs/usage.md, `--dtype`); the library's default
    once picked bf16 there, and the equivalence tests run with SPLITDEC_TEST_DEVICE=cuda
    failed."""
    import inspect

    from cloud_server.device import Precision
    from cloud_server.target import TargetModel

    assert inspect.signature(TargetModel.load).parameters["precision"].default is Precision.FP32


def test_sessions_whose_clients_answer_quickly_are_gathered_into_one_forward(tiny_target):
    """Two lock-step sessions whose clients answer within a fraction of a forward: without a
    short wait they fall into step, each forward running one of them; the batcher learns their
    turnaround and runs them together."""
    import dataclasses
    import time

    from cloud_server.target import TargetModel

    class SlowTarget(TargetModel):  # a forward as slow as a real model's, on the tiny one
        def run(self, jobs) -> None:
            time.sleep(0.04)
            super().run(jobs)

    slow = SlowTarget(**{f.name: getattr(tiny_target, f.name)
                         for f in dataclasses.fields(tiny_target)})
    sizes: list[int] = []

    async def client(batcher: Batcher, session: Session, key: str) -> None:
        decoder = ServerDecoder(session, None, 0, ())
        await batcher.run(session.prefilling(), key)
        for _ in range(12):
            await asyncio.sleep(0.001)  # the client's turnaround
            await batcher.run(decoder.stepping(), key)
        batcher.forget(key)

    async def go() -> None:
        batcher = Batcher(ModelThread(), slow, on_forward=lambda n, _t, _s: sizes.append(n))
        try:
            request = OpenRequest(prompt_ids=tuple(prompts(1)[0]), max_new_tokens=40)
            sessions = [await batcher.model_thread.run(Session.open, slow, LIMITS, request)
                        for _ in range(2)]
            first = asyncio.create_task(client(batcher, sessions[0], "a"))
            await asyncio.sleep(0.02)  # out of step from the start
            await asyncio.gather(first, client(batcher, sessions[1], "b"))
        finally:
            batcher.model_thread.shutdown()
    asyncio.run(go())
    assert sizes[-8:].count(2) >= 6, sizes


def test_a_session_that_misses_a_gathering_is_not_waited_for_again_until_it_is_back(
        tiny_target):
    """A client that stops reading costs the others one short wait, not one per forward."""
    import time

    from cloud_server.decoding.batching import _Rhythm

    async def go() -> tuple[bool, bool, bool]:
        batcher = Batcher(ModelThread(), tiny_target)
        try:
            gone = batcher._rhythms["gone"] = _Rhythm(time.monotonic(), turnaround_s=0.0)
            batcher._last_s = 0.05
            due_before = gone.due_by(time.monotonic() + 1)
            await batcher._gather()  # waits for it, in vain
            due_after = gone.due_by(time.monotonic() + 1)
            gone.submitted(time.monotonic())  # back: waited for again once idle
            gone.done_at = time.monotonic()
            return due_before, due_after, gone.due_by(time.monotonic() + 1)
        finally:
            batcher.model_thread.shutdown()
    assert asyncio.run(go()) == (True, False, True)
