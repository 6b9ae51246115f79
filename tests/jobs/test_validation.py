"""Input-file validation: all-or-nothing on structure, one error per bad line, 1-based line numbers, clear codes.

A body the endpoint rejects is not a structural error (the worker answers that line with a 400):
see tests/jobs/test_line_body.py.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from jobs.config import BUILTIN_MODEL
from jobs.validation import (
    MAX_ERRORS,
    TooManyLines,
    ValidatedLine,
    limit_lines,
    validate_batch_file,
    validated_lines,
)
from tests.helpers.service import CHAT, COMPLETIONS, chat_line, jsonl


def _chunks(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def _validate(data: bytes, endpoint: str = CHAT, *, max_lines: int = 100, max_bytes: int = 1 << 20, chunk: int = 7):
    """Validate ``data`` fed in small chunks (lines split across chunk boundaries), as storage streams it."""
    return validate_batch_file(
        _chunks(data, chunk), endpoint=endpoint, model_names={BUILTIN_MODEL}, max_lines=max_lines, max_bytes=max_bytes
    )


def _lines(data: bytes, endpoint: str = CHAT) -> list[ValidatedLine]:
    return list(validated_lines(_chunks(data, 5), endpoint=endpoint, model_names={BUILTIN_MODEL}))


def _with_body(custom_id: str, **fields: Any) -> dict[str, Any]:
    line = chat_line(custom_id)
    line["body"].update(fields)
    return line


def test_good_file_yields_every_line_in_order() -> None:
    data = jsonl([chat_line("a"), chat_line("b", max_tokens=5, temperature=0)])
    result = _validate(data)
    assert result.ok
    assert result.num_lines == 2
    lines = _lines(data)
    assert [(line.line_number, line.custom_id) for line in lines] == [(1, "a"), (2, "b")]
    assert lines[1].body["max_tokens"] == 5


def test_file_mixing_good_lines_with_each_kind_of_bad_line_fails_with_one_error_per_bad_line() -> None:
    bad_body = _with_body("bad-body", temperature=3)
    no_body = chat_line("no-body")
    del no_body["body"]
    missing_id = chat_line("x")
    del missing_id["custom_id"]
    lines: list[dict[str, Any] | str] = [
        chat_line("ok-1"),  # 1
        '{"custom_id": "broken", "method": "POST"',  # 2 invalid_json
        missing_id,  # 3 missing_custom_id
        chat_line("ok-1"),  # 4 duplicate_custom_id
        {**chat_line("get"), "method": "GET"},  # 5 invalid_method
        {**chat_line("wrong-url"), "url": COMPLETIONS},  # 6 invalid_url
        _with_body("streaming", stream=True),  # 7 body rejected later, per line
        _with_body("other-model", model="gpt-4o"),  # 8 model not served: rejected alone, per line
        bad_body,  # 9 body rejected later, per line
        "",  # 10 blank: skipped, still counted
        chat_line("ok-2"),  # 11
        no_body,  # 12 invalid_body
        "[1, 2]",  # 13 invalid_json (not an object)
        {**chat_line("extra"), "priority": 1},  # 14 invalid_line
        {**chat_line("x"), "custom_id": 7},  # 15 missing_custom_id (not a string)
    ]
    result = _validate(jsonl([*lines, chat_line("ok-3")]))

    assert not result.ok
    got = [(error.line, error.code) for error in result.errors]
    assert got == [
        (2, "invalid_json"),
        (3, "missing_custom_id"),
        (4, "duplicate_custom_id"),
        (5, "invalid_method"),
        (6, "invalid_url"),
        (12, "invalid_body"),
        (13, "invalid_json"),
        (14, "invalid_line"),
        (15, "missing_custom_id"),
    ]
    assert result.num_errors == len(result.errors)
    by_line = {error.line: error for error in result.errors}
    assert "line 1" in by_line[4].message and by_line[4].param == "custom_id"
    assert by_line[6].param == "url" and COMPLETIONS in by_line[6].message
    assert by_line[12].param == "body"
    assert by_line[14].param == "priority"
    for error in result.errors:
        assert error.message


@pytest.mark.parametrize(("field", "code"), [("method", "invalid_method"), ("url", "invalid_url")])
def test_a_missing_method_or_url_is_named_as_missing(field: str, code: str) -> None:
    line = chat_line("a")
    del line[field]
    [error] = _validate(jsonl([line])).errors
    assert (error.line, error.code, error.param) == (1, code, field)
    assert error.message.startswith(f"{field} is missing") and "None" not in error.message


@pytest.mark.parametrize(
    ("data", "code"),
    [(b"", "empty_file"), (b"\n\n  \n", "empty_file"), (b"\xef\xbb\xbf", "empty_file")],
)
def test_empty_file_is_one_whole_file_error(data: bytes, code: str) -> None:
    result = _validate(data)
    assert [(e.code, e.line) for e in result.errors] == [(code, None)]
    assert "no requests" in result.errors[0].message


def test_a_non_utf8_file_is_one_error_naming_the_line_of_its_first_bad_byte() -> None:
    latin1 = (
        json.dumps(chat_line("café"), ensure_ascii=False).encode("utf-8").replace("é".encode(), "é".encode("latin-1"))
    )
    data = jsonl([chat_line("a"), "not json"]) + latin1 + b"\n" + latin1.replace(b"caf", b"tea") + b"\n"
    result = _validate(data)
    assert [(e.code, e.line) for e in result.errors] == [("invalid_encoding", 3)]
    assert result.num_errors == 1
    assert "not UTF-8 text" in result.errors[0].message and "line 3" in result.errors[0].message


def test_a_megabyte_of_random_bytes_is_one_invalid_encoding_error() -> None:
    noise = random.Random(25).randbytes(1 << 20)
    result = _validate(noise, max_bytes=2 << 20, max_lines=100_000, chunk=1 << 16)
    assert [e.code for e in result.errors] == ["invalid_encoding"] and result.num_errors == 1
    assert result.errors[0].line is not None


def test_errors_keep_the_first_thousand_and_count_them_all() -> None:
    data = jsonl(["not json"] * (MAX_ERRORS + 234) + [chat_line("ok")])
    result = _validate(data, max_lines=10_000, chunk=1 << 16)
    assert len(result.errors) == MAX_ERRORS and result.num_errors == MAX_ERRORS + 234
    assert [e.line for e in result.errors] == list(range(1, MAX_ERRORS + 1))


@pytest.mark.parametrize("custom_id", ["a\x00b", "\x00", "lone \ud800 surrogate", "\udfff"])
def test_a_custom_id_the_database_cannot_hold_rejects_that_line_only(custom_id: str) -> None:
    data = jsonl([chat_line("before"), chat_line(custom_id), chat_line("after")])
    result = _validate(data)
    assert result.ok, result.errors
    before, rejected, after = _lines(data)
    assert before.rejection is None and after.rejection is None
    assert rejected.custom_id == custom_id
    assert rejected.rejection is not None and rejected.rejection.param == "custom_id"
    assert json.dumps(custom_id)[1:-1] in rejected.rejection.message


def test_a_custom_id_with_a_nul_is_still_checked_for_duplicates() -> None:
    result = _validate(jsonl([chat_line("a\x00"), chat_line("a\x00")]))
    assert [(e.line, e.code) for e in result.errors] == [(2, "duplicate_custom_id")]


def test_bom_crlf_and_non_ascii_are_accepted() -> None:
    data = b"\xef\xbb\xbf" + jsonl([chat_line("a", "Ça va? 日本語"), chat_line("b")]).replace(b"\n", b"\r\n")
    result = _validate(data)
    assert result.ok, result.errors
    assert _lines(data)[0].body["messages"][0]["content"] == "Ça va? 日本語"


def test_line_limit_counts_requests_not_blank_lines() -> None:
    data = jsonl([chat_line("a"), "", chat_line("b"), "", chat_line("c")])
    assert _validate(data, max_lines=3).ok
    result = _validate(data, max_lines=2)
    assert [(e.code, e.line) for e in result.errors] == [("too_many_lines", None)]
    assert "limit is 2" in result.errors[0].message


@pytest.mark.parametrize("chunk", [1, 3, 1 << 20])
def test_limit_lines_counts_non_blank_lines_across_chunk_boundaries(chunk: int) -> None:
    data = b"\xef\xbb\xbf" + jsonl([chat_line("a"), "", "  ", chat_line("b")]) + b'{"last": "no newline"}'
    assert b"".join(limit_lines(_chunks(data, chunk), 3)) == data
    with pytest.raises(TooManyLines, match="limit of 2"):
        b"".join(limit_lines(_chunks(data, chunk), 2))


@pytest.mark.parametrize("chunk", [1, 2, 64])
def test_lines_split_across_chunks_read_as_whole_lines(chunk: int) -> None:
    data = jsonl([chat_line("a", "x" * 100), "", chat_line("b")]).replace(b"\n", b"\r\n")
    assert _validate(data, chunk=chunk).ok
    assert [(line.line_number, line.custom_id) for line in _lines(data)] == [(1, "a"), (3, "b")]


def test_byte_limit() -> None:
    data = jsonl([chat_line("a")])
    assert _validate(data, max_bytes=len(data)).ok
    result = _validate(data, max_bytes=len(data) - 1)
    assert [(e.code, e.line) for e in result.errors] == [("file_too_large", None)]


@pytest.mark.parametrize(
    ("line", "kind"), [(b"null", "null"), (b"[1]", "an array"), (b'"x"', "a string"), (b"3", "a number")]
)
def test_a_line_that_is_not_an_object_names_its_json_type(line: bytes, kind: str) -> None:
    result = _validate(line + b"\n")

    assert [(e.code, e.line, e.message) for e in result.errors] == [
        ("invalid_json", 1, f"the line must be a JSON object, got {kind}")
    ]


def test_nan_is_not_json() -> None:
    result = _validate(
        b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "'
        + BUILTIN_MODEL.encode()
        + b'", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}}\n'
    )
    assert [e.code for e in result.errors] == ["invalid_json"]


def test_bodies_the_endpoint_rejects_pass_structural_validation() -> None:
    lines = [
        _with_body("a", temperature=3),
        _with_body("b", stream=True),
        _with_body("c", temprature=0.5),
        _with_body("d", messages=[]),
        _with_body("e", max_tokens=0),
    ]
    result = _validate(jsonl(lines))
    assert result.ok, result.errors
    assert [line.custom_id for line in _lines(jsonl(lines))] == ["a", "b", "c", "d", "e"]


_MODELS = {"chat": "chat", "chat-latest": "chat", "mini": "mini", "embedder": "embedder"}


def _validate_models(lines: list[dict[str, Any]]):
    return validate_batch_file([jsonl(lines)], endpoint=CHAT, model_names=_MODELS, max_lines=100, max_bytes=1 << 20)


def test_a_file_naming_two_models_fails_naming_the_first_line_of_the_other() -> None:
    result = _validate_models(
        [_with_body("a", model="chat"), _with_body("b", model="chat-latest"), _with_body("c", model="mini")]
    )
    assert [(e.line, e.code, e.param) for e in result.errors] == [(3, "mismatched_model", "body.model")]
    assert "line 1 names model 'chat'" in result.errors[0].message and "'mini'" in result.errors[0].message


def test_aliases_resolve_to_their_model_which_routes_the_file() -> None:
    data = jsonl([_with_body("a", model="chat-latest"), _with_body("b", model="chat")])
    result = validate_batch_file([data], endpoint=CHAT, model_names=_MODELS, max_lines=100, max_bytes=1 << 20)
    assert result.ok and result.model == "chat"
    assert [line.model for line in validated_lines([data], endpoint=CHAT, model_names=_MODELS)] == ["chat", "chat"]


def test_an_unknown_model_is_a_400_for_its_line_alone_naming_the_served_models() -> None:
    data = jsonl([_with_body("a", model="gpt-4o"), _with_body("b", model="mini")])
    result = validate_batch_file([data], endpoint=CHAT, model_names=_MODELS, max_lines=100, max_bytes=1 << 20)
    assert result.ok and result.model == "mini"
    bad, good = validated_lines([data], endpoint=CHAT, model_names=_MODELS)
    assert good.rejection is None and good.model == "mini"
    assert bad.model is None and bad.rejection is not None
    assert (bad.rejection.code, bad.rejection.param, bad.rejection.line) == ("model_not_found", "body.model", 1)
    assert "gpt-4o" in bad.rejection.message
    assert "served: 'chat', 'embedder', 'mini'" in bad.rejection.message


def test_missing_model_is_invalid_body() -> None:
    line = chat_line("a")
    del line["body"]["model"]
    result = _validate(jsonl([line]))
    assert [(e.code, e.param) for e in result.errors] == [("invalid_body", "body.model")]


def test_too_long_custom_id() -> None:
    result = _validate(jsonl([chat_line("x" * 513)]))
    assert [e.code for e in result.errors] == ["invalid_custom_id"]


def _nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


def test_a_line_nested_thousands_of_levels_deep_is_invalid_json_with_its_line_number() -> None:
    """json.loads would raise RecursionError (not ValueError) on it; the line is refused like any bad JSON."""
    deep = json.dumps(chat_line("deep")).replace('"Say hi."', _nested(5000))
    result = _validate(jsonl([chat_line("ok"), deep, chat_line("ok-2")]), chunk=4096)
    assert [(error.line, error.code) for error in result.errors] == [(2, "invalid_json")]
    assert "more than 64 levels deep" in result.errors[0].message


def test_nesting_is_capped_at_64_levels_whatever_the_stack_depth() -> None:
    """Line (1) > body (2) > messages (3) > message (4) > content: 60 more levels make 64, one more is refused."""
    at_limit = json.dumps(chat_line("at-limit")).replace('"Say hi."', _nested(60))
    over = json.dumps(chat_line("over")).replace('"Say hi."', _nested(61))
    result = _validate(jsonl([at_limit, over]))
    assert [(error.line, error.code) for error in result.errors] == [(2, "invalid_json")]
    brackets_in_strings = chat_line("strings", "[" * 500 + "{" * 500)
    assert _validate(jsonl([brackets_in_strings])).ok
