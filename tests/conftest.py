from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Generator

import pytest

from testkit.device_under_test import load_target
from testkit.tiny_drafters import fp32_bundle, train_tiny
from testkit.tiny_model import build_tiny_model

_CAPTURES_SEEN = pytest.StashKey[int]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo
                              ) -> Generator[None, Any, None]:
    """A forward shape that failed to capture (cuda_graphs.failed_captures) fails the test
    phase it happened in, fixtures' included: it runs eagerly, so the output stays right, and
    the line it prints is swallowed with a passing test's stderr (SPLITDEC_TEST_DEVICE=cuda
    or cpu-graphs capture every shape they run)."""
    outcome = yield
    graphs = sys.modules.get("cloud_server.engine.cuda_graphs")  # none imported, none failed
    if graphs is None:
        return
    failed = graphs.failed_captures()
    fresh = failed[item.config.stash.get(_CAPTURES_SEEN, 0):]
    item.config.stash[_CAPTURES_SEEN] = len(failed)
    if not fresh:
        return
    report = outcome.get_result()
    text = f"{len(fresh)} forward shape(s) failed to capture:\n" + "\n".join(fresh)
    if report.failed:
        report.sections.append(("failed captures", text))
    else:
        report.outcome, report.longrepr = "failed", text


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_target(tiny_model_dir: Path):
    return load_target(str(tiny_model_dir), "tiny-llama")


@pytest.fixture(scope="session")
def tiny_server(tiny_target):
    from shared.messages import Limits
    from cloud_server.config import ServerConfig
    from tests.server_harness import ServerThread

    limits = Limits(max_tree_nodes=16, max_tree_depth=8, max_prompt_tokens=64,
                    max_new_tokens=64, max_sessions=4, session_idle_timeout_s=5)
    with ServerThread(tiny_target, ServerConfig(limits)) as server:
        yield server


@pytest.fixture(scope="module")
def isolated_server(tiny_target):
    """A tiny server for one module whose tests leave orphaned sessions behind (held for a
    resume until the idle timeout), which must not count against other tests' session limit."""
    from shared.messages import Limits
    from cloud_server.config import ServerConfig
    from tests.server_harness import ServerThread

    limits = Limits(max_tree_nodes=16, max_tree_depth=8, max_new_tokens=64, max_sessions=16,
                    session_idle_timeout_s=5)
    with ServerThread(tiny_target, ServerConfig(limits)) as server:
        yield server


@pytest.fixture(scope="module")
def moa_server(tiny_target, tiny_drafter_dir):
    """A tiny server offering the MoA drafter (testkit/moa_runs.py's limits)."""
    from cloud_server.config import ServerConfig
    from testkit.moa_runs import LIMITS
    from tests.server_harness import ServerThread

    with ServerThread(tiny_target, ServerConfig(LIMITS, drafter_dir=tiny_drafter_dir)) as server:
        yield server


@pytest.fixture(scope="session")
def real_q4_target():
    """The real SmolLM2 in the server's default CPU engine (4-bit), shared by the real-model
    smoke tests that `make test` runs."""
    from cloud_server import model_store
    from cloud_server.target import TargetModel

    path, model_id = model_store.resolve("default")
    return TargetModel.load(path, model_id, "cpu", weights="q4",
                            gguf=model_store.gguf_of("default"))


@pytest.fixture(scope="session")
def real_q4_server(real_q4_target):
    """Trees of at most 32 nodes: the startup calibration then stops at 32, not 128."""
    from shared.messages import Limits
    from cloud_server.config import ServerConfig
    from tests.server_harness import ServerThread

    with ServerThread(real_q4_target, ServerConfig(Limits(max_tree_nodes=32))) as server:
        yield server


@pytest.fixture(scope="session")
def tiny_drafter_dir(tiny_target, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A MoA drafter trained briefly on the tiny target's own answers (sub-vocabulary head),
    with the same network reading hidden states in `last/` and `fused/` and the Independent
    baseline in `independent/` beside it."""
    from cloud_server.moa.config import ServerInput

    return train_tiny(tiny_target, tmp_path_factory.mktemp("tiny-moa"), 80, independent=True,
                      server_inputs=(ServerInput.LAYER_KV, ServerInput.LAST_HIDDEN,
                                     ServerInput.FUSED_HIDDEN))


@pytest.fixture(scope="session")
def tiny_bundle(tiny_target, tiny_drafter_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from cloud_server.moa.bundle import build_bundle

    return build_bundle(tiny_drafter_dir, tiny_target.model, "tiny-llama",
                        tmp_path_factory.mktemp("bundles"))


@pytest.fixture(scope="session")
def tiny_independent_bundle(tiny_target, tiny_drafter_dir: Path,
                            tmp_path_factory: pytest.TempPathFactory):
    from cloud_server.moa.bundle import build_bundle
    from cloud_server.training.moa import INDEPENDENT

    return build_bundle(tiny_drafter_dir / INDEPENDENT, tiny_target.model, "tiny-llama",
                        tmp_path_factory.mktemp("independent"))


@pytest.fixture(scope="session")
def tiny_recurrent_dir(tiny_target, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A recurrent MoA drafter (input 'last', trained as it drafts over 3 passes), briefly."""
    from cloud_server.moa.config import ServerInput

    return train_tiny(tiny_target, tmp_path_factory.mktemp("tiny-recurrent"), 60,
                      server_inputs=(ServerInput.LAST_HIDDEN,), recurrent=True, unroll=3)


@pytest.fixture(scope="session")
def tiny_recurrent_bundle(tiny_target, tiny_recurrent_dir: Path,
                          tmp_path_factory: pytest.TempPathFactory):
    return fp32_bundle(tiny_target, tiny_recurrent_dir, tmp_path_factory.mktemp("recurrent"))


@pytest.fixture(scope="session")
def tiny_falcon_dir(tiny_target, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Falcon drafter (input 'last', 2 tokens a step, with glancing), trained briefly."""
    from cloud_server.moa.config import ServerInput

    return train_tiny(tiny_target, tmp_path_factory.mktemp("tiny-falcon"), 60,
                      server_inputs=(ServerInput.LAST_HIDDEN,), block=2)


@pytest.fixture(scope="session")
def tiny_falcon_bundle(tiny_target, tiny_falcon_dir: Path,
                       tmp_path_factory: pytest.TempPathFactory):
    return fp32_bundle(tiny_target, tiny_falcon_dir, tmp_path_factory.mktemp("falcon"))
