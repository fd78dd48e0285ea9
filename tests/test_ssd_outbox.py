"""The speculator link's outbox: posts sent in order on a thread, the target never waiting on a busy speculator."""
import threading

import pytest
import torch

from saguaro.ssd.channel import ChannelClosed
from saguaro.ssd.outbox import Outbox


def test_a_post_returns_while_the_speculator_has_not_taken_it_and_flush_waits():
    taking, sent = threading.Event(), []

    def send(message):
        taking.wait(timeout=10)  # a speculator busy with a build takes nothing until its pass ends
        sent.append(int(message[0]))

    box = Outbox(send)
    for i in range(3):
        box.put([torch.tensor(i)])  # returns at once
    assert sent == []
    flushed = threading.Thread(target=box.flush)
    flushed.start()
    flushed.join(timeout=0.2)
    assert flushed.is_alive()  # a round that wants an answer waits until every message before it is taken
    taking.set()
    flushed.join(timeout=10)
    assert not flushed.is_alive() and sent == [0, 1, 2]
    box.close()


def test_a_failed_send_is_raised_by_the_next_call_and_the_rest_dropped():
    sent, go = [], threading.Event()

    def send(message):
        go.wait(timeout=10)  # every put below is made before the first send (the failure is raised after them)
        if int(message[0]) == 1:
            raise RuntimeError("connection reset by peer")
        sent.append(int(message[0]))

    box = Outbox(send)
    box.put([torch.tensor(0)])
    box.put([torch.tensor(1)])
    box.put([torch.tensor(2)])
    go.set()
    with pytest.raises(ChannelClosed, match="connection reset"):
        box.flush()
    with pytest.raises(ChannelClosed):
        box.put([torch.tensor(3)])
    assert sent == [0]
    box.close()
