"""Progress for the long waits (the bundle download, the GGUF conversion, the bundle build,
answer generation, training): a tqdm bar with rate and ETA on a terminal; nothing in a pipe or
under `--quiet`, where the long jobs print their own log lines instead (`log_lines`)."""
from __future__ import annotations

import os
import sys

from tqdm import tqdm

QUIET_ENV = "SPLITDEC_QUIET"  # set by --quiet; inherited by the processes a command starts


def set_quiet() -> None:
    os.environ[QUIET_ENV] = "1"


def quiet() -> bool:
    return bool(os.environ.get(QUIET_ENV))


def shown() -> bool:
    """Whether bars are drawn: stderr is a terminal and nobody asked for quiet."""
    return sys.stderr.isatty() and not quiet()


def log_lines() -> bool:
    """Whether a long job prints plain progress lines: in a pipe or a log file, not quiet."""
    return not shown() and not quiet()


def bar(total: float | None, desc: str, unit: str = "it", bytes_: bool = False,
        initial: int = 0) -> tqdm:
    """A bar on stderr; a disabled one (every call a no-op) where bars are not shown."""
    return tqdm(total=total, desc=desc, unit="B" if bytes_ else unit, unit_scale=bytes_,
                unit_divisor=1024 if bytes_ else 1000, initial=initial, file=sys.stderr,
                disable=not shown(), dynamic_ncols=True, leave=False, mininterval=0.25)
