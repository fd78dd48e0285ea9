"""JSON-constrained decoding (saguaro.sampling.grammar): greedy AR, SD and SSD agree token for token in fp32,
and the output is JSON that validates against the schema.

The tiny model has a byte-level BPE tokenizer (tests/tiny.py), so every JSON text has tokens; it has no EOS, so
the requests end on a stop token id, which the grammar allows once the JSON is complete.
"""
import json

import pytest

from saguaro import LLM, SamplingParams
from saguaro.sampling.grammar import GrammarState, JsonGrammar
from tests.tiny import byte_level_model, every_mode, tiny_model, truncated

jsonschema = pytest.importorskip("jsonschema")  # a dev dependency (the GPU check runs without it)

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 30]},
                                           "tag": {"enum": ["a", "bc", "Hello"]}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}
TEXTS = ["Hello world", "def f(x):", "naïve café", "return x * 2", "hello saguaro!"]
JSON_TEXTS = ['{"ok": true, "n": 30, "tag": "bc"} {"ok": true, "n": 30, "tag": "bc"} {"ok": true, "n": 30, "tag"',
              '{"ok": false, "n": 1, "tag": "Hello"} {"ok": false, "n": 1, "tag": "Hello"} {"ok": false, "n']
N_TOKENS = 48


@pytest.fixture(scope="module")
def target():
    return byte_level_model(seed=3)


def _params(target, schema: dict | None) -> SamplingParams:
    stop = target.config.vocab_size - 1  # no EOS in the tiny model: the JSON ends on this id
    return SamplingParams(max_tokens=N_TOKENS, stop_token_ids=[stop],
                          grammar=JsonGrammar(None if schema is None else json.dumps(schema)))


@pytest.fixture(scope="module")
def outputs(target):
    prompts = [target.tokenizer.encode(t) for t in TEXTS + JSON_TEXTS]
    results = {}
    for mode, llm in every_mode(target, truncated(target, 1)):
        with llm:
            for name, schema in (("schema", SCHEMA), ("object", None)):
                results[mode, name] = [(o.token_ids, o.text, o.finish_reason)
                                       for o in llm.generate(prompts, _params(target, schema))]
            if mode == "ar":
                results[mode, "plain"] = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8))]
    return results


@pytest.mark.parametrize("name", ["schema", "object"])
def test_greedy_equal_in_every_mode(outputs, name):
    for mode in ("sd", "ngram", "ssd"):
        assert outputs[mode, name] == outputs["ar", name], mode


def test_output_validates(target, outputs):
    plain = outputs["ar", "plain"]
    decode = target.tokenizer.decode  # the stop token is an ordinary one here, so its text is left out by hand
    for (tokens, text, reason), free in zip(outputs["ar", "schema"], plain):
        assert reason == "stop", text  # the grammar reaches its end well within N_TOKENS
        jsonschema.validate(json.loads(decode(tokens[:-1])), SCHEMA)
        assert tokens[:8] != free  # the constraint changes the output: the equality above has teeth
    for tokens, text, reason in outputs["ar", "object"]:
        assert reason in ("stop", "length")
        if reason == "stop":
            assert isinstance(json.loads(decode(tokens[:-1])), dict)


def test_negative_control_masks_without_drafts_break_sd(target, monkeypatch):
    """Rows masked by the state before the pass (the drafts not walked) must not reproduce AR. The n-gram
    proposer copies the JSON the prompts hold, so whole runs of grammatical drafts reach the later rows."""
    original = GrammarState.fill

    def stale(self, bitmask, first, drafts, n_rows):
        original(self, bitmask, first, [], 1)
        bitmask[first:first + n_rows] = bitmask[first]

    monkeypatch.setattr(GrammarState, "fill", stale)
    prompts = [target.tokenizer.encode(t) for t in JSON_TEXTS]
    with LLM(target, block_size=4) as llm:
        reference = [o.token_ids for o in llm.generate(prompts, _params(target, SCHEMA))]
    with LLM(target=target, mode="sd", proposer="ngram", num_speculative_tokens=3, block_size=4,
             adaptive=False) as llm:  # a fixed K, so that the drafts reach the later rows every time
        got = [o.token_ids for o in llm.generate(prompts, _params(target, SCHEMA))]  # a refused token fails its request
    assert got != reference


@pytest.mark.parametrize("schema, message", [("{", "not valid JSON"), ("[1]", "is an object"),
                                             ('{"type": "nonsense"}', "cannot be compiled")])
def test_bad_schema_is_refused(target, schema, message):
    with LLM(target, block_size=4) as llm:
        with pytest.raises(ValueError, match=message):
            llm.engine.grammars.compile(JsonGrammar(schema))


def test_a_vocabulary_without_json_is_refused():
    """The numbered word-level tokenizer has no token that starts JSON: a clear error, before anything runs."""
    with LLM(tiny_model(), block_size=4) as llm:
        with pytest.raises(ValueError, match="no token that can start"):
            llm.generate([[1, 2]], SamplingParams(max_tokens=4, stop_token_ids=[3], grammar=JsonGrammar()))


def test_grammar_refuses_ignore_eos():
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(grammar=JsonGrammar(), ignore_eos=True)
