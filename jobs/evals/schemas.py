"""The Evals API's request bodies and objects, as the ``openai`` SDK sends and parses them.

Objects: ``eval``, ``eval.run``, ``eval.run.output_item`` (and their ``*.deleted``); ``*_at`` fields are
Unix seconds. Request bodies ignore fields this service does not use, as the batch bodies do.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jobs.models import Batch, Eval, EvalOutputItem, EvalRun
from jobs.schemas import ListedObject


class CustomDataSourceConfig(BaseModel):
    """``data_source_config`` as sent: ``{type: "custom", item_schema, include_sample_schema}``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["custom"]
    item_schema: dict[str, Any]
    include_sample_schema: bool = False


class EvalCreateRequest(BaseModel):
    """``POST /v1/evals``; ``testing_criteria`` is parsed by `jobs.evals.criteria`."""

    model_config = ConfigDict(extra="ignore")

    data_source_config: CustomDataSourceConfig
    testing_criteria: list[dict[str, Any]]
    name: str | None = None
    metadata: dict[str, str] | None = None


class EvalUpdateRequest(BaseModel):
    """``POST /v1/evals/{eval_id}``: a new name and/or metadata."""

    model_config = ConfigDict(extra="ignore")

    name: str | None = None
    metadata: dict[str, str] | None = None


class RunCreateRequest(BaseModel):
    """``POST /v1/evals/{eval_id}/runs``; ``data_source`` is parsed by `jobs.evals.data_sources`."""

    model_config = ConfigDict(extra="ignore")

    data_source: dict[str, Any]
    name: str | None = None
    metadata: dict[str, str] | None = None


class EvalObject(ListedObject):
    """An eval: ``data_source_config`` as returned is ``{type: "custom", schema}``, the JSON schema of
    the ``item`` (and, with ``include_sample_schema``, ``sample``) namespaces."""

    object: Literal["eval"] = "eval"
    name: str
    created_at: int
    metadata: dict[str, str] | None
    data_source_config: dict[str, Any]
    testing_criteria: list[dict[str, Any]]

    @classmethod
    def from_row(cls, row: Eval) -> EvalObject:
        config = row.data_source_config
        properties: dict[str, Any] = {"item": config["item_schema"]}
        required = ["item"]
        if config.get("include_sample_schema"):
            properties["sample"] = SAMPLE_SCHEMA
            required.append("sample")
        schema = {"type": "object", "properties": properties, "required": required}
        return cls(
            id=row.id,
            name=row.name,
            created_at=row.created_at,
            metadata=row.metadata_,
            data_source_config={"type": "custom", "schema": schema},
            testing_criteria=row.testing_criteria,
        )


SAMPLE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "model": {"type": "string"},
        "choices": {"type": "array"},
        "output_text": {"type": "string"},
        "usage": {"type": "object"},
    },
    "required": ["model", "choices"],
}
"""The ``sample`` namespace graders see (the Evals API's sample schema)."""


class EvalDeleted(BaseModel):
    object: Literal["eval.deleted"] = "eval.deleted"
    deleted: bool = True
    eval_id: str


class ResultCounts(BaseModel):
    total: int
    passed: int
    failed: int
    errored: int


class PerModelUsage(BaseModel):
    model_name: str
    invocation_count: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    total_tokens: int


class RunObject(ListedObject):
    """An eval run. ``report_url`` is its ``/ui`` page (``/ui/evals/{eval_id}/runs/{run_id}``: counts,
    per-criterion results, failing items); ``error`` is ``{code, message}`` or null."""

    object: Literal["eval.run"] = "eval.run"
    eval_id: str
    name: str
    model: str
    status: str
    created_at: int
    metadata: dict[str, str] | None
    data_source: dict[str, Any]
    error: dict[str, Any] | None
    result_counts: ResultCounts
    per_testing_criteria_results: list[dict[str, Any]]
    per_model_usage: list[PerModelUsage]
    report_url: str

    @classmethod
    def from_row(cls, row: EvalRun, *, batch: Batch | None, base_url: str = "") -> RunObject:
        usage = []
        if batch is not None and batch.model is not None:
            usage.append(
                PerModelUsage(
                    model_name=batch.model,
                    invocation_count=batch.completed_requests + batch.failed_requests,
                    prompt_tokens=batch.input_tokens,
                    completion_tokens=batch.output_tokens,
                    cached_tokens=batch.cached_tokens,
                    total_tokens=batch.input_tokens + batch.output_tokens,
                )
            )
        return cls(
            id=row.id,
            eval_id=row.eval_id,
            name=row.name,
            model=row.model,
            status=row.status,
            created_at=row.created_at,
            metadata=row.metadata_,
            data_source=row.data_source,
            error=row.error,
            result_counts=ResultCounts(
                total=row.num_total, passed=row.num_passed, failed=row.num_failed, errored=row.num_errored
            ),
            per_testing_criteria_results=row.per_testing_criteria_results,
            per_model_usage=usage,
            report_url=f"{base_url.rstrip('/')}/ui/evals/{row.eval_id}/runs/{row.id}",
        )


class RunDeleted(BaseModel):
    object: Literal["eval.run.deleted"] = "eval.run.deleted"
    deleted: bool = True
    run_id: str


class OutputItemObject(ListedObject):
    """One item of a run: ``status`` is ``pass``, ``fail`` or ``error`` once graded (``pending`` before);
    ``results`` one entry per testing criterion, ``sample`` the model's answer (null before it). An item refused
    before generation (it breaks ``item_schema``, a template fails on it) has a sample holding only its
    ``error`` (``{code, message}``), as the Evals API reports a sample's error."""

    object: Literal["eval.run.output_item"] = "eval.run.output_item"
    eval_id: str
    run_id: str
    created_at: int
    status: str
    datasource_item_id: int
    datasource_item: dict[str, Any]
    results: list[dict[str, Any]] = Field(default_factory=list)
    sample: dict[str, Any] | None

    @classmethod
    def from_row(cls, row: EvalOutputItem) -> OutputItemObject:
        return cls(
            id=row.id,
            eval_id=row.eval_id,
            run_id=row.run_id,
            created_at=row.created_at,
            status=row.status,
            datasource_item_id=row.datasource_item_id,
            datasource_item=row.datasource_item,
            results=row.results or [],
            sample=row.sample if row.sample is not None or row.error is None else _error_sample(row.error),
        )


def _error_sample(error: dict[str, Any]) -> dict[str, Any]:
    """The sample of an item that never reached the model: its ``error`` and nothing generated."""
    return {
        "error": error,
        "input": [],
        "output": [],
        "finish_reason": "",
        "model": "",
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0, "cached_tokens": 0},
        "max_completion_tokens": 0,
        "seed": 0,
        "temperature": 0.0,
        "top_p": 0.0,
    }
