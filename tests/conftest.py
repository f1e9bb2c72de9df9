from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_target(tiny_model_dir: Path):
    from cloud_server.target import TargetModel

    return TargetModel.load(str(tiny_model_dir), "tiny-llama", device="cpu")


@pytest.fixture(scope="session")
def tiny_server(tiny_target):
    from shared.messages import Limits
    from tests.server_harness import ServerThread

    limits = Limits(max_tree_nodes=16, max_tree_depth=8, max_prompt_tokens=64,
                    max_new_tokens=64, max_sessions=4, session_idle_timeout_s=5)
    with ServerThread(tiny_target, limits) as server:
        yield server
