import pytest

from worker.request_mapping import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    InvalidRequestError,
    map_request,
)


def test_completion_string_prompt_uses_tokenizer_count_and_defaults(served_tokenizer):
    mapped = map_request(COMPLETIONS, {"model": "m", "prompt": "def add(a, b):\n"}, served_tokenizer)
    assert mapped.prompt == "def add(a, b):\n"
    assert mapped.prompt_token_ids == served_tokenizer.encode("def add(a, b):\n")
    assert mapped.params.max_tokens == 16  # OpenAI's completions default
    assert mapped.params.temperature == 1.0
    assert mapped.params.logprobs is None
    assert mapped.echo is False


def test_completion_token_id_prompt_is_fed_as_is(served_tokenizer):
    mapped = map_request(COMPLETIONS, {"model": "m", "prompt": [1604, 275, 24]}, served_tokenizer)
    assert mapped.prompt is None
    assert mapped.prompt_token_ids == [1604, 275, 24]


def test_completion_sampling_fields_and_vllm_extensions(served_tokenizer):
    body = {
        "model": "m",
        "prompt": "x",
        "max_tokens": 128,
        "temperature": 0,
        "top_p": 0.5,
        "n": 3,
        "seed": 7,
        "stop": "\ndef ",
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "logit_bias": {"42": -100, "7": 5.5},
        "logprobs": 2,
        "echo": True,
        "top_k": 5,
        "min_p": 0.1,
        "repetition_penalty": 1.2,
        "min_tokens": 2,
        "ignore_eos": True,
        "stop_token_ids": [2],
        "include_stop_str_in_output": True,
    }
    params = map_request(COMPLETIONS, body, served_tokenizer).params
    assert (params.max_tokens, params.temperature, params.top_p, params.n, params.seed) == (128, 0.0, 0.5, 3, 7)
    assert params.stop == ["\ndef "]
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.25)
    assert params.logit_bias == {42: -100.0, 7: 5.5}
    assert params.logprobs == 2 and params.prompt_logprobs == 2
    assert (params.top_k, params.min_p, params.repetition_penalty, params.min_tokens) == (5, 0.1, 1.2, 2)
    assert params.ignore_eos and params.include_stop_str_in_output
    assert params.stop_token_ids == [2]


def test_chat_prompt_is_the_models_chat_template(served_tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    mapped = map_request(CHAT_COMPLETIONS, {"model": "m", "messages": messages}, served_tokenizer)
    expected = served_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert mapped.prompt == expected
    assert mapped.prompt.endswith("<|im_start|>assistant\n")
    expected_ids = served_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert mapped.prompt_token_ids == list(expected_ids)
    assert mapped.prompt_token_ids.count(served_tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3
    assert mapped.params.max_tokens is None  # chat: up to the context limit


def test_chat_text_parts_equal_plain_content(served_tokenizer):
    plain = map_request(CHAT_COMPLETIONS, {"messages": [{"role": "user", "content": "hi there"}]}, served_tokenizer)
    parts = map_request(
        CHAT_COMPLETIONS,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}]},
        served_tokenizer,
    )
    assert parts.prompt_token_ids == plain.prompt_token_ids


def test_chat_max_completion_tokens_wins_and_logprobs(served_tokenizer):
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "max_completion_tokens": 9,
        "logprobs": True,
        "top_logprobs": 3,
    }
    params = map_request(CHAT_COMPLETIONS, body, served_tokenizer).params
    assert params.max_tokens == 9
    assert params.logprobs == 3
    assert params.prompt_logprobs is None
    no_top = map_request(CHAT_COMPLETIONS, {"messages": body["messages"], "logprobs": True}, served_tokenizer)
    assert no_top.params.logprobs == 0


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        (COMPLETIONS, {"prompt": ""}, "prompt"),
        (COMPLETIONS, {"prompt": {"a": 1}}, "prompt"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        (COMPLETIONS, {"prompt": "x", "temperature": -1}, "temperature"),
        (COMPLETIONS, {"prompt": "x", "temperature": "hot"}, "temperature"),
        (COMPLETIONS, {"prompt": "x", "n": 1.5}, "n"),
        (COMPLETIONS, {"prompt": "x", "logprobs": 21}, "logprobs"),
        (COMPLETIONS, {"prompt": "x", "stop": [1, 2]}, "stop"),
        (COMPLETIONS, {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
        (COMPLETIONS, {"prompt": "x", "echo": "yes"}, "echo"),
        (CHAT_COMPLETIONS, {"messages": []}, "messages"),
        (CHAT_COMPLETIONS, {"messages": [{"content": "no role"}]}, "messages[0]"),
        (CHAT_COMPLETIONS, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
        (CHAT_COMPLETIONS, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ("/v1/embeddings", {"input": "x"}, "url"),
    ],
)
def test_rejected_bodies_name_the_field(served_tokenizer, endpoint, body, param):
    with pytest.raises(InvalidRequestError) as info:
        map_request(endpoint, body, served_tokenizer)
    assert info.value.param == param
    assert info.value.message
