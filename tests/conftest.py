"""Suite-wide guard: an SSD speculator failure is a test failure unless the test asks for one.

The engine survives a dead speculator by finishing its requests with n-gram SD in the target
process, and that path is exact too. So a bug that crashes the worker would still pass every
equality and distribution test; this guard makes it visible. Tests that kill the worker on
purpose are marked ``worker_failure``. Also: ``pair``, the tiny weak target/draft pair; ``cpu_tier``, the CPU
kernel tiers to test; and the parallel run (pytest-xdist, ``-n auto`` in pyproject.toml): one worker per core
while memory allows, with ``SAGUARO_CORES=none``, so that no engine is pinned and the scheduler keeps every core
busy.
"""
import logging
import os

import pytest

from saguaro.backends.cpu_kernels.build import runnable_tiers

FAILURE = "speculator worker failed"
GB_PER_WORKER = 10  # a worker may hold the real 1.5B target and its draft, and an SSD speculator beside them


@pytest.hookimpl(optionalhook=True)  # an xdist hook: pytest runs without xdist too (the GPU check's dry run)
def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: a worker per usable core, no more than memory holds."""
    from saguaro.cores import usable_cores
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return max(1, min(len(usable_cores()), int(memory // GB_PER_WORKER)))


def pytest_configure(config) -> None:
    # workers pin nothing by default: pinned, the engine of one worker and the speculator of another share a core
    # while the other core idles (measured: a third less time for the SSD distribution tests beside others)
    if os.environ.get("PYTEST_XDIST_WORKER") and "SAGUARO_CORES" not in os.environ:
        os.environ["SAGUARO_CORES"] = "none"


@pytest.fixture(scope="module")
def pair():
    """``tests.tiny.weak_pair()``, made once per module; a module that needs another pair defines its own."""
    from tests.tiny import weak_pair
    return weak_pair()


@pytest.fixture(scope="module", params=runnable_tiers())
def cpu_tier(request) -> str:
    """Each CPU kernel tier this machine executes (an AVX-512 machine tests avx512, avx2 and portable)."""
    return request.param


@pytest.fixture(autouse=True)
def _no_unexpected_worker_failure(request, caplog):
    caplog.set_level(logging.WARNING, logger="saguaro.ssd")
    yield
    if request.node.get_closest_marker("worker_failure"):
        return
    failures = [r.getMessage() for r in caplog.records if r.name == "saguaro.ssd" and FAILURE in r.getMessage()]
    assert not failures, f"the SSD speculator failed during this test: {failures}"
