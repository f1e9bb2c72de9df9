"""How fast the target writes training answers through the static engine (issue 55, item 1),
measured on this CPU in answer tokens per forward-second, and projected for an H100.

1. The real target (SmolLM2-135M, fp32, the static engine eager, as the CPU runs it) answers
   training prompts at each --batches size through cloud_server/training/engine_answers.py,
   capturing the last layer's output in the same forwards: answer tokens over the seconds spent
   inside the engine's forwards (this shared machine's other load inflates wall time more).
   transformers' batched loop (data.answer_batch, the path the committed drafter's data took)
   is timed beside it for reference, its whole call counted as forward time.
2. The host's share of a step, which CUDA graphs do not remove: the same loop over the tiny
   test model at --host-batches, the milliseconds a step spends outside the forwards (a step's
   input arrays, finishing sessions); inside a replayed forward the host only launches the
   graph, the head and the argmax, and copies the tokens back (~0.1 ms, added).
3. The projection: an H100 step at B sessions = host(B) + launch floor + bytes / bandwidth
   (the arithmetic in the table's notes; `static_steps_cpu` for the floor). A projection, not a
   measurement: `benchmarks.drafter_run --sizes h100 --device cuda` measures it.

    python -m benchmarks.answer_throughput [--batches 16,64] [--prompts-per-batch 2]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import RESULTS, machine, markdown_table, write_results

# H100 SXM and SmolLM2-135M in bf16 (the projection's assumptions, stated in the output)
HBM_BYTES_PER_S = 3.35e12
LAUNCH_FLOOR_MS = (1.4, 2.7)  # ~900 kernels a replayed step at 1.5-3 us each (static_steps_cpu)
WEIGHT_BYTES = 270e6
KV_BYTES_PER_POSITION = 30 * 2 * 3 * 64 * 2  # layers x (K, V) x kv heads x head_dim x bf16
KV_PASSES = 3  # the engine gathers each row's slot (a read and a write), then SDPA reads it
PREFILL_FLOPS_PER_TOKEN = 2 * 135e6
EFFECTIVE_FLOPS = 400e12  # bf16, a dense product of thousands of rows at ~40% of peak
HOST_IN_FORWARD_MS = 0.1  # a replay, the head, the argmax, the tokens' copy back


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="16,64", help="sessions decoding at once (real model)")
    p.add_argument("--prompts-per-batch", type=int, default=2,
                   help="prompts answered at each batch size, in multiples of the batch")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--host-batches", default="16,64,256,512",
                   help="batch sizes the host's share of a step is timed at (tiny model)")
    p.add_argument("--project-batches", default="64,128,256,512")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--threads", type=int, default=0,
                   help="torch's CPU threads (0: its default); on a machine shared with other "
                        "jobs one thread is steadier: two wait on each other at every op")
    p.add_argument("--name", default="answer_throughput")
    return p.parse_args(argv)


def training_prompts(target, count: int, max_prompt_tokens: int) -> list[list[int]]:
    from cloud_server.training import data, prompt_sources

    texts = prompt_sources.training_prompts(("eval-framework", "sharegpt", "chitchat"))
    return data.encode_prompts(target, texts[:2 * count], max_prompt_tokens)[:count]


def engine_run(target, prompts: list[list[int]], batch: int, max_new: int,
                prompt_tokens: int) -> dict:
    """Answers `prompts` through the static engine: tokens per forward-second, and the host's
    milliseconds a step outside the forwards (building a step's arrays, finishing sessions)."""
    from cloud_server.training.engine_answers import EngineAnswers, answer_engine

    layers = target.model.config.num_hidden_layers
    engine = answer_engine(target.model, target.device, batch, prompt_tokens + max_new,
                           prompt_tokens)
    answering = EngineAnswers(engine, target.stop_token_ids(), (layers - 1,))
    began, began_cpu = time.perf_counter(), time.process_time()
    tokens = sum(len(answer) for _, answer, _ in answering.answers(prompts, max_new))
    wall, cpu = time.perf_counter() - began, time.process_time() - began_cpu
    return {"batch": batch, "answer_tokens": tokens, "forwards": answering.forwards,
            "forward_s": answering.forward_s, "wall_s": wall,
            "tokens_per_forward_s": tokens / answering.forward_s,
            "sessions_per_forward": tokens / answering.forwards,
            "host_ms_per_step": 1000 * (wall - answering.forward_s) / answering.forwards,
            # CPU time, not wall: on a shared machine the wall time waits for other jobs
            "host_cpu_ms_per_step": 1000 * (cpu - answering.forward_cpu_s) / answering.forwards}


def transformers_run(target, prompts: list[list[int]], batch: int, max_new: int) -> dict:
    from cloud_server.training.data import answer_batch

    began, tokens = time.perf_counter(), 0
    for i in range(0, len(prompts), batch):
        tokens += sum(map(len, answer_batch(target, prompts[i: i + batch], max_new)))
    seconds = time.perf_counter() - began
    return {"batch": batch, "answer_tokens": tokens, "forward_s": seconds,
            "tokens_per_forward_s": tokens / seconds}


def project(batch: int, host_ms: float, context: int, prompt_len: float,
            answer_len: float) -> tuple[float, float]:
    """H100 answer tokens/s at `batch` sessions (best, worst launch floor)."""
    kv_ms = 1000 * KV_PASSES * batch * context * KV_BYTES_PER_POSITION / HBM_BYTES_PER_S
    weights_ms = 1000 * WEIGHT_BYTES / HBM_BYTES_PER_S
    # a prompt is prefilled padded to its bucket once per answer: per answer token
    prefill_ms = 1000 * prompt_len * PREFILL_FLOPS_PER_TOKEN / EFFECTIVE_FLOPS / answer_len
    rates = []
    for floor in LAUNCH_FLOOR_MS:
        step_ms = host_ms + HOST_IN_FORWARD_MS + floor + weights_ms + kv_ms
        rates.append(1000 / (step_ms / batch + prefill_ms))
    return rates[0], rates[1]


def main(argv: list[str] | None = None) -> dict:
    from cloud_server import model_store
    from cloud_server.target import TargetModel
    from testkit.tiny_model import build_tiny_model

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    batches = [int(b) for b in args.batches.split(",") if b.strip()]  # "": host only
    real, reference = [], []
    target = TargetModel.load(*model_store.resolve("default"), "cpu") if batches else None
    pool = training_prompts(target, max(batches, default=0) * args.prompts_per_batch,
                            args.max_prompt_tokens) if batches else []
    for batch in batches:
        prompts = pool[:batch * args.prompts_per_batch]
        real.append(engine_run(target, prompts, batch, args.max_new_tokens,
                               args.max_prompt_tokens))
        print(json.dumps(real[-1]), flush=True)
        if not args.skip_transformers:
            reference.append(transformers_run(target, prompts, batch, args.max_new_tokens))
            print(json.dumps(reference[-1]), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = TargetModel.load(str(build_tiny_model(Path(tmp))), "tiny", "cpu")
    host = []
    for batch in (int(b) for b in args.host_batches.split(",")):
        prompts = [[1, *range(3 + i % 50, 60 + i % 50)] for i in range(2 * batch)]
        host.append(engine_run(tiny, prompts, batch, 64, 64))
        print(json.dumps(host[-1]), flush=True)
    # the recipe's answers: prompts to 256 tokens, answers to 160; slots of 416 positions
    context, prompt_bucket, answer_len = 416, 256, 130
    host_ms = {h["batch"]: h["host_cpu_ms_per_step"] for h in host}
    projected = []
    for batch in (int(b) for b in args.project_batches.split(",")):
        known = max((b for b in host_ms if b <= batch), default=min(host_ms))
        ms = host_ms[known] * batch / known  # the host's work grows with the sessions
        best, worst = project(batch, ms, context, prompt_bucket, answer_len)
        projected.append({"batch": batch, "host_ms": ms, "best": best, "worst": worst})
    text = report(args, real, reference, host, projected)
    write_results(args.name, text)
    summary = {"cpu": real, "transformers": reference, "host": host, "h100": projected}
    (RESULTS / f"{args.name}.json").write_text(json.dumps(summary, indent=1))
    print(text)
    return summary


def report(args, real, reference, host, projected) -> str:
    rows = [(r["batch"], r["answer_tokens"], f"{r['forward_s']:.1f}",
             f"{r['tokens_per_forward_s']:.0f}", f"{r['sessions_per_forward']:.1f}",
             f"{ref['tokens_per_forward_s']:.0f}" if ref else "-")
            for r, ref in zip(real, reference or [None] * len(real))]
    host_rows = [(h["batch"], f"{h['host_ms_per_step']:.2f}", f"{h['host_cpu_ms_per_step']:.2f}",
                  f"{1000 * h['host_cpu_ms_per_step'] / h['batch']:.1f}") for h in host]
    proj_rows = [(p["batch"], f"{p['host_ms']:.2f}", f"{p['worst'] / 1000:.1f}",
                  f"{p['best'] / 1000:.1f}") for p in projected]
    return (
        f"Training answers through the static engine (eager, fp32, last layer captured, "
        f"{torch.get_num_threads()} torch threads), "
        f"{args.max_new_tokens} new tokens a prompt, {args.prompts_per_batch} x batch training "
        f"prompts; {machine()}\n\n"
        + markdown_table(("sessions", "answer tokens", "forward s", "tokens per forward-s",
                          "tokens per forward", "transformers loop tokens/s"), rows)
        + "\n\nHost time a step outside the model's math (tiny model, same loop and engine):\n\n"
        + markdown_table(("sessions", "host wall ms / step", "host CPU ms / step",
                          "host CPU us / session"), host_rows)
        + "\n\nProjected for an H100 (bf16, CUDA graphs), answer tokens/s in thousands: a step "
        f"= host (above, its CPU time on this CPU) + a launch floor of {LAUNCH_FLOOR_MS[1]}-"
        f"{LAUNCH_FLOOR_MS[0]} ms + 270 MB of weights + {KV_PASSES} passes over B x 416 "
        f"positions of {KV_BYTES_PER_POSITION} KV bytes at 3.35 TB/s; each answer of ~130 "
        "tokens also pays its prompt's prefill, padded to 256 tokens, at 400 TFLOP/s. A "
        "projection, not a measurement:\n\n"
        + markdown_table(("sessions", "host ms / step", "k tokens/s (floor 2.7 ms)",
                          "k tokens/s (floor 1.4 ms)"), proj_rows) + "\n")


if __name__ == "__main__":
    main()
