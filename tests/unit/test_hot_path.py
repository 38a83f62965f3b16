"""The gateway's hot-path shortcuts answer exactly what the slow paths they skip would: the
prefix of two token lists or strings, a body's check without its pydantic model, JSON through
orjson with the standard library behind it, and a tracer that records nothing it would drop."""

from __future__ import annotations

import json
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace.sampling import ParentBased
from pydantic import ValidationError

from darl.deploy import telemetry
from darl.gateway import json_codec
from darl.gateway.errors import BadRequestError, InvalidJSONError
from darl.gateway.protocols.chat.capture import answer_as_asked
from darl.gateway.protocols.chat.prompt_ids import (
    CaptureError,
    RawTokenIds,
    answer_of,
    null_prompt_ids,
)
from darl.gateway.protocols.chat.protocol import (
    CHAT,
    COMPLETIONS,
    ChatCompletionRequest,
    CompletionRequest,
    Endpoint,
    validate_body,
)
from darl.gateway.protocols.chat.sent_messages import SentMessages, read_chat
from darl.gateway.routes.bodies import json_object
from darl.gateway.store.codec import Tail, common_prefix, encode_line, prompt_delta
from darl.gateway.store.record import CallRecord


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


CHATS = st.fixed_dictionaries(
    {
        "messages": st.lists(
            st.one_of(
                st.just({"role": "user", "content": "\u00e9t\u00e9 \U0001f600"}),
                st.dictionaries(st.text(max_size=3), VALUES, max_size=3),
                VALUES,
            ),
            max_size=3,
        )
    },
    optional={"stream": VALUES, "n": VALUES, "x": VALUES},
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(CHATS, st.booleans(), st.booleans())
def test_a_chat_read_with_its_messages_as_sent_is_the_chat_read_whole(
    body: dict[str, Any], spaced: bool, ascii_only: bool
) -> None:
    """`read_chat` reads what `json_codec.loads` reads, is validated as it is, and is written
    out as the same JSON; it leaves to the whole reading (None) only a body whose messages are
    not a non-empty array of objects, or holds what msgspec refuses."""
    separators = (", ", ": ") if spaced else (",", ":")
    sent = json.dumps(body, separators=separators, ensure_ascii=ascii_only).encode()
    whole = json_codec.loads(sent)
    read = read_chat(sent)
    messages = whole["messages"]
    if read is None:
        try:
            msgspec.json.decode(sent)
        except msgspec.DecodeError:
            return  # what msgspec refuses (Infinity, say) is read whole
        assert not messages or not all(isinstance(m, dict) for m in messages)
        return
    assert isinstance(read["messages"], SentMessages)
    assert read == whole and list(read) == list(whole)
    assert json.loads(json_codec.dumps(read)) == whole
    try:
        verdict: bool | str = validate_body(CHAT, read)
    except BadRequestError:
        verdict = "refused"
    assert verdict == schema_says(CHAT, whole)


# Whether msgspec refuses the message (the chat is then read whole), for each of ODD_BODIES.
REFUSED = [False, True, False, True, False]


@pytest.mark.parametrize(("body", "refused"), list(zip(ODD_BODIES, REFUSED, strict=True)))
def test_odd_messages_are_forwarded_as_the_standard_library_reads_them(
    body: bytes, refused: bool
) -> None:
    """What msgspec refuses (NaN, a lone surrogate) leaves a chat to the whole reading; what it
    takes is forwarded as the bytes sent, on one line whatever lines they were sent on."""
    sent = b'{"messages": [\n' + body + b"\r\n]}"
    read = read_chat(sent)
    assert (read is None) == refused
    written = json_codec.dumps(read or json_codec.loads(sent))
    assert repr(json.loads(written)) == repr(json.loads(sent))
    assert b"\n" not in written and b"\r" not in written


def test_a_chat_not_in_utf_8_is_refused_as_a_body_read_whole_is() -> None:
    """The skim checks no string's UTF-8: the messages are checked apart, and a chat with a
    byte that is not UTF-8 anywhere is read whole (and refused there, 400)."""
    for sent in (b'{"messages": [{"c": "\xff"}]}', b'{"messages": [{}], "model": "\xff"}'):
        assert read_chat(sent) is None
        with pytest.raises(InvalidJSONError):
            json_object(sent)
    assert read_chat('{"messages": [{"c": "\u00e9t\u00e9"}]}'.encode()) is not None


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
    processors: list[Any] = []

    def provider(**kw: Any) -> Any:
        made.append(kw)
        return SimpleNamespace(add_span_processor=processors.append)

    monkeypatch.setattr(telemetry, "create_tracer_provider", provider)
    installed: list[Any] = []
    monkeypatch.setattr(telemetry.trace, "set_tracer_provider", installed.append)
    monkeypatch.setattr(telemetry.trace, "get_tracer_provider", lambda: installed[-1])
    monkeypatch.setattr(telemetry, "_installed_exports", None)
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_TRACES_SAMPLER"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(telemetry, "BatchSpanProcessor", lambda exporter: exporter)
    assert not telemetry.drops_spans()  # a provider installed otherwise is taken to export

    telemetry.configure_tracing("test")
    assert isinstance(made[-1]["sampler"], ParentBased)
    assert "AlwaysOffSampler" in made[-1]["sampler"].get_description()
    assert telemetry.drops_spans()

    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_on")
    telemetry.configure_tracing("test")
    assert made[-1]["sampler"] is None  # the SDK reads OTEL_TRACES_SAMPLER itself
    assert telemetry.drops_spans()  # sampled, and still dropped

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    telemetry.configure_tracing("test")
    assert len(processors) == 1
    assert not telemetry.drops_spans()

    # A provider OpenTelemetry refused (one was set before) says nothing of the one in use.
    monkeypatch.setattr(telemetry, "_installed_exports", None)
    monkeypatch.setattr(telemetry.trace, "set_tracer_provider", lambda provider: None)
    monkeypatch.delenv("OTEL_TRACES_EXPORTER")
    telemetry.configure_tracing("test")
    assert not telemetry.drops_spans()


@pytest.mark.parametrize(
    ("env", "exports"),
    [
        ({}, False),
        ({"OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_TRACES_SAMPLER": "always_on"}, False),  # sampled, and still dropped
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, True),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318",
                "OTEL_TRACES_EXPORTER": "none",
            },
            False,
        ),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, False),
    ],
)
def test_a_process_exports_traces_only_where_an_exporter_is_named(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], exports: bool
) -> None:
    """What decides whether the gateway makes spans of its own (`GatewaySettings.traced`)."""
    for name in (
        "OTEL_TRACES_EXPORTER",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_TRACES_SAMPLER",
        "OTEL_SDK_DISABLED",
    ):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert telemetry.exports_traces() is exports


