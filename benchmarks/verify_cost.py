"""The server's cost model, per weight format: one verification forward over a tree of n nodes
against one plain decoding step after the same prefix, as the server runs them (TargetModel,
the model thread), for fp32 weights with PyTorch's default CPU linear ("stock"), with oneDNN's
("onednn"), and the GGUF's 4-bit blocks in one onnxruntime graph ("q4"). A node pays for itself
only while it raises tau faster than it raises T_verify(n).

    python -m benchmarks.verify_cost --configs onednn,q4 --name verify_cost
"""
from __future__ import annotations

import argparse

from benchmarks.common import RESULTS, machine, markdown_table
from benchmarks.step_timing import plain_step_ms
from cloud_server import model_store
from cloud_server.calibrate import PREFIX_TOKENS, measure_verify_costs
from cloud_server.model_thread import ModelThread
from cloud_server.target import TargetModel

CONFIGS = {"stock": {"onednn": False, "weights": "fp32"},
           "onednn": {"onednn": True, "weights": "fp32"},
           "q4": {"weights": "q4", "gguf": None}}


def measure(config: str, max_nodes: int, repeat: int) -> tuple[float, tuple]:
    thread = ModelThread()  # load and run on one thread, as the server does
    kwargs = dict(CONFIGS[config])
    if "gguf" in kwargs:
        kwargs["gguf"] = model_store.gguf_of(model_store.DEFAULT_SPEC)
    target = thread.call(TargetModel.load, *model_store.resolve("default"), "cpu", **kwargs)
    plain = thread.call(plain_step_ms, target, repeat)
    costs = thread.call(measure_verify_costs, target, max_nodes, repeat)
    thread.shutdown()
    return plain, costs


def plot(results: dict[str, tuple[float, tuple]], name: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (config, (plain, costs)) in enumerate(results.items()):
        ax.plot([n for n, _ in costs], [ms for _, ms in costs], "o-", color=f"C{i}",
                label=f"{config}: tree forward")
        ax.axhline(plain, color=f"C{i}", linestyle=":", label=f"{config}: plain step")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("draft tree nodes")
    ax.set_ylabel("ms per forward")
    ax.set_title("SmolLM2-135M verification cost by weight format")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--configs", default="onednn,q4", help=f"of {', '.join(CONFIGS)}")
    p.add_argument("--max-nodes", type=int, default=32)
    p.add_argument("--repeat", type=int, default=9)
    p.add_argument("--name", default="verify_cost", help="output file stem")
    args = p.parse_args()
    configs = args.configs.split(",")
    if unknown := set(configs) - set(CONFIGS):
        p.error(f"unknown configs: {', '.join(sorted(unknown))}")
    results = {c: measure(c, args.max_nodes, args.repeat) for c in configs}
    first = configs[0]

    def cell(config: str, i: int | None) -> str:
        ms = results[config][0] if i is None else results[config][1][i][1]
        base = results[first][0] if i is None else results[first][1][i][1]
        return f"{ms:.1f} ms ({ms / results[config][0]:.2f}; {base / ms:.2f}x)"

    rows = [("plain step", *(cell(c, None) for c in configs))]
    rows += [(f"tree of {n}", *(cell(c, i) for c in configs))
             for i, (n, _) in enumerate(results[first][1])]
    table = markdown_table(("forward", *configs), rows)
    text = (f"prefix {PREFIX_TOKENS} tokens, SmolLM2-135M-Instruct; each cell: ms (x its own "
            f"plain step; speed-up over {first}); {machine()}\n\n{table}\n")
    print(text)
    (RESULTS / f"{args.name}.md").write_text(text)
    plot(results, args.name)


if __name__ == "__main__":
    main()
