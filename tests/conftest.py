"""Suite-wide guard: an SSD speculator failure is a test failure unless the test asks for one.

The engine survives a dead speculator by finishing its requests with n-gram SD in the target
process, and that path is exact too. So a bug that crashes the worker would still pass every
equality and distribution test; this guard makes it visible. Tests that kill the worker on
purpose are marked ``worker_failure``.
"""
import logging

import pytest

FAILURE = "speculator worker failed"


@pytest.fixture(autouse=True)
def _no_unexpected_worker_failure(request, caplog):
    caplog.set_level(logging.WARNING, logger="saguaro.ssd")
    yield
    if request.node.get_closest_marker("worker_failure"):
        return
    failures = [r.getMessage() for r in caplog.records if r.name == "saguaro.ssd" and FAILURE in r.getMessage()]
    assert not failures, f"the SSD speculator failed during this test: {failures}"
