"""The n-gram matcher as a ``Proposer``: one incremental index per sequence."""
from __future__ import annotations

from saguaro.engine.sequence import Sequence
from saguaro.sd.ngram import NgramIndex
from saguaro.sd.types import Proposal, Proposer


class NgramProposer(Proposer):
    def __init__(self, max_ngram: int = 4, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.indexes: dict[int, NgramIndex] = {}

    def propose(self, seqs: list[Sequence], num_tokens: list[int], read: bool = True) -> Proposal:
        tokens = []
        for seq, k in zip(seqs, num_tokens):
            index = self.indexes.get(seq.seq_id)
            if index is None:
                index = self.indexes[seq.seq_id] = NgramIndex(max_ngram=self.max_ngram, min_ngram=self.min_ngram)
            index.follow(seq.tokens)
            tokens.append(index.propose(k))
        return Proposal.deterministic(tokens)

    def release(self, seq: Sequence) -> None:
        self.indexes.pop(seq.seq_id, None)
