"""The server's cost model: one verification forward over a tree of n nodes vs one plain decode
step after the same prefix (docs/performance.md), with PyTorch's default CPU linear and with
oneDNN's. A node pays for itself only while it raises tau faster than it raises T_verify(n).

    python benchmarks/verify_cost.py
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import RESULTS, machine, markdown_table
from cloud_server import model_store
from cloud_server.calibrate import PREFIX_TOKENS, measure_verify_costs
from cloud_server.model_thread import ModelThread
from cloud_server.target import TargetModel


def plain_step_ms(target: TargetModel, repeat: int) -> float:
    """A decode step as plain greedy decoding runs it: one token, no mask."""
    cache, _ = target.prefill(list(range(100, 100 + PREFIX_TOKENS)))
    samples = []
    for _ in range(repeat + 1):
        start = time.perf_counter()
        with torch.inference_mode():
            target.model(input_ids=torch.tensor([[42]]), past_key_values=cache, use_cache=True)
        cache.crop(-1)
        samples.append(1000 * (time.perf_counter() - start))
    return statistics.median(samples[1:])


def measure(onednn: bool, max_nodes: int, repeat: int) -> tuple[float, tuple]:
    thread = ModelThread()  # load and run on one thread, as the server does
    target = thread.call(TargetModel.load, *model_store.resolve("default"), "cpu", onednn=onednn)
    plain = thread.call(plain_step_ms, target, repeat)
    costs = thread.call(measure_verify_costs, target, max_nodes, repeat)
    thread.shutdown()
    return plain, costs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--max-nodes", type=int, default=64)
    p.add_argument("--repeat", type=int, default=9)
    args = p.parse_args()
    results = {name: measure(name == "onednn", args.max_nodes, args.repeat)
               for name in ("stock", "onednn")}
    rows = [("plain decode step", *(f"{results[k][0]:.1f} ms (1.00)" for k in results))]
    for i, (n, _) in enumerate(results["stock"][1]):
        rows.append((f"tree of {n}", *(f"{results[k][1][i][1]:.1f} ms "
                                       f"({results[k][1][i][1] / results[k][0]:.2f})"
                                       for k in results)))
    table = markdown_table(("forward (x plain step)", "stock linear", "oneDNN linear"), rows)
    text = f"prefix {PREFIX_TOKENS} tokens, SmolLM2-135M-Instruct fp32; {machine()}\n\n{table}\n"
    print(text)
    (RESULTS / "verify_cost.md").write_text(text)


if __name__ == "__main__":
    main()
