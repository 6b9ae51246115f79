import json
import math

from jobs.config import BUILTIN_MODEL
from jobs.errors import error_envelope
from jobs.schemas import CHAT_COMPLETIONS, COMPLETIONS, RESPONSES
from worker.engine.output.detokenizer import decode_token
from worker.engine.outputs import CompletionOutput, Logprob, RequestOutput
from worker.request_mapping import map_request
from worker.responses import build_body, context_length_message, usage


def _position(tokenizer, chosen: int, alternatives: dict[int, float], chosen_logprob: float):
    entries = {tid: Logprob(lp, tokenizer.decode([tid])) for tid, lp in alternatives.items()}
    entries[chosen] = Logprob(chosen_logprob, tokenizer.decode([chosen]))
    return entries


def _output(tokenizer, prompt_ids, completions, *, cached=0, prompt_logprobs=None):
    return RequestOutput(
        request_id="batch_req_1",
        prompt=None,
        prompt_token_ids=prompt_ids,
        outputs=completions,
        finished=True,
        prompt_logprobs=prompt_logprobs,
        num_cached_tokens=cached,
    )


def test_text_completion_body_shape_and_usage(served_tokenizer):
    mapped = map_request(COMPLETIONS, {"model": "m", "prompt": "def add(a, b):\n", "max_tokens": 8}, served_tokenizer)
    text_ids = served_tokenizer.encode("    return a + b")
    out = _output(
        served_tokenizer,
        mapped.prompt_token_ids,
        [
            CompletionOutput(
                index=0, text="    return a + b", token_ids=text_ids, finish_reason="stop", stop_reason="\ndef "
            )
        ],
        cached=4,
    )
    body = build_body(out, mapped, model=BUILTIN_MODEL, tokenizer=served_tokenizer, created=123)
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["model"] == BUILTIN_MODEL and body["created"] == 123
    (choice,) = body["choices"]
    assert choice == {
        "index": 0,
        "text": "    return a + b",
        "logprobs": None,
        "finish_reason": "stop",
        "stop_reason": "\ndef ",
    }
    assert body["usage"] == {
        "prompt_tokens": len(mapped.prompt_token_ids),
        "completion_tokens": len(text_ids),
        "total_tokens": len(mapped.prompt_token_ids) + len(text_ids),
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    json.dumps(body, allow_nan=False)


def test_n_choices_keep_their_indexes_and_usage_sums_them(served_tokenizer):
    mapped = map_request(COMPLETIONS, {"model": "m", "prompt": "x", "n": 2, "temperature": 1}, served_tokenizer)
    outs = [
        CompletionOutput(index=1, text="b c", token_ids=[3, 4, 5], finish_reason="length"),
        CompletionOutput(index=0, text="a", token_ids=[6], finish_reason="stop"),
    ]
    body = build_body(_output(served_tokenizer, [9, 9], outs), mapped, model="m", tokenizer=served_tokenizer)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["text"] for c in body["choices"]] == ["a", "b c"]
    assert body["usage"]["completion_tokens"] == 4
    assert body["usage"]["total_tokens"] == 6


