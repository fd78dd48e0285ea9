"""Suite-wide guard: an SSD speculator failure is a test failure unless the test asks for one.

The engine survives a dead speculator by finishing its requests with n-gram SD in the target
process, and that path is exact too. So a bug that crashes the worker would still pass every
equality and distribution test; this guard makes it visible. Tests that kill the worker on
purpose are marked ``worker_failure``. Also: ``cpu_tier``, the CPU kernel tiers to test.
"""
import logging

import pytest

from saguaro.backends.cpu_kernels.build import runnable_tiers

FAILURE = "speculator worker failed"


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
