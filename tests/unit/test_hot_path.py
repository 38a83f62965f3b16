"""The gateway's hot-path shortcuts answer exactly what the slow paths they skip would: the
prefix of two token lists or strings, a body's check without its pydantic model, JSON through
orjson with the standard library behind it, and a tracer that records nothing it would drop."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace.sampling import ParentBased
from pydantic import ValidationError

from darl.deploy import telemetry
from darl.gateway import json_codec
from darl.gateway.errors import BadRequestError
from darl.gateway.protocols.chat.protocol import (
    CHAT,
    COMPLETIONS,
    ChatCompletionRequest,
    CompletionRequest,
    Endpoint,
    validate_body,
)
from darl.gateway.store.codec import common_prefix


def naive_prefix(a: list[int] | str, b: list[int] | str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@given(
    st.lists(st.integers(0, 3), max_size=1200),
    st.integers(0, 1200),
    st.lists(st.integers(0, 3), max_size=600),
)
def test_common_prefix_is_the_naive_one(a: list[int], cut: int, tail: list[int]) -> None:
    b = a[:cut] + tail  # often a long shared prefix, parting inside or past a chunk
    assert common_prefix(a, b) == naive_prefix(a, b)
    text_a, text_b = "".join(map(str, a)), "".join(map(str, b))
    assert common_prefix(text_a, text_b) == naive_prefix(text_a, text_b)


VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-2, 20),
    st.floats(allow_nan=False),
    st.text(max_size=2),
    st.lists(
        st.one_of(st.integers(0, 5), st.booleans(), st.text(max_size=1), st.just({"a": 1})),
        max_size=3,
    ),
)
BODIES = st.dictionaries(st.sampled_from(["messages", "prompt", "stream", "n", "x"]), VALUES)


def schema_says(endpoint: Endpoint, body: dict[str, Any]) -> bool | str:
    schema = ChatCompletionRequest if endpoint == CHAT else CompletionRequest
    try:
        return schema.model_validate(body).stream
    except ValidationError:
        return "refused"


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(BODIES, st.sampled_from([CHAT, COMPLETIONS]))
def test_validate_body_agrees_with_the_schema(body: dict[str, Any], endpoint: Endpoint) -> None:
    try:
        verdict: bool | str = validate_body(endpoint, body)
    except BadRequestError:
        verdict = "refused"
    assert verdict == schema_says(endpoint, body)


ODD_BODIES = [
    b'{"seed": 123456789012345678901234567890}',  # orjson would read a float
    b'{"t": NaN, "p": [Infinity, -Infinity]}',
    b'{"big": 1e400, "small": -1e400}',  # past a double: Infinity
    b'{"s": "\\ud800 a lone surrogate"}',
    b'{"e": "\\u00e9t\\u00e9", "f": 1.5e-07, "i": 18446744073709551616}',
]


@pytest.mark.parametrize("body", ODD_BODIES)
def test_json_codec_reads_and_writes_what_the_standard_library_does(body: bytes) -> None:
    expected = repr(json.loads(body))  # reprs, as NaN != NaN
    read = json_codec.loads(body)
    assert repr(read) == expected
    assert repr(json.loads(json_codec.dumps(read))) == expected


def test_json_codec_writes_a_non_finite_float_back_as_read() -> None:
    logprobs = json_codec.loads(b'{"logprob": -Infinity, "p": [NaN, Infinity, 0.5]}')
    assert json_codec.dumps(logprobs) == b'{"logprob":-Infinity,"p":[NaN,Infinity,0.5]}'


def test_json_codec_errors_are_the_standard_librarys() -> None:
    for bad in (b'{"a":', b"[1]x", bytearray(b'{"a": }')):
        with pytest.raises(json.JSONDecodeError) as caught:
            json_codec.loads(bad)
        with pytest.raises(json.JSONDecodeError) as expected:
            json.loads(bad)
        assert str(caught.value) == str(expected.value)


def test_a_process_that_exports_nothing_samples_only_under_a_sampled_caller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[Any] = []
    monkeypatch.setattr(telemetry, "create_tracer_provider", lambda **kw: made.append(kw))
    monkeypatch.setattr(telemetry.trace, "set_tracer_provider", lambda provider: None)
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_TRACES_SAMPLER"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(telemetry, "BatchSpanProcessor", lambda exporter: exporter)

    telemetry.configure_tracing("test")
    assert isinstance(made[-1]["sampler"], ParentBased)
    assert "AlwaysOffSampler" in made[-1]["sampler"].get_description()

    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_on")
    telemetry.configure_tracing("test")
    assert made[-1]["sampler"] is None  # the SDK reads OTEL_TRACES_SAMPLER itself
