"""The speculator thread's GPU lane, checked on the CPU: a green context only where ``GreenContext.Stream`` exists
(else a warning and an ordinary stream of the thread's own), and attention split counts sized to the lane's SMs."""
import logging
import sys
import threading
import types

import torch

from saguaro.backends.paged.attention_triton import CPU_SM_COUNT, default_splits, lane_sm_count
from saguaro.ssd import thread_link


class _Green:
    created: list = []

    @classmethod
    def create(cls, num_sms, device_id):
        cls.created.append(num_sms)
        return cls()

    def set_context(self):
        pass


class _GreenWithStream(_Green):
    def Stream(self):  # noqa: N802 (torch's name)
        return "green stream"


def _with_green_contexts(monkeypatch, green_class):
    module = types.ModuleType("torch.cuda.green_contexts")
    module.GreenContext = green_class
    monkeypatch.setitem(sys.modules, "torch.cuda.green_contexts", module)
    green_class.created = []


def test_no_green_context_without_its_stream_class(monkeypatch, caplog):
    _with_green_contexts(monkeypatch, _Green)
    with caplog.at_level(logging.WARNING, logger="saguaro.ssd"):
        assert thread_link._green_context(torch.device("cuda:0"), 16) is None
    assert _Green.created == []  # not even created: its default stream would pass for the target's
    assert "no GreenContext.Stream" in caplog.text and "a stream of its own" in caplog.text


def test_a_green_context_where_torch_has_its_stream_class(monkeypatch):
    _with_green_contexts(monkeypatch, _GreenWithStream)
    monkeypatch.setattr(thread_link, "_GREEN_CONTEXTS", {})
    green = thread_link._green_context(torch.device("cuda:0"), 16)
    assert isinstance(green, _GreenWithStream) and _GreenWithStream.created == [16]
    assert thread_link._green_context(torch.device("cuda:0"), None) is None  # not asked for


def test_green_contexts_are_made_once_per_share_and_kept(monkeypatch):
    """torch's GreenContext destructor aborts the process when the driver refuses to destroy it (its streams
    outlive it), so a lane's context is kept for the process's life and reused by later lanes of the same share."""
    _with_green_contexts(monkeypatch, _GreenWithStream)
    monkeypatch.setattr(thread_link, "_GREEN_CONTEXTS", {})
    first = thread_link._green_context(torch.device("cuda:0"), 16)
    assert thread_link._green_context(torch.device("cuda:0"), 16) is first
    assert thread_link._green_context(torch.device("cuda:0"), 32) is not first
    assert _GreenWithStream.created == [16, 32]
    del first
    kept = thread_link._GREEN_CONTEXTS[(0, 16)]
    thread_link._GREEN_CONTEXTS.clear()
    assert sys.getrefcount(kept) == 3  # this name, getrefcount's argument, and the one taken at creation


def test_attention_splits_follow_the_lanes_sm_count():
    q, k_cache = torch.zeros(1, 4, 16), torch.zeros(64, 2, 16)
    tables, extras = torch.zeros(1, 64, dtype=torch.int32), torch.zeros(1, 0, dtype=torch.int64)
    whole = default_splits(q, k_cache, tables, extras, 16)
    assert whole == CPU_SM_COUNT // 2  # one program per SM: 2 kv heads
    seen = []
    thread = threading.Thread(target=lambda: (lane_sm_count(32), seen.append(default_splits(q, k_cache, tables,
                                                                                             extras, 16))))
    thread.start()
    thread.join()
    assert seen == [16] and default_splits(q, k_cache, tables, extras, 16) == whole  # per thread
