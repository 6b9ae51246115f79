"""Keyword-only data functions over evals, their runs and output items; the caller owns the transaction.

| function | who calls it | what it does |
|---|---|---|
| ``create_eval`` / ``get_eval`` / ``list_evals`` / ``update_eval`` / ``delete_eval`` | API | the ``eval`` objects |
| ``create_run`` | API (schedules later) | items checked, one batch line per valid item, the run ``queued`` |
| ``get_run`` / ``list_runs`` / ``cancel_run`` / ``delete_run`` | API, CLI | the ``eval.run`` objects; cancel cancels the batch |
| ``list_output_items`` / ``get_output_item`` | API | the ``eval.run.output_item`` objects |
| ``run_of_batch`` / ``units_to_grade`` / ``items_to_grade`` | grading (`jobs.evals.dispatch`, worker) | what to grade |
| ``record_grades`` / ``settle_run`` / ``mark_run_started`` | grading, `jobs.evals.dispatch` | storing grades, run status |
| ``criterion_pass_rates`` | UI, metrics (trends) | each criterion's pass rate in a run |

A run's items are `EvalOutputItem` rows made at create: ``pending`` with ``custom_id`` = the item's index
for an item that became a batch line (or that has its own ``sample``, ``custom_id`` None), ``error``
at once for an item that breaks ``item_schema`` or its templates (a per-item error, never a failed run).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import jsonschema
from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from jobs.errors import Conflict, InvalidRequest, NotFound
from jobs.evals.criteria import (
    EMBEDDING_METRICS,
    CriteriaError,
    LabelModelCriterion,
    ScoreModelCriterion,
    TestingCriterion,
    TextSimilarityCriterion,
    parse_testing_criteria,
)
from jobs.evals.data_sources import check_template_fields, line_body, load_rows, parse_data_source
from jobs.evals.templates import TemplateError
from jobs.files import write_file
from jobs.models import (
    EVAL_ID_PREFIX,
    EVAL_OUTPUT_ITEM_ID_PREFIX,
    EVAL_RUN_ID_PREFIX,
    Batch,
    BatchRequest,
    Eval,
    EvalOutputItem,
    EvalRun,
    RequestState,
    Schedule,
    new_id,
)
from jobs.paging import UnknownCursor, keyset_page
from jobs.repository import INPUT_PURPOSE, cancel_batch, check_batch_params, create_batch, get_batch
from jobs.schemas import CHAT_COMPLETIONS, COMPLETION_WINDOW
from jobs.status import BatchStatus, IllegalTransition, now_s
from jobs.storable_text import is_possible_id
from jobs.storage import FileStorage

RUN_STATUSES = ("queued", "in_progress", "completed", "canceled", "failed")
TERMINAL_RUN_STATUSES = frozenset({"completed", "canceled", "failed"})
PENDING, PASS, FAIL, ERROR = "pending", "pass", "fail", "error"
EVAL_RUN_ID_METADATA_KEY = "eval_run_id"
MAX_NAME_CHARS = 512
RUN_CANCELED_ERROR = {"code": "run_canceled", "message": "the run was canceled before this item was graded"}


def _check_metadata(metadata: dict[str, str] | None) -> None:
    """The batch API's metadata rules (16 pairs, 64/512 characters, storable text)."""
    check_batch_params(endpoint=CHAT_COMPLETIONS, completion_window=COMPLETION_WINDOW, metadata=metadata)


def _check_name(name: str | None) -> None:
    if name is not None and len(name) > MAX_NAME_CHARS:
        raise InvalidRequest(f"name is over {MAX_NAME_CHARS} characters", param="name")


def _template_texts(value: Any, path: str) -> list[tuple[str, str]]:
    """Every string of a criterion that holds a template, with its ``param`` path (a python grader's
    ``source`` is code, not a template)."""
    if isinstance(value, str):
        return [(path, value)] if "{{" in value or "{%" in value else []
    if isinstance(value, dict):
        return [
            pair for key, item in value.items() if key != "source" for pair in _template_texts(item, f"{path}.{key}")
        ]
    if isinstance(value, list):
        return [pair for index, item in enumerate(value) for pair in _template_texts(item, f"{path}[{index}]")]
    return []


