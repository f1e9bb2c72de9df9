"""The drafter bundle's contract: what the server writes (cloud_server/moa/bundle.py) and the
edge reads (edge_client/drafters/moa_bundle.py, moa.py), named once.

A bundle is one directory: `bundle.json` (the manifest below), the edge half's ONNX graphs in
one or more precisions, and the drafter's designed tree when it has one (the edge fetches the
target's tokenizer as an artifact of its own). Each graph keeps its K/V state outside: the
memory graph turns verified rows into Cross-Attention keys and values, the step graph runs
drafting queries against those and the Self-Attention cache. The manifest lists every file's
sha256, so the hash of the manifest names the whole bundle.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

BUNDLE_FORMAT = 1
# a recurrent drafter's step graph takes and returns features (StepIO): an edge that predates
# it must refuse the bundle by its format rather than fail at its first draft
RECURRENT_FORMAT = 2
# a semi-autoregressive (Falcon) drafter's step graph is the same, but its outputs mean the
# tokens `block` positions on: an edge that predates it would draft garbage with it
BLOCK_FORMAT = 3
# Target Layer Inference: the step graph's K/V state has more heads (config "tli_layers"); an
# edge that predates it would size its state by kv_heads and fail at its first draft
TLI_FORMAT = 4
# mixed-precision graphs (Precision.MIXED): an edge that predates them would look for int8
# graphs the bundle no longer carries
MIXED_FORMAT = 5
FORMATS = (BUNDLE_FORMAT, RECURRENT_FORMAT, BLOCK_FORMAT, TLI_FORMAT, MIXED_FORMAT)
MANIFEST_NAME = "bundle.json"
# the names Info lists a bundle under: the edge picks its drafter by them before fetching
MOA_ARTIFACT = "drafter-moa"
FALCON_ARTIFACT = "drafter-falcon"
# a designed static tree's shape (edge_client/drafters/static_trees.py), in a drafter's directory
# and its bundle: a file older edges ignore, so no new format
CHOICES_FILE = "tree_choices.json"


class BundleError(ValueError):
    """A bundle that does not match its announced hash, its own manifest or this format."""


class Precision(Enum):
    FP32 = "fp32"
    INT8 = "int8"  # dynamic int8 (onnxruntime.quantization): a quarter of the bytes
    # int8 draft rows and layers, 2-bit other embedding rows (cloud_server/moa/quantize_mixed.py)
    MIXED = "mixed"


# the graphs an edge runs, best first, of those a bundle offers
EDGE_PREFERENCE = (Precision.MIXED, Precision.INT8, Precision.FP32)


class Memory(Enum):
    """What the drafter's Cross-Attention reads for verified positions."""

    ACTIVATIONS = "activations"  # the server half's output, carried by every Verdict (MoA)
    EMBEDDINGS = "embeddings"  # the tokens' own embeddings: the Independent baseline


class Graph(Enum):
    MEMORY = "memory"
    STEP = "step"


GRAPH_FILES = {
    Precision.FP32: {Graph.MEMORY: "memory.onnx", Graph.STEP: "step.onnx"},
    Precision.INT8: {Graph.MEMORY: "memory.int8.onnx", Graph.STEP: "step.int8.onnx"},
    Precision.MIXED: {Graph.MEMORY: "memory.mixed.onnx", Graph.STEP: "step.mixed.onnx"},
}


class MemoryIO:
    """The memory graph's inputs and outputs: rows [m, width] (activations) or [m] (ids, for
    a drafter whose memory is embeddings), positions [m] -> keys, values [kv_heads, m, hd]."""

    ACTIVATIONS = "activations"
    IDS = "ids"
    POSITIONS = "positions"
    KEYS = "mem_keys"
    VALUES = "mem_values"

    @staticmethod
    def rows(memory: Memory) -> str:
        return MemoryIO.ACTIVATIONS if memory is Memory.ACTIVATIONS else MemoryIO.IDS