# Ids that share digit prefixes (1, 12, 123), so a byte prefix can end inside an id.
IDS = st.lists(st.sampled_from([0, 1, 2, 12, 123, 1234, 21, 10]), max_size=40)


def ids_json(ids: list[int], spacing: str) -> bytes:
    """`ids` as a JSON array the way a policy server may write it."""
    return ("[" + spacing + ("," + spacing).join(map(str, ids)) + spacing + "]").encode()


def chat_record(prompt: Sequence[int], completion: list[int], sequence: int) -> CallRecord:
    response = {"choices": [{"index": 0, "token_ids": completion}], "prompt_token_ids": prompt}
    request = {"messages": [{"role": "user", "content": "hi"}]}
    return CallRecord(
        "c", "r", 1, sequence, CHAT, "u", 0, 0.0, 1.0, 0, False, request, response, prompt
    )


@given(
    prev=IDS,
    completion=IDS,
    cut=st.integers(0, 45),
    extra=IDS,
    spacing=st.sampled_from(["", " ", "\n  "]),
    prev_spacing=st.sampled_from(["", " "]),
)
def test_the_byte_delta_of_a_prompt_is_the_list_delta(
    prev: list[int],
    completion: list[int],
    cut: int,
    extra: list[int],
    spacing: str,
    prev_spacing: str,
) -> None:
    """A prompt kept as the policy server's bytes is stored exactly as its list would be: same
    base, same ids, same line; and it counts the same ids."""
    context = prev + completion
    prompt = context[:cut] + extra  # extends the previous call, or parts inside it
    by_list, by_bytes = Tail(), Tail()
    by_list.advance(chat_record(prev, completion, 0))
    raw_prev = RawTokenIds(ids_json(prev, prev_spacing))
    raw_prev.ids()  # a previous prompt is parsed, or split against its own previous
    by_bytes.advance(chat_record(raw_prev, completion, 0))
    raw = RawTokenIds(ids_json(prompt, spacing))
    expected = encode_line(chat_record(prompt, [], 1), by_list)
    assert encode_line(chat_record(raw, [], 1), by_bytes) == expected
    assert prompt_delta(by_bytes, RawTokenIds(ids_json(prompt, spacing))) == prompt_delta(
        by_list, prompt
    )
    assert len(raw) == len(prompt) and raw == prompt and list(raw) == prompt
    by_bytes.advance(chat_record(raw, [7], 1))
    by_list.advance(chat_record(prompt, [7], 1))
    following = [*prompt, 7, 12]
    assert encode_line(chat_record(RawTokenIds(ids_json(following, "")), [], 2), by_bytes) == (
        encode_line(chat_record(following, [], 2), by_list)
    )


ANSWER_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-5, 300), st.text(max_size=3)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(["a", "prompt_token_ids", "choices"]), inner, max_size=3),
    ),
    max_leaves=8,
)