def _check_grader_model(model: str, index: int, model_aliases: Mapping[str, str]) -> None:
    """Refuse a model grader's ``model`` that is not a served generate model (name or alias)."""
    if model not in model_aliases:
        raise InvalidRequest(
            f"testing_criteria[{index}].model {model!r} is not served here; "
            f"use one of {', '.join(sorted(set(model_aliases.values())))}",
            param=f"testing_criteria[{index}].model",
            code="model_not_found",
        )


def _check_distinct_names(criteria: list[TestingCriterion]) -> None:
    """Refuse a criterion ``name`` used twice: results (``per_testing_criteria_results``) are keyed by it."""
    first_index: dict[str, int] = {}
    for index, criterion in enumerate(criteria):
        if criterion.name in first_index:
            raise InvalidRequest(
                f"testing_criteria[{index}].name: {criterion.name!r} is already the name of "
                f"testing_criteria[{first_index[criterion.name]}]; criterion names must be distinct",
                param=f"testing_criteria[{index}].name",
            )
        first_index[criterion.name] = index


def create_eval(
    session: Session,
    *,
    item_schema: dict[str, Any],
    include_sample_schema: bool,
    testing_criteria: list[dict[str, Any]],
    name: str | None = None,
    metadata: dict[str, str] | None = None,
    owner: str | None = None,
    model_aliases: Mapping[str, str],
    now: int | None = None,
    has_embedding_model: bool = True,
) -> Eval:
    """Insert an eval (flushed, not committed).

    ``model_aliases`` maps every name a model grader's ``model`` may give (the deployment's generate models
    and their aliases, `jobs.config.Settings.generate_model_aliases`) to its model's name.
    ``has_embedding_model``: the deployment lists an ``embed`` model, which ``cosine`` text similarity needs.

    Raises:
        InvalidRequest: ``item_schema`` is not a valid JSON schema (``param="data_source_config.item_schema"``),
            a testing criterion is refused (`jobs.evals.criteria.CriteriaError`; ``param`` is
            ``testing_criteria[i].<field>``), a criterion's template names an item field the schema
            does not list, a model grader's ``model`` is not served (``testing_criteria[i].model``), no
            criterion (``testing_criteria``), a criterion ``name`` used twice (``testing_criteria[j].name``,
            the later one), or bad ``name``/``metadata``.
    """
    try:
        jsonschema.validators.validator_for(item_schema).check_schema(item_schema)
    except jsonschema.SchemaError as exc:
        raise InvalidRequest(
            f"data_source_config.item_schema is not a valid JSON schema: {exc.message}",
            param="data_source_config.item_schema",
        ) from None
    try:
        criteria = parse_testing_criteria(testing_criteria)
    except CriteriaError as exc:
        message = str(exc)
        raise InvalidRequest(message, param=message.split(":", 1)[0]) from None
    if not criteria:
        raise InvalidRequest("testing_criteria: must list at least one grader", param="testing_criteria")
    _check_distinct_names(criteria)
    for index, parsed in enumerate(criteria):
        if isinstance(parsed, ScoreModelCriterion | LabelModelCriterion):
            _check_grader_model(parsed.model, index, model_aliases)
        if not isinstance(parsed, TextSimilarityCriterion):
            continue
        metric = parsed.evaluation_metric
        if metric in EMBEDDING_METRICS and not has_embedding_model:
            raise InvalidRequest(
                f"testing_criteria[{index}].evaluation_metric: {metric!r} needs an embedding model (kind embed) in "
                "the deployment's model list (BATCHINFER_MODELS), and none is listed",
                param=f"testing_criteria[{index}].evaluation_metric",
            )
    dumped = [criterion.model_dump(mode="json") for criterion in criteria]
    for index, criterion in enumerate(dumped):
        for param, text in _template_texts(criterion, f"testing_criteria[{index}]"):
            check_template_fields(text, item_schema, param=param)
    _check_name(name)
    _check_metadata(metadata)
    row = Eval(
        id=new_id(EVAL_ID_PREFIX),
        name=name or "",
        metadata_=metadata,
        data_source_config={
            "type": "custom",
            "item_schema": item_schema,
            "include_sample_schema": include_sample_schema,
        },
        testing_criteria=dumped,
        created_at=now_s() if now is None else now,
        owner_key_id=owner,
    )
    session.add(row)
    session.flush()
    return row


