import os
import tempfile

import pytest
import torch

# Triton kernels run under the interpreter on machines without CUDA.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Every engine built in the tests poisons padded buffers and validates metadata values
# (the descriptor contract) at every step.
os.environ.setdefault("RUNG_DEBUG_PADDING", "1")

# CPU graphs in the tests are emulated: its replays re-run the forward on poisoned pads, the
# padding oracle. Compiled graphs (the CPU default) are tested where a test asks for them.
os.environ.setdefault("RUNG_GRAPH_BACKEND", "emulated")
# ...and compiled graphs persist in a fresh folder, never the user's cache.
os.environ.setdefault("RUNG_CACHE_DIR", tempfile.mkdtemp(prefix="rung-test-cache-"))

# NOTE: tiny test models gain nothing from a second OpenMP thread, and on a busy 2-core
# machine a spinning second thread makes HF's oracle several times slower.
torch.set_num_threads(1)


@pytest.fixture(params=[True, False], ids=["debug", "production"])
def debug_padding(request, monkeypatch):
    """Run a test in both modes: debug (poison + validate) must catch bugs, never mask them.

    Engines built inside the test read RUNG_DEBUG_PADDING; module-scoped engines built
    earlier keep the mode they were built with.
    """
    monkeypatch.setenv("RUNG_DEBUG_PADDING", "1" if request.param else "0")
    return request.param


@pytest.fixture(scope="session", autouse=True)
def graphs_live_before_tests_assert():
    """On CUDA, graph_startup="auto" starts in the background: an engine a test builds
    would serve eagerly while its graphs go live, and its replay assertions would prove
    nothing. The suite's engines start with every graph live, as the emulated ones do."""
    from rung.graphs.capture import CudaGraphBackend

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CudaGraphBackend, "auto_startup", "blocking")
        yield