class StepIO:
    """The step graph's inputs (queries, their positions, the SA cache, the tree mask, the
    memory) and outputs (logits, the top-k, the queries' own K/V; with Target Layer Inference
    the K/V state has more heads: BundleManifest.state_heads). A recurrent drafter's graph
    (config "recurrent") also takes each query's previous position's feature [q, width] and
    returns the queries' own features [q, width], in the activations' space."""

    IDS = "ids"
    POSITIONS = "positions"
    PAST_KEYS = "past_keys"
    PAST_VALUES = "past_values"
    ALLOWED = "allowed"
    MEM_KEYS = MemoryIO.KEYS
    MEM_VALUES = MemoryIO.VALUES
    FEATURES = "features"
    INPUTS = (IDS, POSITIONS, PAST_KEYS, PAST_VALUES, ALLOWED, MEM_KEYS, MEM_VALUES)
    OUTPUTS = ("logits", "top_logprobs", "top_ids", "keys", "values")
    OWN_FEATURES = "own_features"

    @staticmethod
    def inputs(recurrent: bool) -> tuple[str, ...]:
        return StepIO.INPUTS + (StepIO.FEATURES,) * recurrent

    @staticmethod
    def outputs(recurrent: bool) -> tuple[str, ...]:
        return StepIO.OUTPUTS + (StepIO.OWN_FEATURES,) * recurrent


@dataclass(frozen=True)
class BundleManifest:
    model_id: str
    top_k: int  # children per node the step graph returns
    config: dict[str, Any]  # the drafter's sizes (MoaConfig.to_dict): plain numbers
    files: dict[str, str]  # file name -> sha256
    graphs: dict[Precision, dict[Graph, str]] = field(default_factory=dict)

    @property
    def memory(self) -> Memory:
        return Memory(self.config.get("memory", Memory.ACTIVATIONS.value))

    @property
    def recurrent(self) -> bool:
        """Whether the drafter feeds its own features back (StepIO)."""
        return bool(self.config.get("recurrent", False))

    @property
    def block(self) -> int:
        """Tokens the drafter drafts per step: 1 for MoA, more for Falcon (MoaConfig.block)."""
        return int(self.config.get("block", 1))

    @property
    def tli_layers(self) -> int:
        """The target's last layers the step graph runs after the drafter's (MoaConfig)."""
        return int(self.config.get("tli_layers", 0))

    @property
    def state_heads(self) -> int:
        """Heads of the step graph's K/V state: the Self-Attention's, and as many per target
        layer it runs (StepIO)."""
        return int(self.config["kv_heads"]) * (1 + self.tli_layers)

    @property
    def designed_tree(self) -> bool:
        """Whether the bundle carries a designed tree (CHOICES_FILE) for `--tree designed`."""
        return CHOICES_FILE in self.files

    @property
    def artifact(self) -> str:
        """The name Info lists this bundle under."""
        return FALCON_ARTIFACT if self.block > 1 else MOA_ARTIFACT

    @property
    def preferred(self) -> Precision:
        """The precision an edge runs by default: the first of EDGE_PREFERENCE offered."""
        return next(p for p in EDGE_PREFERENCE if p in self.graphs)

    @property
    def format(self) -> int:
        """The newest format whose feature the bundle uses: an edge that knows it knows all."""
        return max((BUNDLE_FORMAT, RECURRENT_FORMAT * self.recurrent,
                    BLOCK_FORMAT * (self.block > 1), TLI_FORMAT * bool(self.tli_layers),
                    MIXED_FORMAT * (Precision.MIXED in self.graphs)))

    def graph(self, precision: Precision, graph: Graph) -> str:
        if precision not in self.graphs:
            offered = ", ".join(p.value for p in self.graphs)
            raise BundleError(f"precision {precision.value} not in the bundle: {offered}")
        return self.graphs[precision][graph]

    def to_json(self) -> str:
        data = {"format": self.format, "model_id": self.model_id, "top_k": self.top_k,
                "config": self.config, "files": self.files,
                "graphs": {p.value: {g.value: name for g, name in files.items()}
                           for p, files in self.graphs.items()}}
        return json.dumps(data, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "BundleManifest":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise BundleError(f"drafter bundle manifest is not JSON: {err}") from None
        if not isinstance(data, dict) or data.get("format") not in FORMATS:
            found = data.get("format") if isinstance(data, dict) else None
            raise BundleError(f"drafter bundle format {found} is not one of {FORMATS}: update "
                              "the edge client")
        try:
            graphs = {Precision(p): {Graph(g): name for g, name in files.items()}
                      for p, files in data["graphs"].items()}
            if not graphs:
                raise ValueError("it offers no graphs")
            return cls(data["model_id"], int(data["top_k"]), dict(data["config"]),
                       dict(data["files"]), graphs)
        except (KeyError, TypeError, AttributeError, ValueError) as err:
            raise BundleError(f"drafter bundle manifest is malformed: {err!r}") from None
