"""Hostile text on every route and in every line field, over real PostgreSQL: never a 5xx (#25).

Hypothesis draws text with NUL characters, lone surrogates, JSON's special characters, huge strings
and deep nesting, and sends it as path ids, query parameters, JSON and multipart bodies, and as each
field of an uploaded JSONL line, which then runs through the worker (the real tokenizer, the stand-in
engine of tests/helpers/stand_in_engine.py) into the output and error files (docs/api.md, "Text the
service stores"). ``derandomize=True`` makes every run draw the same inputs, so CI is reproducible;
`NUM_INPUTS` is their total (at least 5,000); `EXAMPLES` trades runtime (minutes on 2 busy cores)
for coverage.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobs.config import BUILTIN_MODEL
from jobs.errors import InvalidRequest
from jobs.line_body import rejected_response
from jobs.storable_text import first_unstorable, is_storable
from jobs.validation import validate_batch_file, validated_lines
from tests.helpers.service import CHAT, COMPLETIONS, chat_line, completion_line, jsonl
from tests.helpers.stand_in_engine import StandInEngine
from worker import runner
from worker.request_mapping import map_request

# The service fixtures on PostgreSQL only: SQLite would take a NUL that PostgreSQL refuses.
on_postgres = pytest.mark.parametrize(
    "service_settings", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)

EXAMPLES = {"ids": 800, "queries": 300, "json": 400, "multipart": 250, "bodies": 3150, "lines": 100}
NUM_INPUTS = sum(EXAMPLES.values())
assert NUM_INPUTS >= 5000


def _fuzz(name: str) -> Any:
    return settings(
        max_examples=EXAMPLES[name],
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# --- strategies -------------------------------------------------------------------------------

_CHARS = st.one_of(
    st.characters(),
    st.sampled_from(
        ["\x00", "\ud800", "\udbff", "\udc00", "\udfff", "\ufeff", "\u2028", "\\", '"', "%", "/", "?", "#"]
    ),
    st.integers(0xD800, 0xDFFF).map(chr),
)
_SHORT = st.text(_CHARS, max_size=24)
_HUGE = st.builds(lambda unit, n: unit * n, st.text(_CHARS, min_size=1, max_size=3), st.integers(100, 10_000))
_SPECIAL = st.sampled_from(
    ["", " ", "%00", "\x00", "..", "batch_", "file-", "sched_", "null", "-1", "1e999", "🙂" * 70]
)
TEXT = st.one_of(_SHORT, _SHORT, _SHORT, _HUGE, _SPECIAL)


@dataclass(frozen=True)
class Deep:
    """Arrays (or objects) nested ``depth`` levels, written as raw JSON (json.dumps would recurse)."""

    depth: int
    objects: bool = False

    def text(self) -> str:
        if self.objects:
            return '{"a":' * self.depth + "1" + "}" * self.depth
        return "[" * self.depth + "]" * self.depth


_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False, allow_infinity=False), TEXT
)
JSON = st.recursive(
    _SCALARS,
    lambda children: st.one_of(st.lists(children, max_size=3), st.dictionaries(_SHORT, children, max_size=3)),
    max_leaves=8,
)
VALUE = st.one_of(JSON, JSON, JSON, st.builds(Deep, st.integers(30, 3000), st.booleans()))


def to_json(value: Any) -> str:
    """JSON text of ``value``; lone surrogates and NULs as JSON escapes (as a client would send them)."""
    if isinstance(value, Deep):
        return value.text()
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{to_json(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(to_json(v) for v in value) + "]"
    return json.dumps(value)


def url_part(text: str) -> str:
    """``text`` percent-encoded as UTF-8 (a lone surrogate as the bytes it would have)."""
    return quote(text.encode("utf-8", "surrogatepass"), safe="")


# Non-empty (an empty id is another route) and within the 64 KiB an HTTP client sends in a URL.
URL_TEXT = TEXT.filter(lambda text: 0 < len(url_part(text)) < 16_000)


def multipart(fields: dict[str, str], files: dict[str, tuple[str, bytes]]) -> tuple[bytes, str]:
    """A multipart/form-data body, built by hand so any name can be sent (an HTTP client would refuse some)."""
    boundary = uuid.uuid4().hex
    parts = []
    for name, value in fields.items():
        head = f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'
        parts.append(head.encode() + value.encode("utf-8", "surrogatepass") + b"\r\n")
    for name, (filename, data) in files.items():
        quoted = filename.replace('"', "%22").replace("\r", "%0D").replace("\n", "%0A")
        head = f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{quoted}"\r\n'
        parts.append(
            head.encode("utf-8", "surrogatepass") + b"Content-Type: application/jsonl\r\n\r\n" + data + b"\r\n"
        )
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def _body_paths(endpoint: str) -> list[tuple[str | int, ...]]:
    if endpoint == CHAT:
        return [
            ("model",),
            ("messages",),
            ("messages", 0),
            ("messages", 0, "content"),
            ("messages", 0, "role"),
            ("messages", 0, "name"),
            ("stop",),
            ("logit_bias",),
            ("user",),
            ("max_tokens",),
            ("temperature",),
            ("response_format",),
            ("seed",),
        ]
    return [("model",), ("prompt",), ("suffix",), ("stop",), ("logit_bias",), ("echo",), ("max_tokens",), ("user",)]


@st.composite
def fuzzed_line(draw: st.DrawFn, endpoint: str) -> tuple[dict[str, Any], str]:
    """A line of ``endpoint`` with one field (of the line or of its body) replaced or added; and which."""
    line = completion_line("fuzzed", max_tokens=2) if endpoint == COMPLETIONS else chat_line("fuzzed", max_tokens=2)
    where = draw(st.sampled_from(["custom_id", "method", "url", "top-level key", "body key", "body field"]))
    if where == "custom_id":
        line["custom_id"] = draw(st.one_of(TEXT, TEXT, JSON))
    elif where in ("method", "url"):
        line[where] = draw(VALUE)
    elif where == "top-level key":
        line[draw(_SHORT)] = draw(VALUE)
    elif where == "body key":
        line["body"][draw(TEXT)] = draw(VALUE)
    else:
        *parents, last = draw(st.sampled_from(_body_paths(endpoint)))
        target: Any = line["body"]
        for part in parents:
            target = target[part]
        target[last] = draw(VALUE)
    return line, where


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from worker.model_prepare import prepare_model

    return AutoTokenizer.from_pretrained(prepare_model(BUILTIN_MODEL))


def _no_server_error(response: Any) -> Any:
    assert response.status_code < 500, (response.request.method, str(response.request.url)[:300], response.text[:500])
    return response


def _id_routes(app: Any) -> list[tuple[str, str]]:
    """(method, path template) of every route with one id in its path, found on the app itself."""

    def every(routes: list[Any]) -> Iterator[Any]:
        for route in routes:
            included = getattr(route, "original_router", None)
            yield from every(included.routes) if included is not None else [route]

    found = []
    for route in every(app.routes):
        params = re.findall(r"{(\w+)}", getattr(route, "path", ""))
        if len(params) == 1 and params[0] != "path":
            found.extend((method, route.path) for method in sorted(route.methods - {"HEAD"}))
    return found


# --- the fuzz tests ---------------------------------------------------------------------------


@on_postgres
def test_any_id_in_any_path_is_400_or_404(client: Any) -> None:
    routes = _id_routes(client.app)
    assert len(routes) >= 10, routes  # files x4, batches x2, schedules x2, models, 2 /ui pages

    @_fuzz("ids")
    @given(route=st.sampled_from(routes), value=URL_TEXT)
    def check(route: tuple[str, str], value: str) -> None:
        method, template = route
        path = re.sub(r"{\w+}", lambda _: url_part(value), template)
        response = _no_server_error(client.request(method, path))
        if "/" not in value and value.strip(".") and "\\" not in value:  # else it is another route's path
            assert response.status_code in (400, 404), (method, path[:200], response.status_code)

    check()


@on_postgres
def test_any_list_query_is_answered_without_a_server_error(client: Any) -> None:
    @_fuzz("queries")
    @given(
        path=st.sampled_from(
            ["/v1/files", "/v1/batches", "/v1/schedules", "/v1/evals", "/v1/workers", "/v1/models", "/ui"]
        ),
        params=st.fixed_dictionaries(
            {}, optional=dict.fromkeys(("after", "limit", "purpose", "order", "x\x00"), URL_TEXT)
        ),
    )
    def check(path: str, params: dict[str, str]) -> None:
        query = "&".join(f"{url_part(k)}={url_part(v)}" for k, v in params.items())
        _no_server_error(client.get(f"{path}?{query}"))

    check()


@on_postgres
@pytest.mark.parametrize("path", ["/v1/files", "/v1/batches", "/v1/schedules"])
def test_a_nul_or_lone_surrogate_in_any_list_parameter_is_no_server_error(client: Any, path: str) -> None:
    for name in ("after", "limit", "purpose", "order"):
        for value in ("\x00", "a\ud800", "\udfff" * 5000):
            response = _no_server_error(client.get(f"{path}?{name}={url_part(value)}"))
            if name == "after":
                assert response.status_code == 400 and response.json()["error"]["param"] == "after"
    assert _no_server_error(client.get("/v1/files?purpose=%00")).json()["data"] == []


@on_postgres
def test_any_json_body_is_answered_without_a_server_error(client: Any) -> None:
    good_file = client.post(
        "/v1/files", files={"file": ("in.jsonl", jsonl([chat_line("a")]))}, data={"purpose": "batch"}
    )
    good = {
        "input_file_id": good_file.json()["id"],
        "endpoint": CHAT,
        "completion_window": "24h",
        "metadata": {"k": "v"},
        "cron": "0 3 * * *",
    }
    fields = ["input_file_id", "endpoint", "completion_window", "metadata", "cron", "output_expires_after"]
    field_value = st.one_of(VALUE, VALUE, st.dictionaries(TEXT, TEXT, max_size=3))

    @_fuzz("json")
    @given(
        path=st.sampled_from(["/v1/batches", "/v1/schedules"]),
        fuzzed=st.dictionaries(st.sampled_from(fields), field_value, max_size=3),
        keep=st.sets(st.sampled_from(fields)),
        whole=st.one_of(st.none(), VALUE),
    )
    def check(path: str, fuzzed: dict[str, Any], keep: set[str], whole: Any) -> None:
        document: Any = whole if whole is not None else {k: v for k, v in good.items() if k in keep} | fuzzed
        if path == "/v1/batches" and isinstance(document, dict):
            document.pop("cron", None)
        content = to_json(document).encode("utf-8", "surrogatepass")
        _no_server_error(client.post(path, content=content, headers={"Content-Type": "application/json"}))

    check()


@on_postgres
def test_any_multipart_upload_is_answered_without_a_server_error(client: Any) -> None:
    form_text = st.one_of(TEXT, st.builds(to_json, VALUE))

    @_fuzz("multipart")
    @given(
        path=st.sampled_from(["/v1/files", "/v1/jobs"]),
        filename=TEXT,
        data=st.one_of(
            st.binary(max_size=2000), st.builds(lambda v: to_json(v).encode("utf-8", "surrogatepass"), VALUE)
        ),
        fields=st.dictionaries(st.sampled_from(["purpose", "endpoint", "metadata", "completion_window"]), form_text),
        valid=st.booleans(),
    )
    def check(path: str, filename: str, data: bytes, fields: dict[str, str], valid: bool) -> None:
        if valid:
            fields = {"purpose": "batch", "endpoint": CHAT} | fields
        body, content_type = multipart(fields, {"file": (filename, data)})
        _no_server_error(client.post(path, content=body, headers={"Content-Type": content_type}))

    check()


def test_any_line_validates_and_maps_or_is_that_lines_400(tokenizer: Any) -> None:
    """A line through the structure checks (`jobs.validation`), then the worker's parse/map path with the
    real tokenizer: every error is storable text; a body maps, or is an `InvalidRequest` whose 400 names
    a field when the body holds text that cannot be stored."""

    @_fuzz("bodies")
    @given(endpoint=st.sampled_from([CHAT, COMPLETIONS]), data=st.data())
    def check(endpoint: str, data: st.DataObject) -> None:
        line, _where = data.draw(fuzzed_line(endpoint))
        raw = [to_json(line).encode()]
        result = validate_batch_file(
            raw, endpoint=endpoint, model_names={BUILTIN_MODEL}, max_lines=9, max_bytes=1 << 26
        )
        assert first_unstorable([error.model_dump() for error in result.errors]) is None, result.errors
        if not result.ok:
            assert result.num_errors == 1 and result.errors[0].line == 1, result.errors
            return
        [validated] = validated_lines(raw, endpoint=endpoint, model_names={BUILTIN_MODEL})
        if validated.rejection is not None and validated.rejection.code == "model_not_found":
            # A model that is not served is that line's 400 (docs/api.md), never run.
            assert validated.body.get("model") != BUILTIN_MODEL and validated.rejection.param == "body.model"
            return
        assert (validated.rejection is None) == is_storable(validated.custom_id)
        try:
            mapped = map_request(endpoint, validated.body, tokenizer)
        except InvalidRequest as exc:
            # What the line's 400 stores is storable text itself: a bad key is named escaped.
            assert first_unstorable(rejected_response(1, exc.message, param=exc.param, code=exc.code)) is None
            if first_unstorable(validated.body) is not None:
                assert exc.param is not None, exc.message
            return
        assert first_unstorable(validated.body) is None
        assert mapped.prompt_token_ids or endpoint == COMPLETIONS

    check()


@on_postgres
def test_any_line_field_runs_to_a_result_file_and_its_neighbours_complete(client: Any, tokenizer: Any) -> None:
    """A fuzzed line between two good ones: uploaded, validated, run by the worker into the result files.
    Never a 5xx nor an ``internal_error``; a structural error fails the file with its line number;
    otherwise the two neighbours complete and the fuzzed line is in exactly one file under the
    custom_id it was sent with (a 400 naming a field when its text cannot be stored)."""
    engine = StandInEngine(tokenizer, max_model_len=4096, max_num_seqs=8)

    @_fuzz("lines")
    @given(endpoint=st.sampled_from([CHAT, COMPLETIONS]), data=st.data())
    def check(endpoint: str, data: st.DataObject) -> None:
        line, _where = data.draw(fuzzed_line(endpoint))
        make = completion_line if endpoint == COMPLETIONS else chat_line
        raw = "\n".join(
            [json.dumps(make("before", max_tokens=2)), to_json(line), json.dumps(make("after", max_tokens=2))]
        )
        body, content_type = multipart(
            {"endpoint": endpoint}, {"file": ("lines.jsonl", raw.encode("utf-8", "surrogatepass"))}
        )
        created = _no_server_error(client.post("/v1/jobs", content=body, headers={"Content-Type": content_type}))
        assert created.status_code == 200, created.text
        batch = _no_server_error(client.get(f"/v1/batches/{created.json()['id']}")).json()
        if batch["status"] == "failed":
            errors = batch["errors"]
            # the fuzzed line is 2; a custom_id equal to "after" makes line 3 the duplicate
            assert errors["total"] == len(errors["data"]) == 1 and errors["data"][0]["line"] in (2, 3), errors
            assert all(e["code"] != "internal_error" for e in errors["data"]), errors
            return
        assert batch["status"] == "in_progress", batch
        while runner.run_next_shard(engine=engine) is not None:
            pass
        batch = _no_server_error(client.get(f"/v1/batches/{batch['id']}")).json()
        assert batch["status"] == "completed", batch
        results = {}
        for file_id in (batch["output_file_id"], batch["error_file_id"]):
            if file_id is not None:
                content = _no_server_error(client.get(f"/v1/files/{file_id}/content")).content
                for text in content.decode("utf-8").split("\n")[:-1]:  # JSONL lines end at \n only
                    entry = json.loads(text)
                    assert entry["custom_id"] not in results
                    results[entry["custom_id"]] = entry
        sent = json.loads(to_json(line))
        assert set(results) == {"before", "after", sent["custom_id"]}
        for neighbour in ("before", "after"):
            assert results[neighbour]["response"]["status_code"] == 200, results[neighbour]
        fuzzed = results[sent["custom_id"]]["response"]
        if not is_storable(sent["custom_id"]):
            assert (fuzzed["status_code"], fuzzed["body"]["error"]["param"]) == (400, "custom_id"), fuzzed
        elif first_unstorable(sent["body"]) is not None:
            assert fuzzed["status_code"] == 400 and fuzzed["body"]["error"]["param"], fuzzed

    check()


@on_postgres
def test_a_nul_in_custom_id_is_that_lines_400_and_its_neighbours_complete(client: Any, tokenizer: Any) -> None:
    lines = [chat_line("first"), chat_line("bad\x00id"), chat_line("lone\ud800"), chat_line("last")]
    raw = "\n".join(json.dumps(line) for line in lines).encode()  # json.dumps writes \u0000 and \ud800
    created = client.post("/v1/jobs", files={"file": ("in.jsonl", raw)}, data={"endpoint": CHAT})
    assert created.status_code == 200, created.text
    batch_id = created.json()["id"]
    assert client.get(f"/v1/batches/{batch_id}").json()["status"] == "in_progress"
    while runner.run_next_shard(engine=StandInEngine(tokenizer)) is not None:
        pass

    batch = client.get(f"/v1/batches/{batch_id}").json()
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 4, "completed": 2, "failed": 2}
    output = client.get(f"/v1/files/{batch['output_file_id']}/content").content.decode().splitlines()
    assert sorted(json.loads(text)["custom_id"] for text in output) == ["first", "last"]
    error_text = client.get(f"/v1/files/{batch['error_file_id']}/content").content
    assert b'"bad\\u0000id"' in error_text and b'"lone\\ud800"' in error_text  # JSON-escaped as sent
    errors = {(e := json.loads(text))["custom_id"]: e for text in error_text.decode().splitlines()}
    assert set(errors) == {"bad\x00id", "lone\ud800"}
    for custom_id, line_number in (("bad\x00id", 2), ("lone\ud800", 3)):
        response = errors[custom_id]["response"]
        assert response["status_code"] == 400 and errors[custom_id]["error"] is None
        assert response["body"]["error"]["param"] == "custom_id"
        assert response["body"]["error"]["message"].startswith(f"line {line_number}: custom_id ")
    page = client.get(f"/ui/batches/{batch_id}")
    assert page.status_code == 200 and "bad\\u0000id" in page.text
