"""The process link's channel (``saguaro/ssd/channel.py``) carries the real SSD messages exactly, reads nothing
to the host on receipt but one header, and never hangs on a dead or silent peer.

Over Gloo on the CPU (what CI runs): the verifier and a speculator echo peer in two threads, with the real
``Channel``; over NCCL between two GPUs where a machine has them (the peer in a process of its own on the second
GPU; skipped elsewhere). Every request kind (prefill with EAGLE-3 features, rounds with outcomes, admissions,
releases and K per sequence, a stop) crosses and comes back as an echo, every response kind (greedy, sampled,
point mass, empty rows with and without a block, hits and misses) crosses, and each is compared field by field.
Messages are sized to take every place a frame can take: inline in the header, a host frame of its own, and on
NCCL a device frame.

The subprocess waits below are hang guards, not timing assertions.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from torch.overrides import TorchFunctionMode

from saguaro.sampling.params import SamplingParams
from saguaro.ssd.channel import HEADER_WORDS, Channel, ChannelClosed, MessageCounters
from saguaro.ssd.protocol import (CMD_PREFILL, CMD_ROUND, CMD_STOP, Admission, Outcome, RoundRequest,
                                  RoundResponse, SpecRow, pack_request, pack_response, unpack_request,
                                  unpack_response)
from saguaro.workers.process import WorkerProcess, free_port
from tests.host_reads import READS

K, V, WIDTH = 3, 1000, 24  # a [K, V] float32 block (12 KB) needs a frame of its own; greedy fields ride inline


class HostReads(TorchFunctionMode):
    """Counts every tensor turned into host values (``tolist``, ``cpu``, ...) in the thread that entered it: on a
    GPU each would wait for the device (``tests/host_reads.py`` counts only values that came from a model pass)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func in READS
        return func(*args, **(kwargs or {}))


def counted_recv(channel: Channel, reads: list[int], **kw) -> list[torch.Tensor]:
    with HostReads() as mode:
        frames = channel.recv(**kw)
    reads.append(mode.count)
    return frames


# -- the messages ---------------------------------------------------------------------------------------------

def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def requests(device: str) -> list[RoundRequest]:
    """A prefill with EAGLE-3 features (bf16) and a long prompt (its fields overflow the header), two rounds (one
    with fp32 features and K per sequence, one bare), a stop."""
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
    feats = torch.randn(40, WIDTH, generator=_gen(1)).to(device)
    long_prompt = torch.randint(0, V, (3000,), generator=_gen(2)).tolist()
    prefill = RoundRequest(admissions=[Admission(7, long_prompt, sampled, 2**40 + 3, feats[:30].bfloat16(), 5),
                                       Admission(8, [1, 2, 3], greedy, 0, feats[30:].bfloat16())],
                           command=CMD_PREFILL)
    f32 = torch.randn(9, WIDTH, generator=_gen(3)).to(device)
    round_ = RoundRequest([Outcome(7, 3, 11, f32[:4]), Outcome(8, 0, 12, f32[4:5]), Outcome(9, 2, 13, f32[5:8])],
                          [Admission(10, [4, 5], sampled, 99, f32[8:])], releases=[3, 4], order=[7, 8, 9, 10],
                          ks=[3, 0, 2, 1])
    bare = RoundRequest([Outcome(7, 1, 21), Outcome(9, 3, 22)], releases=[8], order=[7, 9])
    return [prefill, round_, bare, RoundRequest(command=CMD_STOP)]


def responses(device: str) -> list[RoundResponse]:
    """One per round request: every row kind, then greedy rows only (no distributions: an empty probs frame)."""
    probs = torch.rand(4, K, V, generator=_gen(4)).softmax(-1).to(device)
    mixed = [SpecRow(True, [5, 6, 7], None), SpecRow(True, [8, 9, 10], probs[0]),
             SpecRow(False, [1, 2], None, point_mass=True), SpecRow(False, [], None),
             SpecRow(False, [], probs[1, :0]), SpecRow(False, [11], probs[2, :1]), SpecRow(True, [3, 2, 1], probs[3])]
    greedy = [SpecRow(True, [1, 2, 3], None), SpecRow(False, [4], None)]
    return [RoundResponse(mixed, build_s=0.125, respond_s=3e-4, build_steps=4), RoundResponse(greedy)]


def assert_same_request(sent: RoundRequest, got: RoundRequest) -> None:
    assert (got.command, got.releases, got.order, got.ks) == (sent.command, sent.releases, sent.order, sent.ks)
    assert len(got.outcomes) == len(sent.outcomes) and len(got.admissions) == len(sent.admissions)
    for a, b in zip(sent.outcomes, got.outcomes):
        assert (a.seq_id, a.num_accepted, a.bonus) == (b.seq_id, b.num_accepted, b.bonus)
        assert_same_tensor(a.features, b.features)
    for a, b in zip(sent.admissions, got.admissions):
        assert (a.seq_id, a.tokens, a.seed, a.features_start) == (b.seq_id, b.tokens, b.seed, b.features_start)
        assert (a.params.temperature, a.params.top_k, a.params.top_p) == (b.params.temperature, b.params.top_k,
                                                                           b.params.top_p)
        assert_same_tensor(a.features, b.features)


def assert_same_response(sent: RoundResponse, got: RoundResponse, device: str) -> None:
    assert (got.build_s, got.respond_s, got.build_steps) == (sent.build_s, sent.respond_s, sent.build_steps)
    assert len(got.rows) == len(sent.rows)
    for a, b in zip(sent.rows, got.rows):
        assert (b.hit, b.tokens, b.point_mass) == (a.hit, a.tokens, a.point_mass)
        assert_same_tensor(a.probs, b.probs)
        assert b.probs is None or b.probs.device == torch.device(device)  # arrived where the verifier reads it


