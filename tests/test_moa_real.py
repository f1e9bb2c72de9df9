"""The committed MoA and Falcon drafters on the real SmolLM2 target: exported, fed in-process
by the server half, their split greedy output equals plain greedy decoding and they get drafts
accepted; Falcon's bundle carries the tree designed for it, and drafting that does too."""
from __future__ import annotations

import pytest

from testkit.device_under_test import load_target
from tests.in_process import split_greedy
from shared.messages import ChatMessage, Limits

pytestmark = pytest.mark.slow

PROMPT = "Explain in three sentences why the sky is blue."
# The static engine's KV slots (where the device under test picks it) for what the tests run:
# the defaults' 16 slots of 6273 positions hold 4.6 GB in fp32
SLOTS = Limits(max_tree_nodes=32, max_prompt_tokens=256, max_new_tokens=64, max_sessions=2)


@pytest.fixture(scope="module")
def real_target():
    from cloud_server import model_store

    return load_target(*model_store.resolve("default"), limits=SLOTS)


@pytest.mark.parametrize("falcon, designed", [(False, False), (True, False), (True, True)],
                         ids=["moa", "falcon", "falcon-designed"])
def test_committed_drafter_is_lossless_and_accepts(real_target, tmp_path, falcon, designed):
    from cloud_server.moa.activations import ServerActivations
    from cloud_server.moa.bundle import build_bundle
    from cloud_server.moa.weights import committed_drafter
    from cloud_server.reference import compare, plain_greedy
    from edge_client.drafter_source import designed_tree
    from edge_client.drafters.trained import trained_drafter
    from edge_client.drafters.tree_search import TreeSearch
    from shared.drafter_bundle import Precision
    from shared.drafting.base import DrafterName

    drafter_dir = committed_drafter(real_target.model_id, falcon)
    if drafter_dir is None:
        pytest.skip(f"no {'Falcon' if falcon else 'MoA'} drafter committed for "
                    f"{real_target.model_id}")
    bundle = build_bundle(drafter_dir, real_target.model, real_target.model_id, tmp_path)
    server = ServerActivations.load(drafter_dir, real_target.model)
    choices = designed_tree(DrafterName.FALCON, bundle) if designed else None
    drafter = trained_drafter(bundle, DrafterName.FALCON if falcon else DrafterName.MOA,
                              TreeSearch(choices=choices), precision=Precision.INT8)
    prompt = real_target.apply_chat_template((ChatMessage("user", PROMPT),))
    tokens, per_round = split_greedy(real_target, server, drafter, prompt, 48, max_nodes=32)
    plain = plain_greedy(real_target, prompt, 48)
    assert compare(real_target, prompt, tokens[:48], plain).lossless
    # Falcon's tau is lower (results log, `falcon_tau`): 1.42 here, MoA's 1.68
    assert sum(per_round) / len(per_round) > (1.25 if falcon else 1.5), per_round