def get_eval(session: Session, *, eval_id: str, owner: str | None = None) -> Eval:
    """The eval.

    Raises:
        NotFound: no eval has this id (owned by API key ``owner``, when given).
    """
    if not is_possible_id(eval_id):
        raise NotFound("eval", eval_id)
    query = select(Eval).where(Eval.id == eval_id).execution_options(populate_existing=True)
    if owner is not None:
        query = query.where(Eval.owner_key_id == owner)
    row = session.scalar(query)
    if row is None:
        raise NotFound("eval", eval_id)
    return row


def list_evals(
    session: Session, *, after: str | None = None, limit: int = 20, order: str = "asc", owner: str | None = None
) -> tuple[list[Eval], bool]:
    """A page of evals (of ``owner``, when given) by creation time; returns ``(evals, has_more)``.

    Raises:
        jobs.paging.UnknownCursor: ``after`` is not an eval id (of ``owner``).
    """
    query = select(Eval) if owner is None else select(Eval).where(Eval.owner_key_id == owner)
    return keyset_page(session, query, Eval, after=after, limit=limit, descending=order == "desc", owner=owner)


def update_eval(
    session: Session,
    *,
    eval_id: str,
    name: str | None = None,
    metadata: dict[str, str] | None = None,
    owner: str | None = None,
) -> Eval:
    """Rename the eval and/or replace its metadata (None: unchanged).

    Raises:
        NotFound: no such eval (of ``owner``). InvalidRequest: bad ``name`` or ``metadata``.
    """
    row = get_eval(session, eval_id=eval_id, owner=owner)
    _check_name(name)
    _check_metadata(metadata)
    if name is not None:
        row.name = name
    if metadata is not None:
        row.metadata_ = metadata
    session.flush()
    return row


def delete_eval(session: Session, *, eval_id: str, owner: str | None = None) -> None:
    """Delete the eval with its runs and their items, and the schedules that create its runs; runs still
    generating have their batch cancelled.

    Raises:
        NotFound: no such eval (of ``owner``).
    """
    row = get_eval(session, eval_id=eval_id, owner=owner)
    for run_id in session.scalars(select(EvalRun.id).where(EvalRun.eval_id == eval_id)):
        delete_run(session, eval_id=eval_id, run_id=run_id)
    session.execute(delete(Schedule).where(Schedule.eval_id == eval_id))
    session.delete(row)
    session.flush()