@given(
    fields=st.dictionaries(st.sampled_from(["id", "choices", "usage", "x"]), ANSWER_VALUES),
    ids=st.one_of(IDS, ANSWER_VALUES),
    position=st.integers(0, 4),
    separators=st.sampled_from([(",", ":"), (", ", ": ")]),
)
def test_answer_of_reads_what_json_codec_reads(
    fields: dict[str, Any], ids: Any, position: int, separators: tuple[str, str]
) -> None:
    """A chat answer read with its prompt's ids kept as bytes equals the answer read whole,
    wherever the ids lie and whatever they are (a flat array, or anything else)."""
    items = list(fields.items())
    items.insert(min(position, len(items)), ("prompt_token_ids", ids))
    body = json.dumps(dict(items), separators=separators).encode()
    read = answer_of(CHAT, body)
    assert read == json_codec.loads(body)
    assert list(read) == list(json_codec.loads(body))  # the same keys in the same order
    # A body whose only "prompt_token_ids" is inside a string or nested is read whole.
    nested = json.dumps({"a": {"prompt_token_ids": ids}, "b": json.dumps({"prompt_token_ids": 1})})
    assert answer_of(CHAT, nested.encode()) == json.loads(nested)
    # A key that only ends in an escaped quote and the name is not the prompt's ids.
    lookalike = json.dumps({'x"prompt_token_ids': ids, **fields}).encode()
    assert answer_of(CHAT, lookalike) == json_codec.loads(lookalike)


def test_ids_are_cut_out_only_where_the_key_comes_once() -> None:
    """A body with a second `"prompt_token_ids"` (before the array or after it, nested or
    not) has no one array to cut out: the caller reads it whole."""
    for body in (
        b'{"prompt_token_ids":[1,2],"x":{"prompt_token_ids":[3]}}',
        b'{"prompt_token_ids":[1,2],"prompt_token_ids":[3]}',
        b'{"x":{"prompt_token_ids":[3]},"prompt_token_ids":[1,2]}',
    ):
        assert null_prompt_ids(body) is None
    assert null_prompt_ids(b'{"prompt_token_ids": [1, 2], "x": 1}') == (
        b'{"prompt_token_ids": null, "x": 1}'
    )


@given(
    fields=st.dictionaries(st.sampled_from(["id", "choices", "usage", "x"]), ANSWER_VALUES),
    ids=st.one_of(IDS, ANSWER_VALUES),
    position=st.integers(0, 4),
    separators=st.sampled_from([(",", ":"), (", ", ": ")]),
)
def test_an_agent_that_did_not_ask_gets_the_prompt_ids_null(
    fields: dict[str, Any], ids: Any, position: int, separators: tuple[str, str]
) -> None:
    """The answer passed on to an agent that did not ask for `return_token_ids` reads as the
    policy server's with `prompt_token_ids` null, keys in their order; a flat array is cut out
    of the bytes, every other byte as it came (also inside an SSE event). One that asked gets
    the bytes as they came."""
    items = list(fields.items())
    items.insert(min(position, len(items)), ("prompt_token_ids", ids))
    body = json.dumps(dict(items), separators=separators).encode()
    read = answer_of(CHAT, body)
    assert answer_as_asked(CHAT, body, read, asked=True) is body
    passed_on = answer_as_asked(CHAT, body, read, asked=False)
    expected = {**json_codec.loads(body), "prompt_token_ids": None}
    assert json_codec.loads(passed_on) == expected
    assert list(json_codec.loads(passed_on)) == list(expected)
    if isinstance(read["prompt_token_ids"], RawTokenIds):
        array = read["prompt_token_ids"].raw
        at = body.index(array, body.index(b'"prompt_token_ids"'))
        assert passed_on == body[:at] + b"null" + body[at + len(array) :]
        event = b"data: " + body + b"\n\n"
        assert answer_as_asked(CHAT, event, read, asked=False, event=True) == (
            b"data: " + passed_on + b"\n\n"
        )


def test_a_completion_that_did_not_ask_gets_each_choices_prompt_ids_null() -> None:
    choice = {"index": 0, "text": "4", "token_ids": [9], "prompt_token_ids": [1, 2]}
    body = json.dumps({"id": "c", "choices": [choice, {**choice, "index": 1}]}).encode()
    read = answer_of("completions", body)
    passed_on = json_codec.loads(answer_as_asked("completions", body, read, asked=False))
    assert [c["prompt_token_ids"] for c in passed_on["choices"]] == [None, None]
    assert passed_on["choices"][1] == {**choice, "index": 1, "prompt_token_ids": None}
    event = answer_as_asked(
        "completions", b"data: " + body + b"\n\n", read, asked=False, event=True
    )
    assert json_codec.loads(event.removeprefix(b"data: ").removesuffix(b"\n\n")) == passed_on


@given(shared=st.binary(max_size=600), a=st.binary(max_size=40), b=st.binary(max_size=40))
def test_common_bytes_is_the_naive_count(shared: bytes, a: bytes, b: bytes) -> None:
    first, second = shared + a, shared + b
    naive = 0
    while naive < min(len(first), len(second)) and first[naive] == second[naive]:
        naive += 1
    assert json_codec.common_bytes(first, second) == naive == json_codec.common_bytes(second, first)


def test_answer_of_refuses_what_json_codec_refuses() -> None:
    """Not JSON: refused at once, or, for ids kept as bytes, when they are read (the proxy
    turns that CaptureError into the same 502 as a body that is not JSON)."""
    with pytest.raises(ValueError):
        answer_of(CHAT, b'{"prompt_token_ids":[1,2')
    read = answer_of(CHAT, b'{"prompt_token_ids":[1,,2]}')
    with pytest.raises(CaptureError):
        read["prompt_token_ids"].ids()
