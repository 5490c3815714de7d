"""The OpenAI request schema and response shapes on their own, without a server: what each body turns into,
which field an error names, and that renderers give OpenAI's keys."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("pydantic")

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from pydantic import ValidationError  # noqa: E402

from speculum.serving.engine import Delta, TokenLogprob  # noqa: E402
from speculum.serving.render import ChatRenderer, CompletionRenderer  # noqa: E402
from speculum.serving.schema import (ChatBody, CompletionBody, RequestError, ServerLimits,  # noqa: E402
                                     check_prompt_size, default_body_limit, to_request)

LIMITS = ServerLimits(max_stop=4, max_stop_chars=8)


def request(body: dict, ids=(1, 2), limits=LIMITS, cls=CompletionBody):
    return to_request(cls.model_validate(body), list(ids), limits, model_name="m", default_max_tokens=7)


def refused(body: dict, cls=CompletionBody, ids=(1, 2)) -> RequestError:
    with pytest.raises(RequestError) as caught:
        parsed = cls.model_validate(body)
        check_prompt_size(parsed, LIMITS)
        to_request(parsed, list(ids), LIMITS, model_name="m", default_max_tokens=7)
    return caught.value


def test_a_body_becomes_the_engines_request():
    made = request({"prompt": "x", "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "seed": 4, "stop": "\n",
                    "logprobs": 2})
    assert (made.prompt_ids, made.max_tokens, made.temperature, made.top_p, made.seed, made.stop, made.logprobs) == \
        ([1, 2], 3, 0.5, 0.9, 4, ("\n",), 2)
    assert request({"prompt": "x"}).max_tokens == 7
    assert request({"prompt": "x", "max_completion_tokens": 5, "max_tokens": 9}).max_tokens == 5
    chat = request({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 3},
                   cls=ChatBody)
    assert chat.logprobs == 3
    assert request({"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, cls=ChatBody).logprobs == 0
    assert request({"messages": [{"role": "user", "content": "hi"}]}, cls=ChatBody).logprobs is None


@pytest.mark.parametrize("body, param, status", [
    ({"prompt": ""}, "prompt", 400),
    ({"prompt": []}, "prompt", 400),
    ({"prompt": "x", "model": "other"}, "model", 404),
    ({"prompt": "x", "n": 2}, "n", 400),
    ({"prompt": "x", "echo": True, "stream": True}, "stream", 400),
    ({"prompt": ["x", "y"], "stream": True}, "stream", 400),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", 400),
    ({"prompt": "x", "logprobs": 21}, "logprobs", 400),
    ({"prompt": "x", "logprobs": -1}, "logprobs", 400),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", 400),
    ({"prompt": "x", "stop": "123456789"}, "stop", 400),
])
def test_refusals_name_the_field(body, param, status):
    error = refused(body)
    assert (error.param, error.status) == (param, status)


def test_chat_refusals_name_the_field():
    assert refused({"messages": [{"role": "user", "content": "hi"}], "echo": True}, cls=ChatBody).param == "echo"
    assert refused({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, cls=ChatBody).param == \
        "top_logprobs"
    assert refused({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 30},
                   cls=ChatBody).param == "top_logprobs"


@pytest.mark.parametrize("body", [{"prompt": "x", "max_tokens": "3"}, {"prompt": "x", "max_tokens": -1},
                                  {"prompt": "x", "temperature": -1}, {"prompt": "x", "top_p": 0},
                                  {"max_tokens": 3}, {"messages": []}])
def test_strict_fields(body):
    with pytest.raises(ValidationError):
        (ChatBody if "messages" in body else CompletionBody).model_validate(body)


@given(st.integers(1, 10_000), st.integers(1, 100))
def test_a_prompt_that_fits_the_window_is_never_refused_by_its_size(max_context, longest):
    limits = default_body_limit(max_context, longest)
    text = "é" * max(1, max_context * longest // 2)     # max_context x longest bytes of UTF-8 (at least 2)
    check_prompt_size(CompletionBody.model_validate({"prompt": text}), limits)
    assert limits.max_body_bytes > 3 * len(text.encode())
    with pytest.raises(RequestError):
        check_prompt_size(CompletionBody.model_validate({"prompt": "a" * (limits.max_prompt_bytes + 1)}), limits)


def test_renderers_give_openais_keys():
    scored = [TokenLogprob(3, "c", -0.5, 0, ((3, "c", -0.5), (4, "d", -1.0)))]
    last = Delta("", "stop", prompt_tokens=2, completion_tokens=1)
    whole = CompletionRenderer("m", logprobs=1).whole("id", "c", last, scored)
    assert whole["object"] == "text_completion" and whole["choices"][0]["text"] == "c"
    assert whole["choices"][0]["logprobs"] == {"tokens": ["c"], "token_logprobs": [-0.5],
                                               "top_logprobs": [{"c": -0.5, "d": -1.0}], "text_offset": [0]}
    chat = ChatRenderer("m", logprobs=True, token_bytes=[b"a", b"b", b"c", b"\xc3", b"d"])
    entry = chat.whole("id", "c", last, scored)["choices"][0]
    assert entry["message"] == {"role": "assistant", "content": "c"}
    assert entry["logprobs"]["content"][0]["bytes"] == [0xC3]        # the token's own bytes, not its text's
    assert entry["logprobs"]["content"][0]["top_logprobs"][1]["bytes"] == [ord("d")]
    first = chat.chunk("id", Delta("c"), True)["choices"][0]["delta"]
    later = chat.chunk("id", Delta(""), False)["choices"][0]["delta"]
    assert first == {"role": "assistant", "content": "c"} and later == {}
    end = chat.chunk("id", last, False)
    assert end["usage"]["total_tokens"] == 3 and end["object"] == "chat.completion.chunk"
    assert CompletionRenderer("m", logprobs=None).whole("id", "c", last, scored)["choices"][0]["logprobs"] is None


# ------------------------------------------------------------------------------- every refusal names its field
def _refusal_over_http(body: dict, route: str = "/v1/completions") -> dict:
    from fastapi.testclient import TestClient

    from speculum.serving import Engine, create_app
    from support.serving import NAME, decode, encode, encode_chat, make_target

    engine = Engine(make_target(), decode=decode)
    with TestClient(create_app(engine, NAME, encode_text=encode, encode_chat=encode_chat)) as client:
        reply = client.post(route, content=json.dumps(body, allow_nan=True),
                            headers={"Content-Type": "application/json"})
    assert reply.status_code == 400, reply.text
    return reply.json()["error"]


@pytest.mark.parametrize("body,param,says", [
    ({"prompt": [0, 1, 99]}, "prompt", "vocab"),                             # an id outside the vocabulary
    ({"prompt": [0, 1] * 40}, "prompt", "max_context"),                     # longer than the context window
    ({"prompt": [[0, 1], [0, 99]], "echo": True, "max_tokens": 0}, "prompt", "vocab"),
    ({"prompt": 5}, "prompt", "prompt"),                                      # a type error
    ({"prompt": "ab", "max_tokens": "3"}, "max_tokens", "integer"),
    ({"prompt": "ab", "temperature": float("nan")}, "temperature", "finite"),
    ({"prompt": "ab", "temperature": float("inf")}, "temperature", "finite"),
    ({"prompt": "ab", "top_p": float("nan")}, "top_p", "finite"),
    ({"prompt": "ab", "logprobs": 21}, "logprobs", "20"),
    ({"prompt": "ab", "stop": 3}, "stop", "stop"),
])
def test_every_validation_error_names_the_request_field(body, param, says):
    error = _refusal_over_http(body)
    assert error["param"] == param and says in error["message"], error


def test_a_chat_message_of_the_wrong_type_names_messages():
    error = _refusal_over_http({"messages": [{"role": "user", "content": 3}]}, "/v1/chat/completions")
    assert error["param"] == "messages", error