def create_run(
    session: Session,
    *,
    eval_id: str,
    data_source: dict[str, Any],
    served_model: str,
    storage: FileStorage,
    max_items: int,
    aliases: Mapping[str, str] | None = None,
    name: str | None = None,
    metadata: dict[str, str] | None = None,
    owner: str | None = None,
    now: int | None = None,
) -> EvalRun:
    """Insert a ``queued`` run, its items and, when it generates, its batch (``validating``; start it
    with `jobs.evals.dispatch.start_run` after the commit); ``served_model`` and ``aliases`` as
    `jobs.evals.data_sources.parse_data_source` takes them. Each item is checked against the eval's
    ``item_schema`` and rendered into its line; an item that fails either is an ``error`` output item.

    Raises:
        NotFound: no such eval (of ``owner``).
        InvalidRequest: a data source `jobs.evals.data_sources.parse_data_source` or ``load_rows``
            refuses, or bad ``name``/``metadata``.
    """
    now = now_s() if now is None else now
    row = get_eval(session, eval_id=eval_id, owner=owner)
    item_schema = row.data_source_config["item_schema"]
    parsed = parse_data_source(data_source, item_schema=item_schema, served_model=served_model, aliases=aliases)
    _check_name(name)
    _check_metadata(metadata)
    rows = load_rows(parsed, session=session, storage=storage, owner=owner, max_items=max_items)
    validator = jsonschema.validators.validator_for(item_schema)(item_schema)
    run_id = new_id(EVAL_RUN_ID_PREFIX)
    items: list[dict[str, Any]] = []
    lines: list[bytes] = []
    for index, source_row in enumerate(rows):
        item: dict[str, Any] = {
            "id": new_id(EVAL_OUTPUT_ITEM_ID_PREFIX),
            "run_id": run_id,
            "eval_id": eval_id,
            "datasource_item_id": index,
            "datasource_item": source_row.item,
            "given_sample": source_row.sample,
            "custom_id": None,
            "status": PENDING,
            "results": None,
            "sample": None,
            "error": None,
            "created_at": now,
        }
        items.append(item)
        problems = [
            f"{'/'.join(str(part) for part in problem.absolute_path) or 'item'}: {problem.message}"
            for problem in validator.iter_errors(source_row.item)
        ]
        if problems:
            message = f"the item does not match the eval's item_schema: {'; '.join(sorted(problems))}"
            item["status"], item["error"] = ERROR, {"code": "invalid_item", "message": message}
            continue
        if parsed.endpoint is None:
            if source_row.sample is None:
                message = "a jsonl data source grades the sample given with each item, and this item has none"
                item["status"], item["error"] = ERROR, {"code": "missing_sample", "message": message}
            continue
        try:
            body = line_body(parsed, source_row.item)
        except TemplateError as exc:
            item["status"], item["error"] = ERROR, {"code": "invalid_template", "message": str(exc)}
            continue
        item["custom_id"] = str(index)
        line = {"custom_id": str(index), "method": "POST", "url": parsed.endpoint, "body": body}
        lines.append(json.dumps(line, ensure_ascii=False).encode() + b"\n")
    batch_id = None
    if lines:
        file = write_file(
            session,
            chunks=lines,
            filename=f"{run_id}_input.jsonl",
            purpose=INPUT_PURPOSE,
            storage=storage,
            owner=owner,
            now=now,
        )
        assert parsed.endpoint is not None
        batch = create_batch(
            session,
            input_file_id=file.id,
            endpoint=parsed.endpoint,
            metadata={EVAL_RUN_ID_METADATA_KEY: run_id, "eval_id": eval_id},
            owner=owner,
            now=now,
        )
        batch_id = batch.id
    errored = sum(item["status"] == ERROR for item in items)
    run = EvalRun(
        id=run_id,
        eval_id=eval_id,
        name=name or f"run of {row.name or eval_id}",
        model=parsed.model,
        status="queued",
        metadata_=metadata,
        data_source=parsed.as_api(),
        batch_id=batch_id,
        error=None,
        num_total=len(items),
        num_passed=0,
        num_failed=0,
        num_errored=errored,
        per_testing_criteria_results=[
            {"testing_criteria": criterion["name"], "passed": 0, "failed": 0} for criterion in row.testing_criteria
        ],
        created_at=now,
        completed_at=None,
        owner_key_id=owner,
    )
    session.add(run)
    session.flush()
    session.bulk_insert_mappings(EvalOutputItem.__mapper__, items)
    session.flush()
    return run


def get_run(
    session: Session, *, eval_id: str, run_id: str, owner: str | None = None, for_update: bool = False
) -> EvalRun:
    """The run of eval ``eval_id`` (``for_update`` locks its row on PostgreSQL).

    Raises:
        NotFound: no such run of that eval (of ``owner``).
    """
    if not is_possible_id(run_id) or not is_possible_id(eval_id):
        raise NotFound("eval run", run_id)
    query = (
        select(EvalRun)
        .where(EvalRun.id == run_id, EvalRun.eval_id == eval_id)
        .execution_options(populate_existing=True)
    )
    if owner is not None:
        query = query.where(EvalRun.owner_key_id == owner)
    run = session.scalar(query.with_for_update() if for_update else query)
    if run is None:
        raise NotFound("eval run", run_id)
    return run


def run_batch(session: Session, run: EvalRun) -> Batch | None:
    """The run's batch (None when it generates nothing)."""
    return None if run.batch_id is None else get_batch(session, batch_id=run.batch_id)


