"""The EAGLE-3 trainer on a tiny target: labels, training-time test, checkpoints that resume, a loadable head."""
import torch

from saguaro import LLM, SamplingParams
from saguaro.eagle.checkpoint import default_taps
from saguaro.eagle.data import label
from saguaro.eagle.train import TrainSettings, _chain_mask, evaluate, new_head, pick_vocabulary, train
from saguaro.engine.model_runner import ModelRunner
from tests.tiny import greedy_tokens, tiny_model


def examples_for(target, n: int = 4, length: int = 24):
    gen = torch.Generator().manual_seed(0)
    chunks = [torch.randint(0, target.config.vocab_size, (length,), generator=gen).tolist() for _ in range(n)]
    try:
        return label(ModelRunner(target.model, 16, 4), default_taps(target.config.num_layers), chunks, 8)
    finally:
        target.model.taps = ()


def test_chain_mask_is_what_drafting_sees():
    """Row b of step 2 sees target-fed positions 0..b and its own rows of steps 1 and 2."""
    mask = _chain_mask(3, 2)
    assert mask.tolist() == [[1, 0, 0, 1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 1, 0, 0, 1]]


def test_training_lowers_the_loss_and_resumes(tmp_path):
    target = tiny_model(seed=3, layers=4, vocab=32, hidden=32, sharpness=3.0)
    examples = examples_for(target)
    vocab = pick_vocabulary(examples, 24, 32)
    assert len(vocab) == 24 and vocab.tolist() == sorted(vocab.tolist())
    head = new_head(target.model, vocab)
    before = evaluate(head, examples, 2)
    settings = TrainSettings(ttt_steps=2, lr=1e-2, steps=6, checkpoint_every=3)
    assert train(head, examples, settings, tmp_path)["steps"] == 6
    # a second run with more steps resumes from step 6 (its checkpoint), not from scratch
    resumed = new_head(target.model, vocab)
    settings.steps = 12
    assert train(resumed, examples, settings, tmp_path)["steps"] == 12
    assert torch.load(tmp_path / "trainer.pt", weights_only=False)["step"] == 12
    after = evaluate(resumed, examples, 2)
    assert sum(after["per_step_agreement"]) > sum(before["per_step_agreement"])
    # the saved head drafts in SD and in SSD, and greedy SD and SSD still equal AR
    prompts = [[1, 2, 3], [5, 9, 13, 17]]
    expected = greedy_tokens(target, prompts, 10)
    for mode, options in (("sd", {}), ("ssd", dict(fan_out=[1, 1, 2], speculator_transport="thread"))):
        with LLM(target=target, draft=str(tmp_path / "head"), mode=mode, num_speculative_tokens=2, block_size=4,
                 **options) as llm:
            outs = llm.generate(prompts, SamplingParams(max_tokens=10))
        assert [o.token_ids for o in outs] == expected, mode
