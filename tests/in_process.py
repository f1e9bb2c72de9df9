"""Split greedy decoding in one process, through the server's own session and loop."""
from __future__ import annotations

from cloud_server.decoding.server_decoding import decode_in_process
from shared.messages import OpenRequest


def split_greedy(target, server, drafter, prompt: list[int], max_new: int,
                 max_nodes: int) -> tuple[list[int], list[int]]:
    """(the generated tokens, the tokens each forward committed); `server` is the server half
    (None for a drafter that reads no activations)."""
    request = OpenRequest(prompt_ids=tuple(prompt), max_new_tokens=max_new)
    run = decode_in_process(target, request, drafter, max_nodes, server)
    return ([t for v in run.verdicts for t in v.tokens],
            [len(v.tokens) for v in run.verdicts[1:]])
