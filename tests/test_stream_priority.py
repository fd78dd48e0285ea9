"""Stream priorities of SSD on one GPU (``ssd/stream_priority.py``), checked on the CPU: which priorities each
side gets, the setting that turns them off, the CPU left as it is, and the order of the target lane's stream joins
and the speculator lane's stream, with torch's CUDA stream calls recorded in place of a device."""
import contextlib

import pytest
import torch

from saguaro.ssd import stream_priority, thread_link
from saguaro.ssd.stream_priority import LanePriorities, TargetLane, lane_priorities


def test_the_target_gets_the_greatest_priority_and_the_speculator_the_least(monkeypatch):
    monkeypatch.delenv("SAGUARO_STREAM_PRIORITIES", raising=False)
    assert lane_priorities("cuda:0", priority_range=(0, -5)) == LanePriorities(target=-5, speculator=0)
    assert lane_priorities("cuda:1", priority_range=(0, -1)) == LanePriorities(target=-1, speculator=0)
    assert lane_priorities("cuda:0", priority_range=(0, 0)) is None  # one level: nothing to order


@pytest.mark.parametrize("value", ["0", "off", "False", "no"])
def test_the_setting_turns_them_off(monkeypatch, value):
    monkeypatch.setenv("SAGUARO_STREAM_PRIORITIES", value)
    assert lane_priorities("cuda:0", priority_range=(0, -5)) is None
    assert lane_priorities("cuda:0", on=True, priority_range=(0, -5)) is not None  # the probe's explicit choice
    monkeypatch.setenv("SAGUARO_STREAM_PRIORITIES", "1")
    assert lane_priorities("cuda:0", priority_range=(0, -5)) is not None


def test_the_cpu_is_left_as_it_is():
    assert lane_priorities("cpu", on=True, priority_range=(0, -5)) is None
    lane = TargetLane("cpu", None)
    with lane():  # a pass-through: no stream, no CUDA call
        x = torch.ones(2) + 1
    assert lane.stream is None and x.tolist() == [2.0, 2.0]


class _Calls:
    """torch.cuda's stream calls, recorded."""

    def __init__(self, monkeypatch):
        self.log = []
        calls = self

        class Stream:
            def __init__(self, device=None, priority=0):
                self.device, self.priority = device, priority
                calls.log.append(("stream", priority))

            def wait_stream(self, other):
                calls.log.append(("wait", self.priority, other.priority))

        self.current = Stream.__new__(Stream)
        self.current.device, self.current.priority = torch.device("cuda:0"), "current"

        @contextlib.contextmanager
        def on(stream):
            calls.log.append(("enter", stream.priority))
            try:
                yield
            finally:
                calls.log.append(("exit", stream.priority))
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        monkeypatch.setattr(torch.cuda, "stream", on)
        monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)


def test_the_target_lane_joins_the_current_stream_on_entry_and_exit(monkeypatch):
    calls = _Calls(monkeypatch)
    lane = TargetLane("cuda:0", LanePriorities(target=-5, speculator=0))
    with pytest.raises(RuntimeError):  # a round that raises still joins back
        with lane():
            calls.log.append("round")
            raise RuntimeError("a failed round")
    assert calls.log == [("stream", -5), ("wait", -5, "current"), ("enter", -5), "round", ("exit", -5),
                         ("wait", "current", -5)]


def test_the_speculator_lane_stream_has_the_least_priority(monkeypatch):
    calls = _Calls(monkeypatch)
    opts = type("Opts", (), {"device": "cuda:0"})()
    with thread_link._lane(opts, None, LanePriorities(target=-5, speculator=0)) as stream:
        assert stream.priority == 0
    with thread_link._lane(opts, None, None) as stream:  # off: the default
        assert stream.priority == 0
    assert [c for c in calls.log if c[0] == "stream"] == [("stream", 0), ("stream", 0)]


def test_an_ssd_decoder_runs_its_rounds_in_the_links_lane():
    from saguaro import LLM, SamplingParams
    from tests.tiny import weak_pair
    target, draft = weak_pair()
    with LLM(target, draft=draft, mode="ssd", num_speculative_tokens=3, block_size=4,
             speculator_transport="thread") as llm:
        decoder = llm.engine.decoder
        assert decoder.lane is decoder.link.target_lane and decoder.lane.stream is None  # the CPU: no stream
        entered = []
        real = decoder.lane
        decoder.lane = lambda: entered.append(1) or real()
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=6))
    assert entered
    assert stream_priority.no_lane().stream is None
