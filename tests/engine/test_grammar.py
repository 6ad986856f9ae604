"""Structured output (``response_format``): the output parses and follows its schema on the
real model, greedy and seeded; the mask is exact with the tokenizer; the tokens are the same
after a P/D handoff, under preemption and with speculation on; bad formats are refused by name."""

from __future__ import annotations

import json

import jsonschema
import pytest

from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.errors import InvalidRequestError
from services.engine.grammar import ResponseFormat
from services.engine.loader import load_model
from services.engine.request import FinishReason
from services.engine.sampling_params import SamplingParams
from services.engine.tokenizer import Tokenizer
from tests.fixtures import prefill_for_handoff

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}
PERSON = ResponseFormat.from_openai(
    {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
)


@pytest.fixture(scope="module")
def smollm():
    """One load of the default model; engines of any role are built over it."""
    loaded = load_model(None, keep_quantized=True)  # as served: the GGUF's int4 weights
    tok = Tokenizer.from_folder(loaded.folder)

    def make(**cfg):
        return Engine(loaded, tok, EngineConfig(**{"num_kv_blocks": 256, **cfg}))

    return make, tok


def _prompt(tok, text: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def _run(eng) -> list:
    outs = []
    while eng.has_unfinished:
        outs += eng.step()
    return outs


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_json_schema_output_parses_and_validates(smollm, temperature):
    make, tok = smollm
    eng = make()
    prompts = [
        _prompt(tok, "Describe a person called Ann, aged 31, as JSON."),
        _prompt(tok, "Tell me a story about a dragon."),  # nothing in it asks for JSON
    ]
    params = SamplingParams(max_tokens=96, temperature=temperature, seed=4, response_format=PERSON)
    for rid, p in enumerate(prompts):
        eng.add_request(str(rid), p, params)
    outs = _run(eng)
    for rid in ("0", "1"):
        ids = [t for o in outs if o.request_id == rid for t in o.new_token_ids]
        last = [o for o in outs if o.request_id == rid][-1]
        assert last.finish_reason is FinishReason.STOP, tok.decode(ids)
        jsonschema.validate(json.loads(tok.decode(ids)), SCHEMA)
    assert len(eng.grammars) == 0  # matchers go with their requests


def test_json_object_gives_an_object_where_free_text_does_not(smollm):
    make, tok = smollm
    eng = make()
    prompt = _prompt(tok, "Tell me a story about a dragon. Answer in JSON.")
    free = tok.decode(eng.generate([prompt], SamplingParams(max_tokens=60, temperature=0))[0])
    with pytest.raises(ValueError):
        json.loads(free)  # the check below can fail: unconstrained, this is prose and a fence
    params = SamplingParams(
        max_tokens=200, temperature=0, response_format=ResponseFormat("json_object")
    )
    eng.add_request("r", prompt, params)
    outs = _run(eng)
    assert outs[-1].finish_reason is FinishReason.STOP
    assert isinstance(json.loads(tok.decode([t for o in outs for t in o.new_token_ids])), dict)


def test_the_mask_reads_the_tokenizers_bytes(smollm):
    """llguidance decodes every token to the bytes pdserve's tokenizer gives it."""
    import llguidance

    _, tok = smollm
    lt = llguidance.LLTokenizer(tok.to_json())
    ids = [i for i in range(lt.vocab_size) if not lt.is_special_token(i)]
    assert len(ids) > 49_000
    assert [i for i in ids if lt.decode_bytes([i]) != tok.token_bytes(i)] == []


def test_handoff_preemption_and_speculation_keep_the_tokens(smollm):
    make, tok = smollm
    prompt = _prompt(tok, "Describe a person called Bob, aged 40, as JSON.")
    params = SamplingParams(max_tokens=64, temperature=0.7, seed=11, response_format=PERSON)
    (solo,) = make().generate([prompt], params)
    # P/D: the decode side's matcher replays the prefill side's first token
    pre, dec = make(role="prefill"), make(role="decode")
    (first,), handle = prefill_for_handoff(pre, "r", prompt, params)
    assert first.new_token_ids == solo[:1]
    dec.add_request("r", prompt, params, kv_handle=handle)
    assert [t for o in _run(dec) for t in o.new_token_ids] == solo[1:]
    # preemption: a pool too small for four at once recomputes some (matchers keep state)
    small = make(num_kv_blocks=12, block_size=16)
    assert small.generate([prompt] * 4, params) == [solo] * 4
    assert small.stats().num_preemptions > 0
    # speculation: a guided request is not drafted for, the others still are
    spec = make(speculative_tokens=4)
    copy = SamplingParams(max_tokens=24, temperature=0)
    text = _prompt(tok, "Repeat exactly: the cat sat on the mat, the cat sat on the mat.")
    got = spec.generate([prompt, text], [params, copy])
    assert got[0] == solo and got[1] == make().generate([text], copy)[0]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_object", "json_schema": {}}, "response_format.json_schema"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        (
            {"type": "json_schema", "json_schema": {"schema": {}}},
            "response_format.json_schema.name",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}},
            "response_format.json_schema.schema",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/no"}}},
            "response_format.json_schema.schema",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "colour": 1}},
            "response_format.json_schema.colour",
        ),
        ("json", "response_format"),
    ],
)
def test_bad_formats_are_refused_by_name(body, field):
    with pytest.raises(InvalidRequestError) as e:
        ResponseFormat.from_openai(body)
    assert e.value.field == field


def test_text_is_free_and_a_model_without_tokenizer_refuses(make_engine):
    assert ResponseFormat.from_openai({"type": "text"}) is None
    eng = make_engine()  # a tiny model without a tokenizer
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request("r", [5, 6], SamplingParams(response_format=ResponseFormat("json_object")))
    assert e.value.field == "response_format"
