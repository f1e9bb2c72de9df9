"""Which engine runs a loaded model: `--weights`, `--engine`, `--cuda-graphs` and
`--tensor-parallel` against what each engine can run. An engine asked for that cannot run the
model says why in one line and names the one that will."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from cloud_server.device import EngineChoice, Graphs, Weights
from cloud_server.engine import static_llama, tensor_parallel
from cloud_server.engine.cpu_kernels import use_onednn_linear
from cloud_server.engine.cuda_graphs import Rehearsal, Replay
from cloud_server.engine.interface import Engine
from cloud_server.engine.modules_parallel import ModulesJob, ModulesParallelEngine, no_plan
from cloud_server.engine.parallel_engine import ShardJob, TensorParallelEngine
from cloud_server.engine.ranks import OnLost
from cloud_server.engine.static_engine import SlotPlan, StaticEngine
from cloud_server.engine.transformers_engine import ModulesEngine


def pick_engine(model: Any, device: torch.device, weights: Weights, choice: EngineChoice,
                graphs: Graphs, plan: SlotPlan, gguf: Path | None, onednn: bool,
                ranks: int = 1, on_rank_lost: OnLost | None = None) -> Engine:
    """`graphs` rehearse picks as CUDA does, whatever the device: the static engine where it
    runs the model, padded to the buckets and captured at startup, each shape run eagerly
    under the graphs' contract (Rehearsal). `ranks` > 1: the static engine split over that
    many ranks (parallel_engine.py), `on_rank_lost` told if one goes."""
    if ranks > 1:
        return _tensor_parallel(model, device, weights, choice, graphs, plan, ranks,
                                on_rank_lost)
    quantized = _quantized(model, weights, gguf, graphs)
    if quantized is not None:
        return quantized
    why = static_llama.unsupported(model)
    if choice is EngineChoice.STATIC and why is not None:
        raise ValueError(f"--engine static cannot run it: {why}; --engine transformers will")
    _check_graphs(graphs, device)
    as_cuda = device.type == "cuda" or graphs is Graphs.REHEARSE
    static = choice is EngineChoice.STATIC or (
        choice is EngineChoice.AUTO and why is None and as_cuda)
    if static:
        return StaticEngine(model, device, plan, _graph_kind(graphs, device))
    if onednn and device.type == "cpu":
        use_onednn_linear(model)
    return ModulesEngine(model, device)


def _tensor_parallel(model: Any, device: torch.device, weights: Weights, choice: EngineChoice,
                     graphs: Graphs, plan: SlotPlan, ranks: int, on_lost: OnLost | None
                     ) -> Engine:
    """The static engine over `ranks` ranks where it runs the model (auto) or is asked for,
    else the transformers engine split by the model's own plan (modules_parallel.py); every
    rank (rank 0 too) runs on its share of the CPU's cores, so that the ranks do not take
    each other's."""
    if weights is Weights.Q4:
        raise ValueError("--tensor-parallel runs unquantized weights, not --weights q4")
    unsupported = static_llama.unsupported(model)
    modules = choice is EngineChoice.TRANSFORMERS or (
        choice is EngineChoice.AUTO and unsupported is not None)
    if choice is EngineChoice.STATIC and unsupported is not None:
        raise ValueError(f"--engine static cannot run it: {unsupported}; --engine "
                         "transformers will")
    devices = torch.cuda.device_count() if device.type == "cuda" else None
    why = tensor_parallel.unfit(model.config, ranks, devices)
    if modules:
        why = no_plan(model.config) or why
    if why is not None:
        raise ValueError(f"--tensor-parallel {ranks} cannot run it: {why}")
    _check_graphs(graphs, device)
    threads = max(1, (os.cpu_count() or 1) // ranks)
    torch.set_num_threads(threads)
    if modules:
        if graphs in (Graphs.ON, Graphs.REHEARSE):
            raise ValueError(f"--cuda-graphs {graphs.value} is the static engine's")
        return ModulesParallelEngine.start(
            ModulesJob(model.name_or_path, model.dtype, device.type), ranks, threads,
            on_lost=on_lost)
    kind = _graph_kind(graphs, device)
    job = ShardJob(model.name_or_path, model.dtype, device.type, plan, kind, kind is not None)
    return TensorParallelEngine.start(model, job, ranks, threads, on_lost=on_lost)


def _check_graphs(graphs: Graphs, device: torch.device) -> None:
    if graphs is Graphs.ON and device.type != "cuda":
        raise ValueError("--cuda-graphs on needs the target on CUDA (--device cuda)")


def _graph_kind(graphs: Graphs, device: torch.device) -> type[Replay] | type[Rehearsal] | None:
    kinds = {Graphs.ON: Replay, Graphs.OFF: None, Graphs.REHEARSE: Rehearsal,
             Graphs.AUTO: Replay if device.type == "cuda" else None}
    return kinds[graphs]


def _quantized(model: Any, weights: Weights, gguf: Path | None, graphs: Graphs) -> Engine | None:
    """The 4-bit engine for `model` when `weights` asks for it. auto asks for it only for a
    model converted from a 4-bit GGUF, where it runs the shipped blocks, and no graphs are
    asked for (they are the static engine's): a user's checkpoint keeps its precision unless
    `--weights q4` rounds it."""
    graphs_asked = graphs in (Graphs.ON, Graphs.REHEARSE)
    if weights is Weights.FP32 or (weights is Weights.AUTO and (gguf is None or graphs_asked)):
        return None
    if graphs_asked:
        raise ValueError(f"--cuda-graphs {graphs.value} is the static engine's; --weights q4 "
                         "runs the 4-bit engine (--weights fp32 runs the static one)")
    from cloud_server.engine import onnx_engine

    why = onnx_engine.unsupported(model)
    if model.device.type != "cpu" or model.dtype != torch.float32:
        why = why or "it runs on the CPU from fp32 weights only (--device cpu --dtype fp32)"
    if why is not None:
        if weights is Weights.Q4:
            raise ValueError(f"--weights q4 cannot run it: {why}; --weights fp32 will")
        return None
    engine = onnx_engine.OnnxEngine(model.config, onnx_engine.llama_weights(model, gguf),
                                    model.get_input_embeddings(), torch.get_num_threads())
    engine.warm_up()
    return engine

