"""SSD on the CPU starts its speculator process before the target loads (``saguaro.build.start_speculator_early``):
the draft loads in the worker while the target loads in the engine, and the engine holds none of the draft's
weights. Outputs stay AR's, a failure on either side ends the worker, and a draft of another vocabulary is still
refused.
"""
import pytest

import saguaro.llm
from saguaro import LLM, SamplingParams
from saguaro.loading import VocabularyMismatchError
from saguaro.workers import process as launch
from tests.tiny import PROMPTS, greedy_tokens, save_hf, tiny_model, weak_pair


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    target, draft = weak_pair()
    root = tmp_path_factory.mktemp("early")
    other = tiny_model(seed=3, vocab=80)  # another vocabulary: 80 numbered words
    return target, save_hf(target, root / "target"), save_hf(draft, root / "draft"), save_hf(other, root / "other")


@pytest.fixture
def workers(monkeypatch):
    """Every worker process started, and whether one was already running when the target's load began."""
    seen: list[launch.WorkerProcess] = []
    running_at_target: list[bool] = []
    original_init, original_target = launch.WorkerProcess.__init__, saguaro.llm.build_target

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        seen.append(self)

    def build_target(*args, **kwargs):
        running_at_target.append(any(p.is_alive() for p in seen))
        return original_target(*args, **kwargs)

    monkeypatch.setattr(launch.WorkerProcess, "__init__", init)
    monkeypatch.setattr(saguaro.llm, "build_target", build_target)
    return seen, running_at_target


def test_speculator_starts_before_the_target_and_ssd_equals_ar(dirs, workers):
    target, target_dir, draft_dir, _ = dirs
    seen, running_at_target = workers
    with LLM(target=str(target_dir), draft=str(draft_dir), mode="ssd", num_speculative_tokens=3, block_size=4,
             dtype="float32") as llm:
        assert running_at_target == [True] and len(seen) == 1
        assert llm.draft.model is None and llm.draft.name == str(draft_dir)  # the engine holds no draft weights
        out = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=12))]
        assert llm.engine.decoder.failure is None, llm.engine.decoder.failure
    assert out == greedy_tokens(target, PROMPTS, 12)
    assert not seen[0].is_alive()


def test_a_draft_of_another_vocabulary_is_refused_and_its_worker_ends(dirs, workers):
    _, target_dir, _, other_dir = dirs
    seen, _ = workers
    with pytest.raises(VocabularyMismatchError, match="do not share a vocabulary"):
        LLM(target=str(target_dir), draft=str(other_dir), mode="ssd", num_speculative_tokens=3, block_size=4,
            dtype="float32")
    assert len(seen) == 1
    seen[0].join(5)
    assert not seen[0].is_alive()


def test_a_target_that_fails_to_load_ends_the_early_worker(dirs, workers, tmp_path):
    _, _, draft_dir, _ = dirs
    seen, _ = workers
    broken = tmp_path / "broken"
    broken.mkdir()
    with pytest.raises(Exception):
        LLM(target=str(broken), draft=str(draft_dir), mode="ssd", num_speculative_tokens=3, block_size=4,
            dtype="float32")
    for p in seen:
        p.join(5)
        assert not p.is_alive()


def test_a_bad_draft_name_fails_before_any_worker_starts(dirs, workers):
    _, target_dir, _, _ = dirs
    seen, _ = workers
    with pytest.raises(FileNotFoundError):
        LLM(target=str(target_dir), draft="/no/such/draft", mode="ssd", num_speculative_tokens=3, block_size=4,
            dtype="float32")
    assert seen == []