def list_runs(
    session: Session,
    *,
    eval_id: str,
    after: str | None = None,
    limit: int = 20,
    order: str = "asc",
    status: str | None = None,
    owner: str | None = None,
) -> tuple[list[EvalRun], bool]:
    """A page of the eval's runs by creation time (only those in ``status``, when given).

    Raises:
        NotFound: no such eval (of ``owner``). jobs.paging.UnknownCursor: ``after`` is not a run id.
    """
    get_eval(session, eval_id=eval_id, owner=owner)
    query = select(EvalRun).where(EvalRun.eval_id == eval_id)
    if status is not None:
        query = query.where(EvalRun.status == status)
    return keyset_page(session, query, EvalRun, after=after, limit=limit, descending=order == "desc", owner=owner)


def cancel_run(
    session: Session, *, eval_id: str, run_id: str, owner: str | None = None, storage: FileStorage | None = None
) -> EvalRun:
    """Cancel the run: ``queued | in_progress -> canceled``, final at once. Its batch is cancelled
    (`jobs.repository.cancel_batch`); items graded so far keep their grades, every item still pending
    becomes an ``error`` (``run_canceled``), so ``result_counts`` add up to ``total`` and never change
    afterwards (a grading task that was under way stores nothing: `record_grades` keeps only pending
    items). A canceled run: no-op.

    Raises:
        NotFound: no such run. Conflict: the run is completed or failed (``code="invalid_status"``).
    """
    run = get_run(session, eval_id=eval_id, run_id=run_id, owner=owner, for_update=True)
    if run.status == "canceled":
        return run
    if run.status in TERMINAL_RUN_STATUSES:
        raise Conflict(
            f"eval run {run_id!r} is {run.status}; only a queued or in-progress run can be canceled",
            code="invalid_status",
        )
    if run.batch_id is not None:
        # The batch may have ended meanwhile: grading then finishes what it produced.
        with suppress(IllegalTransition):
            cancel_batch(session, batch_id=run.batch_id, storage=storage)
    run.num_errored += _error_pending_items(session, run_id=run_id, error=RUN_CANCELED_ERROR)
    run.status = "canceled"
    run.completed_at = now_s()
    session.flush()
    return run


def _error_pending_items(session: Session, *, run_id: str, error: dict[str, Any]) -> int:
    """Make every ``pending`` item of the run an ``error`` item with ``error``; returns how many."""
    moved = session.execute(
        update(EvalOutputItem)
        .where(EvalOutputItem.run_id == run_id, EvalOutputItem.status == PENDING)
        .values(status=ERROR, error=error)
        .execution_options(synchronize_session=False)
    )
    return int(getattr(moved, "rowcount", 0))


def delete_run(session: Session, *, eval_id: str, run_id: str, owner: str | None = None) -> None:
    """Delete the run and its items (its batch, cancelled if still running, is kept as a batch).

    Raises:
        NotFound: no such run.
    """
    run = get_run(session, eval_id=eval_id, run_id=run_id, owner=owner, for_update=True)
    if run.batch_id is not None and not BatchStatus(get_batch(session, batch_id=run.batch_id).status).is_terminal:
        with suppress(IllegalTransition):  # finalizing: nothing left to stop
            cancel_batch(session, batch_id=run.batch_id)
    session.execute(delete(EvalOutputItem).where(EvalOutputItem.run_id == run_id))
    session.delete(run)
    session.flush()