def test_completion_logprobs_have_k_plus_sampled_and_offsets(served_tokenizer):
    tok = served_tokenizer
    mapped = map_request(COMPLETIONS, {"model": "m", "prompt": "Hello", "logprobs": 1}, tok)
    a, b, c = tok.encode(" world")[0], tok.encode("!")[0], tok.encode(" there")[0]
    positions = [
        _position(tok, a, {c: -0.5}, chosen_logprob=-1.0),  # sampled token is not the top one
        _position(tok, b, {}, chosen_logprob=float("-inf")),
    ]
    out = _output(
        tok,
        mapped.prompt_token_ids,
        [CompletionOutput(0, " world!", [a, b], logprobs=positions, finish_reason="length")],
    )
    logprobs = build_body(out, mapped, model="m", tokenizer=tok)["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [" world", "!"]
    assert logprobs["token_logprobs"] == [-1.0, -9999.0]
    assert logprobs["top_logprobs"][0] == {" there": -0.5, " world": -1.0}
    assert logprobs["top_logprobs"][1] == {"!": -9999.0}
    assert logprobs["text_offset"] == [0, len(" world")]


def test_completion_echo_prepends_prompt_text_and_prompt_logprobs(served_tokenizer):
    tok = served_tokenizer
    mapped = map_request(
        COMPLETIONS, {"model": "m", "prompt": "Hello world", "echo": True, "logprobs": 0, "max_tokens": 1}, tok
    )
    p0, p1 = mapped.prompt_token_ids
    gen = tok.encode("!")[0]
    prompt_logprobs = [None, _position(tok, p1, {}, chosen_logprob=-2.0)]
    out = _output(
        tok,
        [p0, p1],
        [CompletionOutput(0, "!", [gen], logprobs=[_position(tok, gen, {}, -0.1)], finish_reason="length")],
        prompt_logprobs=prompt_logprobs,
    )
    choice = build_body(out, mapped, model="m", tokenizer=tok)["choices"][0]
    assert choice["text"] == "Hello world!"
    assert choice["logprobs"]["tokens"] == ["Hello", " world", "!"]
    assert choice["logprobs"]["token_logprobs"] == [None, -2.0, -0.1]
    assert choice["logprobs"]["top_logprobs"][0] is None
    assert choice["logprobs"]["text_offset"] == [0, 5, 11]


def test_chat_completion_body_with_top_logprobs(served_tokenizer):
    tok = served_tokenizer
    body_in = {
        "model": "m",
        "messages": [{"role": "user", "content": "Capital of France?"}],
        "logprobs": True,
        "top_logprobs": 2,
    }
    mapped = map_request(CHAT_COMPLETIONS, body_in, tok)
    paris, lyon, nice = tok.encode("Paris")[0], tok.encode("Lyon")[0], tok.encode("Nice")[0]
    position = _position(tok, paris, {lyon: -3.0, nice: -4.0}, chosen_logprob=-0.01)
    out = _output(
        tok,
        mapped.prompt_token_ids,
        [CompletionOutput(0, "Paris", [paris], logprobs=[position], finish_reason="stop", stop_reason=2)],
    )
    body = build_body(out, mapped, model="m", tokenizer=tok)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Paris", "refusal": None}
    assert choice["finish_reason"] == "stop"
    (entry,) = choice["logprobs"]["content"]
    assert entry["token"] == "Paris" and math.isclose(entry["logprob"], -0.01)
    assert entry["bytes"] == list(b"Paris")
    assert [t["token"] for t in entry["top_logprobs"]] == ["Paris", tok.decode([lyon])]
    assert [t["logprob"] for t in entry["top_logprobs"]] == [entry["logprob"], -3.0]
    assert body["usage"]["prompt_tokens"] == len(mapped.prompt_token_ids)


def test_openai_sdk_parses_the_bodies(served_tokenizer):
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    tok = served_tokenizer
    mapped = map_request(COMPLETIONS, {"model": "m", "prompt": "x", "logprobs": 1}, tok)
    gen = tok.encode("y")[0]
    out = _output(
        tok,
        mapped.prompt_token_ids,
        [CompletionOutput(0, "y", [gen], logprobs=[_position(tok, gen, {}, -0.2)], finish_reason="stop")],
    )
    completion = Completion.model_validate(build_body(out, mapped, model="m", tokenizer=tok))
    assert completion.choices[0].logprobs.tokens == ["y"]
    assert completion.usage.prompt_tokens_details.cached_tokens == 0

    mapped = map_request(
        CHAT_COMPLETIONS, {"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True}, tok
    )
    out = _output(
        tok,
        mapped.prompt_token_ids,
        [CompletionOutput(0, "y", [gen], logprobs=[_position(tok, gen, {}, -0.2)], finish_reason="length")],
    )
    chat = ChatCompletion.model_validate(build_body(out, mapped, model="m", tokenizer=tok))
    assert chat.choices[0].message.content == "y"
    assert chat.choices[0].logprobs.content[0].top_logprobs == []


def test_usage_and_error_bodies():
    out = RequestOutput("r", None, [1, 2, 3], [CompletionOutput(0, "", [4])], True, num_cached_tokens=2)
    assert usage(out)["prompt_tokens_details"] == {"cached_tokens": 2}
    message = context_length_message(9000, 8192)
    assert "9000" in message and "8192" in message
    assert error_envelope(message, param="prompt", code="context_length_exceeded") == {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": "prompt",
            "code": "context_length_exceeded",
        }
    }


def test_chat_logprob_bytes_join_into_the_text_across_split_characters(served_tokenizer):
    """CJK characters and an emoji span several byte-level tokens; each token's ``bytes`` are its own raw
    bytes (a lone part of a character decodes to U+FFFD), so joined they give back the text."""
    tok = served_tokenizer
    text = "日本語のテキスト 😀👍🏽 ok"
    token_ids = tok.encode(text)
    assert any("\ufffd" in decode_token(tok, token_id) for token_id in token_ids), "no token splits a character"
    positions = [_position(tok, token_id, {}, -0.5) for token_id in token_ids]
    body_in = {"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 1}
    mapped = map_request(CHAT_COMPLETIONS, body_in, tok)
    out = _output(
        tok, mapped.prompt_token_ids, [CompletionOutput(0, text, token_ids, logprobs=positions, finish_reason="length")]
    )

    content = build_body(out, mapped, model="m", tokenizer=tok)["choices"][0]["logprobs"]["content"]

    assert b"".join(bytes(entry["bytes"]) for entry in content).decode("utf-8") == text
    for entry in content:
        assert [top["bytes"] for top in entry["top_logprobs"]] == [entry["bytes"]]


def _response_body(served_tokenizer, body, text, finish_reason, *, cached=0):
    mapped = map_request(RESPONSES, {"model": "m", "input": "Label: great film!", **body}, served_tokenizer)
    text_ids = served_tokenizer.encode(text)
    out = _output(
        served_tokenizer,
        mapped.prompt_token_ids,
        [CompletionOutput(index=0, text=text, token_ids=text_ids, finish_reason=finish_reason)],
        cached=cached,
    )
    return mapped, text_ids, build_body(out, mapped, model=BUILTIN_MODEL, tokenizer=served_tokenizer, created=123)


def test_a_responses_line_is_answered_with_a_response_object_the_sdk_parses(served_tokenizer):
    from openai.types.responses import Response

    schema = {
        "type": "object",
        "properties": {"label": {"type": "string"}},
        "required": ["label"],
        "additionalProperties": False,
    }
    fields = {
        "instructions": "Answer in JSON.",
        "max_output_tokens": 32,
        "temperature": 0.2,
        "metadata": {"row": "7"},
        "text": {"format": {"type": "json_schema", "name": "label", "schema": schema, "strict": True}},
        "user": "u1",
    }
    mapped, text_ids, body = _response_body(served_tokenizer, fields, '{"label": "positive"}', "stop", cached=3)

    assert json.loads(json.dumps(body)) == body  # plain JSON
    assert "output_text" not in body  # the SDK's property, not a field
    response = Response.model_validate(body)
    assert response.id.startswith("resp_") and response.object == "response" and response.created_at == 123
    assert (response.status, response.incomplete_details, response.error) == ("completed", None, None)
    assert response.output_text == '{"label": "positive"}'
    (message,) = response.output
    assert message.type == "message" and message.id.startswith("msg_")
    assert (message.role, message.status) == ("assistant", "completed")
    (part,) = message.content
    assert (part.type, part.text, part.annotations) == ("output_text", '{"label": "positive"}', [])
    assert response.usage is not None
    assert response.usage.input_tokens == len(mapped.prompt_token_ids)
    assert response.usage.output_tokens == len(text_ids)
    assert response.usage.total_tokens == len(mapped.prompt_token_ids) + len(text_ids)
    assert response.usage.input_tokens_details.cached_tokens == 3
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    assert (response.instructions, response.max_output_tokens, response.temperature, response.top_p) == (
        "Answer in JSON.",
        32,
        0.2,
        1.0,
    )
    assert response.metadata == {"row": "7"} and response.user == "u1"
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema" and response.text.format.schema_ == schema
    assert (response.tools, response.parallel_tool_calls) == ([], True)


def test_a_response_cut_by_max_output_tokens_is_incomplete(served_tokenizer):
    from openai.types.responses import Response

    _, _, body = _response_body(served_tokenizer, {"max_output_tokens": 3}, "The film", "length")
    response = Response.model_validate(body)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and response.output_text == "The film"
    assert response.text is not None and response.text.format is not None and response.text.format.type == "text"