def assert_same_tensor(a: torch.Tensor | None, b: torch.Tensor | None) -> None:
    assert (a is None) == (b is None)
    if a is not None:
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.cpu(), b.cpu())


# -- the peer: the speculator's side ---------------------------------------------------------------------------

def echo_peer(channel: Channel, device: str, reads: list[int]) -> None:
    """Send every message back as it arrived (its device frames from this end's device), and answer each round
    with the next scripted response, until the stop."""
    answers = iter(responses(device))
    while True:
        frames = counted_recv(channel, reads, timeout_s=60)
        channel.send(frames)
        request = unpack_request(frames)
        if request.command == CMD_STOP:
            return
        if request.command == CMD_ROUND:
            channel.send(pack_response(next(answers), K))


def echo_process(port: int, counters: MessageCounters, device: str) -> None:
    """The peer in a process of its own, on its own GPU (the two-GPU test)."""
    torch.cuda.set_device(torch.device(device))
    echo_peer(Channel(1, port, counters, "nccl", device, 60), device, [])


def converse(channel: Channel, device: str) -> list[int]:
    """The verifier's side of the script: every request out and back, every response in; the host reads of
    each receive."""
    reads: list[int] = []
    answers = iter(responses(device))
    for request in requests(device):
        channel.send(pack_request(request))
        assert_same_request(request, unpack_request(counted_recv(channel, reads, timeout_s=60)))
        if request.command == CMD_ROUND:
            assert_same_response(next(answers), unpack_response(counted_recv(channel, reads, timeout_s=60), K, V),
                                 device)
    return reads


def connected_pair(timeout_s: float = 60) -> tuple[Channel, Channel]:
    """Two ends of a Gloo channel in this process (each end's start-up waits for the other)."""
    port, counters, ends = free_port(), MessageCounters(), {}
    peer = threading.Thread(target=lambda: ends.setdefault(1, Channel(1, port, counters, "gloo", "cpu", timeout_s)))
    peer.start()
    ends[0] = Channel(0, port, counters, "gloo", "cpu", timeout_s)
    peer.join(timeout_s)
    return ends[0], ends[1]


def test_every_message_round_trips_over_gloo_with_one_host_read_per_receive():
    verifier, speculator = connected_pair()
    peer_reads: list[int] = []
    errors: list[BaseException] = []

    def serve():
        try:
            echo_peer(speculator, "cpu", peer_reads)
        except BaseException as e:  # noqa: BLE001 -- raised in the test's thread below
            errors.append(e)
    peer = threading.Thread(target=serve, daemon=True)
    peer.start()
    reads = converse(verifier, "cpu")
    peer.join(60)
    assert not errors, errors
    assert len(reads) == 6 and len(peer_reads) == 4
    assert set(reads + peer_reads) == {1}  # the header's directory, whatever the frames and their places


def test_frames_take_every_place():
    """The script exercises what it claims: a message entirely inline, and one with a host frame of its own."""
    request, _, bare, _ = requests("cpu")
    fields = pack_request(request)[0]
    assert fields.numel() * 8 > 8 * HEADER_WORDS  # the long prompt's fields overflow the header
    assert pack_request(bare)[0].numel() < HEADER_WORDS // 2
    probs = pack_response(responses("cpu")[0], K)[1]
    assert probs.numel() * 4 > 8 * HEADER_WORDS


def test_a_message_holds_one_to_four_frames():
    with pytest.raises(ValueError, match="1 to 4 tensors"):
        connected_pair()[0].send([torch.zeros(1)] * 5)


# -- failures --------------------------------------------------------------------------------------------------

def silent_or_dying(port: int, counters: MessageCounters, die: bool) -> None:
    channel = Channel(1, port, counters, "gloo", "cpu", 60)
    channel.send(torch.tensor([1], dtype=torch.int64))
    if die:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)


@pytest.mark.parametrize("die", [True, False], ids=["dying", "silent"])
def test_a_dead_or_silent_peer_raises_channel_closed_in_time(die):
    """A peer that dies ends the wait at once (its socket closes), well within a long timeout; a silent one at
    the timeout. Neither hangs the receiver."""
    port, counters = free_port(), MessageCounters()
    child = WorkerProcess(silent_or_dying, (port, counters, die), [counters.file], role="channel peer",
                          hint="fix the error above")
    try:
        channel = child.expect("connecting", lambda: Channel(0, port, counters, "gloo", "cpu", 60), 60)
        assert channel.recv(timeout_s=60, alive=child.is_alive)[0].tolist() == [1]
        timeout_s = 30 if die else 1.0
        start = time.monotonic()
        with pytest.raises(ChannelClosed, match="gone|failed" if die else "no message within 1.0 s"):
            channel.recv(timeout_s=timeout_s, alive=child.is_alive)
        assert time.monotonic() - start < (10 if die else timeout_s + 5)
        with pytest.raises(ChannelClosed):  # and the dead link stays closed
            channel.recv(timeout_s=1, alive=child.is_alive)
    finally:
        child.kill()


# -- two GPUs ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_every_message_round_trips_over_nccl_between_two_gpus():
    """The paper's link: distributions and features cross GPU to GPU (they arrive on the receiver's GPU), the
    host reads only each message's header."""
    port, counters = free_port(), MessageCounters()
    child = WorkerProcess(echo_process, (port, counters, "cuda:1"), [counters.file], role="channel peer",
                          hint="fix the error above")
    torch.cuda.set_device(0)
    try:
        channel = child.expect("connecting", lambda: Channel(0, port, counters, "nccl", "cuda:0", 60), 120)
        reads = converse(channel, "cuda:0")
        child.join(60)
    finally:
        child.kill()
    assert set(reads) == {1}