def list_output_items(
    session: Session,
    *,
    eval_id: str,
    run_id: str,
    after: str | None = None,
    limit: int = 20,
    order: str = "asc",
    status: str | None = None,
    owner: str | None = None,
) -> tuple[list[EvalOutputItem], bool]:
    """A page of the run's output items (only ``pass`` or ``fail`` ones, when ``status`` is given).

    Raises:
        NotFound: no such run. jobs.paging.UnknownCursor: ``after`` is not an item of the run.
    """
    get_run(session, eval_id=eval_id, run_id=run_id, owner=owner)
    query = select(EvalOutputItem).where(EvalOutputItem.run_id == run_id)
    if status is not None:
        query = query.where(EvalOutputItem.status == status)
    index = EvalOutputItem.datasource_item_id
    if after is not None:
        cursor = session.get(EvalOutputItem, after) if is_possible_id(after) else None
        if cursor is None or cursor.run_id != run_id:
            raise UnknownCursor(f"no output item with id {after!r} in run {run_id!r} to page after")
        query = query.where(index < cursor.datasource_item_id if order == "desc" else index > cursor.datasource_item_id)
    rows = list(session.scalars(query.order_by(index.desc() if order == "desc" else index).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def get_output_item(
    session: Session, *, eval_id: str, run_id: str, output_item_id: str, owner: str | None = None
) -> EvalOutputItem:
    """One output item of the run.

    Raises:
        NotFound: no such run, or no such item in it.
    """
    get_run(session, eval_id=eval_id, run_id=run_id, owner=owner)
    item = None
    if is_possible_id(output_item_id):
        item = session.scalar(
            select(EvalOutputItem).where(EvalOutputItem.id == output_item_id, EvalOutputItem.run_id == run_id)
        )
    if item is None:
        raise NotFound("eval run output item", output_item_id)
    return item


# Grading ------------------------------------------------------------------------------------------


@dataclass(slots=True)
class ItemToGrade:
    """One pending item and what its line produced (``line_state`` None: the item has its own sample)."""

    item_id: str
    item: Any
    given_sample: dict[str, Any] | None
    request_body: dict[str, Any] | None
    line_state: str | None
    response: dict[str, Any] | None
    line_error: dict[str, Any] | None


@dataclass(slots=True)
class Grade:
    """An item's grading outcome: ``status`` ``pass``/``fail``/``error``, the API's ``results`` and
    ``sample``, and ``criteria_passed`` (per criterion, in the eval's order: True, False or None when the
    criterion errored)."""

    item_id: str
    status: str
    results: list[dict[str, Any]]
    sample: dict[str, Any] | None
    error: dict[str, Any] | None
    criteria_passed: list[bool | None]


def run_of_batch(session: Session, *, batch_id: str) -> EvalRun | None:
    """The run whose batch is ``batch_id`` (None: a plain batch)."""
    return session.scalar(select(EvalRun).where(EvalRun.batch_id == batch_id))


def units_to_grade(session: Session, *, run_id: str) -> list[str | None]:
    """The grading units with pending items whose lines have a result: shard ids, and None for the
    items that carry their own sample (no line)."""
    run = session.get(EvalRun, run_id)
    if run is None:
        return []
    units: list[str | None] = []
    if run.batch_id is not None:
        query = (
            select(BatchRequest.shard_id)
            .join(EvalOutputItem, EvalOutputItem.custom_id == BatchRequest.custom_id)
            .where(
                EvalOutputItem.run_id == run_id,
                EvalOutputItem.status == PENDING,
                BatchRequest.batch_id == run.batch_id,
                BatchRequest.state != RequestState.PENDING.value,
            )
            .distinct()
        )
        units.extend(sorted(shard_id for shard_id in session.scalars(query) if shard_id is not None))
    own_samples = select(EvalOutputItem.id).where(
        EvalOutputItem.run_id == run_id, EvalOutputItem.status == PENDING, EvalOutputItem.custom_id.is_(None)
    )
    if session.scalar(own_samples.limit(1)) is not None:
        units.append(None)
    return units


def items_to_grade(session: Session, *, run_id: str, shard_id: str | None) -> list[ItemToGrade]:
    """The run's pending items of shard ``shard_id`` whose lines have a result (``None``: the items
    with their own sample), in item order."""
    run = session.get(EvalRun, run_id)
    if run is None:
        return []
    if shard_id is None:
        query = select(EvalOutputItem).where(
            EvalOutputItem.run_id == run_id, EvalOutputItem.status == PENDING, EvalOutputItem.custom_id.is_(None)
        )
        return [
            ItemToGrade(row.id, row.datasource_item, row.given_sample, None, None, None, None)
            for row in session.scalars(query.order_by(EvalOutputItem.datasource_item_id))
        ]
    joined = (
        select(EvalOutputItem, BatchRequest)
        .join(BatchRequest, BatchRequest.custom_id == EvalOutputItem.custom_id)
        .where(
            EvalOutputItem.run_id == run_id,
            EvalOutputItem.status == PENDING,
            BatchRequest.batch_id == run.batch_id,
            BatchRequest.shard_id == shard_id,
            BatchRequest.state != RequestState.PENDING.value,
        )
        .order_by(EvalOutputItem.datasource_item_id)
    )
    return [
        ItemToGrade(item.id, item.datasource_item, item.given_sample, line.body, line.state, line.response, line.error)
        for item, line in session.execute(joined)
    ]


def record_grades(session: Session, *, run_id: str, grades: list[Grade]) -> int:
    """Store grades of items still pending (an item graded twice keeps its first grade) and add them to
    the run's ``result_counts`` and ``per_testing_criteria_results``; returns how many were stored.

    Locks the run row first (PostgreSQL), so concurrent grading tasks add up exactly.
    """
    run = session.scalar(select(EvalRun).where(EvalRun.id == run_id).with_for_update())
    if run is None:
        return 0
    per_criterion = [dict(entry) for entry in run.per_testing_criteria_results]
    if run.status == "queued":  # started by a process that did not record it (e.g. an API restart)
        run.status = "in_progress"
    stored = 0
    for grade in grades:
        moved = session.execute(
            update(EvalOutputItem)
            .where(EvalOutputItem.id == grade.item_id, EvalOutputItem.status == PENDING)
            .values(status=grade.status, results=grade.results, sample=grade.sample, error=grade.error)
            .execution_options(synchronize_session=False)
        )
        if not getattr(moved, "rowcount", 0):
            continue
        stored += 1
        if grade.status == PASS:
            run.num_passed += 1
        elif grade.status == FAIL:
            run.num_failed += 1
        else:
            run.num_errored += 1
        for entry, passed in zip(per_criterion, grade.criteria_passed, strict=False):
            if passed is not None:
                entry["passed" if passed else "failed"] += 1
    run.per_testing_criteria_results = per_criterion
    session.flush()
    return stored


def settle_run(session: Session, *, run_id: str, now: int | None = None) -> str | None:
    """End the run once its batch (if any) is terminal and no item is pending; returns its status
    (None: no such run). ``completed`` after a completed batch (or none), ``canceled`` after a
    cancelled one, ``failed`` after a failed or expired one (``error`` says why)."""
    run = session.scalar(select(EvalRun).where(EvalRun.id == run_id).with_for_update())
    if run is None:
        return None
    if run.completed_at is not None:
        return run.status
    batch_status = None
    if run.batch_id is not None:
        batch_status = BatchStatus(get_batch(session, batch_id=run.batch_id).status)
        if not batch_status.is_terminal:
            return run.status
    pending = session.scalar(
        select(func.count()).where(EvalOutputItem.run_id == run_id, EvalOutputItem.status == PENDING)
    )
    if pending:
        return run.status
    if batch_status == BatchStatus.CANCELLED:
        run.status = "canceled"
    elif batch_status in (BatchStatus.FAILED, BatchStatus.EXPIRED):
        run.status = "failed"
        run.error = run.error or {
            "code": f"batch_{batch_status.value}",
            "message": f"the run's batch {batch_status.value}",
        }
    elif run.status != "canceled":
        run.status = "completed"
    run.completed_at = now_s() if now is None else now
    session.flush()
    return run.status


def mark_run_started(session: Session, *, run_id: str, batch_status: BatchStatus | None, errors: Any = None) -> None:
    """After the batch's validation: ``queued -> in_progress``, or ``failed`` with the batch's first
    error when its input was refused (items left pending become errors)."""
    run = session.scalar(select(EvalRun).where(EvalRun.id == run_id).with_for_update())
    if run is None or run.status != "queued":
        return
    if batch_status != BatchStatus.FAILED:
        run.status = "in_progress"
        return
    first = (errors or [{}])[0]
    run.error = {
        "code": first.get("code") or "invalid_data_source",
        "message": first.get("message") or "the run's batch failed",
    }
    run.num_errored += _error_pending_items(session, run_id=run_id, error=run.error)
    run.status = "failed"
    run.completed_at = now_s()
    session.flush()


def criterion_pass_rates(run: EvalRun) -> dict[str, float | None]:
    """Each criterion's pass rate in the run (passed / graded; None when none was graded), for trends."""
    return {
        entry["testing_criteria"]: (
            entry["passed"] / (entry["passed"] + entry["failed"]) if entry["passed"] + entry["failed"] else None
        )
        for entry in run.per_testing_criteria_results
    }
