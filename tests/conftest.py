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


# --- which passing tests ran on the GPU (bench/gpu_check.sh) ----------------------------------
# NOTE: with RUNG_DEVICE_TEST_REPORT set, a JSON at that path lists every passing test as
# "gpu" (the CUDA allocator allocated during its call) or "cpu_only": a test that never
# touched the device passes on a GPU machine too, and is no GPU pass.
_DEVICE_REPORT = os.environ.get("RUNG_DEVICE_TEST_REPORT")
_device_tests: dict[str, list[str]] = {"gpu": [], "cpu_only": []}


def _device_allocations() -> int:
    """Allocations the CUDA caching allocator has made so far in this process."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    return torch.cuda.memory_stats().get("allocation.all.allocated", 0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    before = _device_allocations() if _DEVICE_REPORT else 0
    yield
    if _DEVICE_REPORT:
        item.stash[_ON_DEVICE] = _device_allocations() > before


_ON_DEVICE = pytest.StashKey[bool]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if _DEVICE_REPORT and call.when == "call" and report.passed:
        _device_tests["gpu" if item.stash.get(_ON_DEVICE, False) else "cpu_only"].append(
            item.nodeid)


def pytest_sessionfinish(session):
    if _DEVICE_REPORT:
        import json

        with open(_DEVICE_REPORT, "w") as f:
            json.dump(_device_tests, f, indent=1)
