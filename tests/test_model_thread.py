"""The model thread is named in the OS, so per-thread CPU (top -H, benchmarks/server_cpu.py)
tells the model's time from the event loop's."""
from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from cloud_server.model_thread import MODEL_THREAD_NAME, ModelThread


@pytest.mark.skipif(sys.platform != "linux", reason="OS thread names are read from /proc")
def test_the_model_thread_carries_its_name_in_the_os():
    thread = ModelThread()
    try:
        tid = thread.call(threading.get_native_id)
        assert Path(f"/proc/self/task/{tid}/comm").read_text().strip() == MODEL_THREAD_NAME
    finally:
        thread.shutdown()
