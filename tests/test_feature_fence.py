"""The fence on an EAGLE-3 head's target features crossing from the target's stream to the speculator's.

The target's pass writes the features on its stream; the speculator thread copies them on its own. A request
carrying them carries an event recorded after the pass (``fence_features``), and the speculator's stream waits
on it before the copy (``cross_fence``). On the CPU there is nothing to order: no event. On a GPU, features written
by a long producer kernel arrive intact on a consumer stream that starts at once."""
import pytest
import torch

from saguaro import SamplingParams
from saguaro.eagle.features import FeatureLog, cross_fence, fence_features
from saguaro.ssd.protocol import Admission, Outcome, RoundRequest


def test_a_request_lists_its_features_and_needs_no_fence_on_the_cpu():
    rows = [torch.ones(2, 4), torch.zeros(3, 4)]
    request = RoundRequest([Outcome(0, 1, 5, rows[0]), Outcome(1, 0, 2)],
                           [Admission(2, [1, 2, 3], SamplingParams(), 0, rows[1])], [], [0, 1, 2])
    assert request.feature_tensors() == rows
    assert fence_features(request.feature_tensors()) is None
    cross_fence(None, request.feature_tensors())  # nothing to wait for


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_features_written_on_the_targets_stream_arrive_whole_on_the_speculators():
    device = torch.device("cuda:0")
    producer, consumer = torch.cuda.Stream(device), torch.cuda.Stream(device)
    big = torch.randn(4096, 4096, device=device)
    for trial in range(5):
        with torch.cuda.stream(producer):
            slow = big
            for _ in range(20):  # keeps the producer's stream busy well past the consumer's start
                slow = slow @ big / 64
            features = torch.full((8, 16), float(trial), device=device) + slow[:8, :16] * 0
            event = fence_features([features])
        log = FeatureLog(device)
        with torch.cuda.stream(consumer):
            cross_fence(event, [features])
            log.put(0, features)
        torch.cuda.synchronize(device)
        assert torch.equal(log.span(0, 8), torch.full((8, 16), float(trial), device=device))
