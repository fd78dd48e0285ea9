"""Where the SSD speculator runs: the placement decision as a pure function, and the links behind it."""
import pytest

from saguaro.config import Config
from saguaro.ssd.link import SpeculatorLink
from saguaro.placement import Placement, place_speculator
from saguaro.ssd.thread_link import ThreadLink
from saguaro.ssd.in_process import InProcessLink
from saguaro.ssd.worker import WorkerLink


@pytest.mark.parametrize("device, draft_device, gpus, transport, expected", [
    # CPU: today's pinned process stays the default; the thread is there when asked for
    ("cpu", None, 0, "auto", Placement("process", "cpu")),
    ("cpu", None, 0, "process", Placement("process", "cpu")),
    ("cpu", None, 0, "thread", Placement("thread", "cpu")),
    ("cpu", "cpu", 2, "auto", Placement("process", "cpu")),
    # one GPU: the colocated thread on the target's GPU
    ("cuda:0", None, 1, "auto", Placement("thread", "cuda:0")),
    ("cuda", None, 1, "auto", Placement("thread", "cuda:0")),
    ("cuda:0", "cuda:0", 1, "auto", Placement("thread", "cuda:0")),
    ("cuda:0", "cuda:0", 1, "thread", Placement("thread", "cuda:0")),
    # several GPUs: the draft on the next GPU, in its own process over NCCL (the paper's setting)
    ("cuda:0", None, 2, "auto", Placement("process", "cuda:1")),
    ("cuda:1", None, 2, "auto", Placement("process", "cuda:0")),
    ("cuda:2", None, 4, "process", Placement("process", "cuda:3")),
    ("cuda:0", "cuda:1", 2, "thread", Placement("thread", "cuda:1")),
    ("cuda:0", None, 2, "thread", Placement("thread", "cuda:0")),  # the thread colocates unless told otherwise
    ("cuda:0", "cuda:0", 2, "auto", Placement("thread", "cuda:0")),
    # a GPU target with a CPU draft: the process over Gloo; a CPU target with a GPU draft: only the thread
    ("cuda:0", "cpu", 1, "auto", Placement("process", "cpu")),
    ("cpu", "cuda:0", 1, "auto", Placement("thread", "cuda:0")),
])
def test_placement(device, draft_device, gpus, transport, expected):
    assert place_speculator(device, draft_device, gpus, transport) == expected
    # deciding again from the decision changes nothing (Config resolves in place)
    assert place_speculator(device, expected.draft_device, gpus, expected.transport) == expected


@pytest.mark.parametrize("device, draft_device, gpus, transport, message", [
    ("cuda:0", None, 1, "process", "NCCL refuses two ranks on one GPU.*speculator_transport='thread'.*no second GPU"),
    ("cuda:0", "cuda:0", 2, "process", "NCCL.*'thread'.*draft_device='cuda:N'"),
    ("cpu", "cuda:0", 1, "process", "NCCL.*'thread'"),
    ("cpu", None, 0, "threads", "speculator_transport must be one of"),
    ("cuda:1", None, 1, "auto", "only 1 GPU"),
    ("cuda:0", "cuda:3", 2, "auto", "draft_device 'cuda:3'.*only 2 GPU"),
])
def test_placement_that_cannot_work_is_refused(device, draft_device, gpus, transport, message):
    with pytest.raises(ValueError, match=message):
        place_speculator(device, draft_device, gpus, transport)


def test_config_resolves_the_placement():
    cfg = Config(target="t", draft="d", mode="ssd", speculator_transport="thread")
    assert (cfg.speculator_transport, cfg.draft_device) == ("thread", "cpu")
    cfg = Config(target="t", draft="d", mode="ssd")
    assert (cfg.speculator_transport, cfg.draft_device) == ("process", "cpu")
    assert Config(target="t", draft="d", mode="sd").draft_device is None  # SD's draft stays with the target
    with pytest.raises(ValueError, match="speculator_transport must be one of"):
        Config(target="t", mode="ar", speculator_transport="gpu")


def test_every_link_is_a_speculator_link():
    for link in (WorkerLink, ThreadLink, InProcessLink):
        assert all(callable(getattr(link, m, None)) for m in ("post", "exchange", "stop", "kill")), link
    assert not isinstance(object(), SpeculatorLink)
