"""Device helpers: reading several device tensors back in one read."""
import pytest
import torch

from saguaro.device import read_together
from saguaro.sampling.ranked import RankTable, rank_table


def test_read_together_gives_what_tolist_gives_tensor_by_tensor():
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randint(0, 151_936, (3, 4), generator=gen), torch.rand(2, 5, generator=gen),
               torch.zeros(3, 0, dtype=torch.long), torch.tensor(7), torch.tensor([True, False]),
               torch.rand(2, 2, 3, generator=gen), torch.tensor([2**52 + 1])]
    got = read_together(tensors)
    expected = [t.tolist() for t in tensors]
    expected[3] = [7]  # a 0-d tensor comes back as a one-element list
    assert got == expected
    assert all(type(v) is int for v in got[0][0] + got[4] + got[6])  # ids stay ints, exactly
    assert read_together([]) == []


@pytest.mark.parametrize("rows", [None, [2, 0, 2]])
def test_rank_table_rows_read_once_and_equal_the_rows(rows, monkeypatch):
    from tests.host_reads import DeviceReads, mark
    logits = torch.randn(4, 9, generator=torch.Generator().manual_seed(1))
    table = rank_table(logits, 3)
    mark([table.ids, table.probs])
    with DeviceReads() as reads:
        ranked = table.rows(rows)
    assert reads.count == 1
    index = list(range(4)) if rows is None else rows
    assert [r.ids for r in ranked] == table.ids[index].tolist()
    assert [r.probs for r in ranked] == table.probs[index].tolist()
    assert RankTable.empty(3).rows() == []


def test_saguaro_cores_none_pins_nothing(monkeypatch):
    import os

    from saguaro import LLM
    from saguaro.cores import default_draft_cores, default_target_cores, usable_cores
    from tests.tiny import tiny_model
    monkeypatch.setenv("SAGUARO_CORES", "2,3")
    assert (default_target_cores(), default_draft_cores()) == ([2], [3])
    monkeypatch.setenv("SAGUARO_CORES", "none")
    assert default_target_cores() is None and default_draft_cores() is None
    assert default_target_cores(True) == usable_cores()[:1]  # a probe of two cores still gets them
    monkeypatch.delenv("SAGUARO_CORES")
    allowed = usable_cores()
    monkeypatch.setenv("SAGUARO_CORES", "none")
    assert usable_cores() == allowed
    affinity = os.sched_getaffinity(0)
    with LLM(tiny_model(seed=3, vocab=16, layers=1)) as llm:
        assert llm.config.target_cores is None and llm.config.draft_cores is None
        llm.generate([[1, 2]], None)
    assert os.sched_getaffinity(0) == affinity
    monkeypatch.setenv("SAGUARO_CORES", "two")
    with pytest.raises(ValueError, match="or be none"):
        usable_cores()


def test_stack_padded_puts_each_block_in_its_row_and_zeros_past_it():
    from saguaro.device import stack_padded
    full = [torch.rand(3, 5), torch.rand(3, 5)]
    got = stack_padded(full, 3, 5, torch.device("cpu"))
    assert got.dtype == torch.float32 and torch.equal(got, torch.stack(full))
    ragged = [torch.rand(2, 5), None, torch.rand(0, 5), torch.rand(3, 5, dtype=torch.float64)]
    got = stack_padded(ragged, 3, 5, torch.device("cpu"))
    assert got.shape == (4, 3, 5) and got.dtype == torch.float32
    assert torch.equal(got[0, :2], ragged[0]) and not got[0, 2:].any() and not got[1:3].any()
    assert torch.equal(got[3], ragged[3].float())
    assert stack_padded([], 2, 5, torch.device("cpu")).shape == (0, 2, 5)
