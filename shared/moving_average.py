"""The exponential moving average every running estimate here keeps (a forward's time, a reply
time, tokens a forward commits, a session's turnaround, a generation's running time).

One function over a plain float, so an estimate stays a field its holder reads and sets directly.
"""
from __future__ import annotations


def ema(average: float | None, value: float, weight: float) -> float:
    """`average` moved `weight` of the way towards the new measurement `value`; `value` itself
    while nothing is measured yet (`average` None). A weight of 0.2 lets about the last five
    measurements count."""
    return value if average is None else (1 - weight) * average + weight * value
