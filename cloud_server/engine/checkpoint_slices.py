"""A checkpoint's weights read a slice at a time, straight from its safetensors files: what a
tensor-parallel rank holds of a target without loading the rest (tensor_parallel.shard).

safetensors maps each file and reads only the bytes of the rows and columns asked for, so a
rank of N keeps about 1/N of the layers (and the whole embedding) of its own, beside the page
cache the ranks share. Loading the whole checkpoint first cost a rank the same where it is
served in the dtype it is stored in (transformers maps it lazily too); served in another
dtype, every rank converted all of it (results log, `rank_memory`).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointSlices:
    """The tensors of the checkpoint in `path` by name (its files named by the index, or the
    one file)."""

    def __init__(self, path: Path):
        index = path / INDEX
        if index.is_file():
            files = json.loads(index.read_text())["weight_map"]
            self._file_of = {name: path / file for name, file in files.items()}
        elif (path / SINGLE).is_file():
            with safe_open(str(path / SINGLE), "pt") as handle:
                self._file_of = {name: path / SINGLE for name in handle.keys()}
        else:
            raise FileNotFoundError(f"{path} holds no safetensors checkpoint ({INDEX} or "
                                    f"{SINGLE})")
        self._open: dict[Path, object] = {}

    def missing(self, names: list[str]) -> list[str]:
        """Those of `names` the checkpoint does not hold."""
        return [name for name in names if name not in self._file_of]

    def read(self, name: str, rows: slice, cols: slice) -> torch.Tensor:
        """Rows `rows` and (for a matrix) columns `cols` of tensor `name`, as stored."""
        file = self._file_of[name]
        if file not in self._open:
            self._open[file] = safe_open(str(file), "pt")
        part = self._open[file].get_slice(name)  # type: ignore[attr-defined]
        return part[rows] if len(part.get_shape()) == 1 else part[rows, cols]
