"""The xgrammar backend: constraints to grammars, grammars compiled against the vocabulary, one matcher per sequence.

xgrammar (Dong et al. 2024, "XGrammar: Flexible and Efficient Structured Generation Engine for Large Language
Models") compiles a JSON Schema, regex or EBNF grammar into a pushdown automaton whose context-independent
tokens are precomputed per state, so a matcher fills a step's token bitmask (one bit per vocabulary token,
int32 words) in microseconds; vLLM V1 uses it the same way (``vllm/v1/structured_output/backend_xgrammar.py``).

This module knows xgrammar's API; the rest of the engine sees :class:`GrammarSpec` (a constraint in canonical
form, the compile cache's key), :class:`XgrammarBackend` (compiles) and :class:`StructuredOutputGrammar` (a
sequence's matcher).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
import xgrammar as xgr
from jsonschema import SchemaError
from jsonschema.validators import validator_for
from transformers import PreTrainedTokenizerBase

from worker.engine.errors import InvalidParameterError
from worker.engine.sampling_params import StructuredOutputsParams

PARAM = "structured_outputs"
GrammarKind = Literal["json", "regex", "grammar"]

# JSON Schema keywords that constrain a value but that xgrammar does not enforce (measured on 0.2.9: the
# compiled grammar is the same with and without them, or it accepts a value that breaks them: `not`,
# `contains`, `oneOf`, which it treats as `anyOf`), so an output could break the schema. Refused.
UNSUPPORTED_JSON_KEYWORDS = frozenset(
    {
        "uniqueItems",
        "if",
        "then",
        "else",
        "dependentSchemas",
        "dependentRequired",
        "dependencies",
        "unevaluatedItems",
        "unevaluatedProperties",
        "propertyNames",
        "not",
        "contains",
        "minContains",
        "maxContains",
        "oneOf",
    }
)
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
_MAX_ERROR_CHARS = 300  # of a library's message quoted in a 400


@dataclass(slots=True, frozen=True)
class GrammarSpec:
    """A constraint in canonical form: ``kind`` and ``text`` (the compile cache's key).

    ``json``: the schema re-serialized without spaces, keys kept in their order, which orders the output's
    properties (``json_object`` is the schema ``{"type": "object"}``); ``regex``: the pattern; ``grammar``: the
    EBNF/GBNF text, root rule ``root`` (``choice`` becomes the grammar ``root ::= "a" | "b" ...`` with
    JSON-escaped literals). ``what`` names the constraint in error messages (not part of the key).
    """

    kind: GrammarKind
    text: str
    what: str = field(default="", compare=False)


def canonical_spec(params: StructuredOutputsParams) -> GrammarSpec:
    """Canonicalize ``params``, checking what is quick: the schema is JSON, valid against its metaschema
    (``jsonschema``), and uses no keyword xgrammar cannot enforce. Syntax is checked by parsing
    (:func:`check_syntax`) or compiling, which a pathological constraint can make slow.

    Raises:
        InvalidParameterError: (``param="structured_outputs"``) a schema that is not JSON or not a valid JSON
            Schema, or uses an unsupported keyword.
    """
    if params.json is not None or params.json_object:
        schema = _load_schema(params.json) if params.json is not None else {"type": "object"}
        _check_schema(schema)
        return GrammarSpec("json", json.dumps(schema, separators=(",", ":"), ensure_ascii=False), "JSON schema")
    if params.regex is not None:
        return GrammarSpec("regex", params.regex, "regex")
    if params.choice is not None:
        literals = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in params.choice)
        return GrammarSpec("grammar", f"root ::= {literals}", "choice")
    assert params.grammar is not None
    return GrammarSpec("grammar", params.grammar, "grammar")


def check_syntax(spec: GrammarSpec) -> None:
    """Parse ``spec`` with xgrammar's parsers (no vocabulary needed).

    Raises:
        InvalidParameterError: a regex that does not compile, a grammar syntax error, a schema xgrammar cannot
            convert (an unknown type, a dangling ``$ref``, a pattern that does not compile).
    """
    try:
        if spec.kind == "json":
            xgr.Grammar.from_json_schema(spec.text, any_whitespace=False)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.text)
        else:
            xgr.Grammar.from_ebnf(spec.text, root_rule_name="root")
    except (RuntimeError, ValueError) as error:
        raise _invalid(spec, error) from None


def _invalid(spec: GrammarSpec, error: Exception) -> InvalidParameterError:
    return InvalidParameterError(f"invalid {spec.what or spec.kind}: {_library_message(error)}", PARAM)


def _load_schema(schema: str | dict[str, Any]) -> Any:
    if isinstance(schema, dict):
        return schema
    try:
        return json.loads(schema)
    except json.JSONDecodeError as error:
        raise InvalidParameterError(f"the JSON schema is not valid JSON: {error}", PARAM) from None


def _check_schema(schema: Any) -> None:
    if not isinstance(schema, (dict, bool)):
        raise InvalidParameterError(f"a JSON schema must be an object, got {type(schema).__name__}", PARAM)
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as error:
        where = "/".join(str(part) for part in error.absolute_path)
        raise InvalidParameterError(
            f"not a valid JSON Schema{f' at {where}' if where else ''}: {error.message[:_MAX_ERROR_CHARS]}", PARAM
        ) from None
    subschemas = list(_subschemas(schema))
    unsupported = sorted({key for node in subschemas for key in node} & UNSUPPORTED_JSON_KEYWORDS)
    if unsupported:
        hint = " (use anyOf for oneOf)" if "oneOf" in unsupported else ""
        raise InvalidParameterError(
            f"the JSON schema uses keywords structured outputs cannot enforce: {', '.join(unsupported)}{hint}", PARAM
        )
    for node in subschemas:
        _check_enforceable(node)


def _check_enforceable(node: dict[str, Any]) -> None:
    """Refuse what xgrammar would accept and not enforce in one (sub)schema: an ``allOf`` of several schemas
    (it keeps the first's constraints only), a ``required`` name that ``properties`` does not declare or a
    ``minProperties`` above their number (only declared properties are generated), a ``$ref`` outside the
    document (never fetched).
    """
    all_of = node.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        raise InvalidParameterError(
            "the JSON schema uses allOf with several schemas, which structured outputs cannot enforce; merge them "
            "into one schema",
            PARAM,
        )
    required, properties = node.get("required"), node.get("properties")
    declared = properties if isinstance(properties, dict) else {}
    min_properties = node.get("minProperties")
    if isinstance(min_properties, int) and min_properties > len(declared):
        raise InvalidParameterError(
            f"the JSON schema asks for minProperties {min_properties} but its properties declare {len(declared)}: "
            "structured outputs generate declared properties only",
            PARAM,
        )
    if isinstance(required, list):
        undeclared = [name for name in required if name not in declared]
        if undeclared:
            names = ", ".join(repr(name) for name in undeclared[:5])
            raise InvalidParameterError(
                f"the JSON schema requires {names}, which its properties do not declare: structured outputs "
                "generate declared properties only",
                PARAM,
            )
    ref = node.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        raise InvalidParameterError(
            f"the JSON schema refers to {ref[:100]!r}: only references within the schema (#/...) are served", PARAM
        )


def _subschemas(schema: Any) -> Iterator[dict[str, Any]]:
    """Every (sub)schema object of ``schema``, itself included: not the maps under ``properties`` or
    ``$defs`` (a field may well be called "if") but their values, nor the values of ``enum``, ``const``,
    ``default`` or ``examples`` (data, not schemas)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        yield node
        for key, value in node.items():
            if key in _NAMED_SCHEMAS and isinstance(value, dict):
                stack.extend(value.values())
            elif key not in _DATA_KEYWORDS:
                stack.append(value)


def _library_message(error: Exception) -> str:
    """xgrammar's message without its source-location prefix (``[time] file.cc:line: ``)."""
    message = str(error).strip()
    if message.startswith("["):
        message = message.split(": ", 1)[-1]
    return message[:_MAX_ERROR_CHARS]


class XgrammarBackend:
    """Compiles :class:`GrammarSpec` s against one tokenizer's vocabulary.

    Args:
        tokenizer: the engine's Hugging Face tokenizer.
        vocab_size: the model's logits width (may exceed the tokenizer's vocabulary: padded rows never allowed).
        eos_token_id: the token that ends a constrained output (the matchers' only stop token).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_id: int | None) -> None:
        stop_token_ids = [eos_token_id] if eos_token_id is not None else None
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        # NOTE: our own cache (StructuredOutputManager) keys by canonical text; xgrammar's would hold a second copy.
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """Parse and compile ``spec`` (seconds for a pathological one; call it off the step's path).

        Raises:
            InvalidParameterError: as :func:`check_syntax`, or what only the compiler finds.
        """
        try:
            if spec.kind == "json":
                return self.compiler.compile_json_schema(spec.text, any_whitespace=False)
            if spec.kind == "regex":
                return self.compiler.compile_regex(spec.text)
            return self.compiler.compile_grammar(spec.text, root_rule_name="root")
        except (RuntimeError, ValueError) as error:
            raise _invalid(spec, error) from None

    def new_grammar(self, compiled: xgr.CompiledGrammar) -> StructuredOutputGrammar:
        """A fresh matcher at the start of ``compiled``."""
        return StructuredOutputGrammar(xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids))


class StructuredOutputGrammar:
    """One sequence's matcher: where its output stands in the grammar (vLLM's ``StructuredOutputGrammar``).

    Advanced by :meth:`accept_token` on every token appended to the sequence; forked with the sequence.
    """

    __slots__ = ("matcher",)

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self.matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        """Advance past ``token_id``; False (state unchanged) when the grammar does not allow it."""
        return self.matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        """Whether the output is complete and its stop token accepted (nothing may follow)."""
        return self.matcher.is_terminated()

    def fork(self) -> StructuredOutputGrammar:
        """An independent copy at the same state (a forked branch or beam)."""
        return StructuredOutputGrammar(self.matcher.fork())

    def num_valid_drafts(
        self, token_ids: Sequence[int], jump_forward: tuple[PreTrainedTokenizerBase, int] | None = None
    ) -> int:
        """How many leading ``token_ids`` the grammar allows in a row, stopping before a token that ends the
        output (its stop token: a draft after it could never be kept). The state is unchanged.

        With ``jump_forward`` (the tokenizer and vocabulary size: jump-forward decoding is on) it also stops
        before a draft that leads where the grammar forces tokens: there the sequence takes the forced tokens
        (:meth:`forced_token_ids`), as it would without speculation, not drafts or a sampled token.
        """
        matcher = self.matcher
        num_valid = 0
        for token_id in token_ids:
            if not matcher.accept_token(token_id):
                break
            if matcher.is_terminated() or (jump_forward is not None and self.forced_token_ids(*jump_forward)):
                matcher.rollback(1)
                break
            num_valid += 1
        if num_valid:
            matcher.rollback(num_valid)
        return num_valid

    def fill_bitmask(self, bitmask: torch.Tensor, row: int, draft_token_ids: Sequence[int] = ()) -> None:
        """Write the allowed next tokens into ``bitmask[row]``, and for each of ``draft_token_ids`` (all valid:
        :meth:`num_valid_drafts`) those after it into the following rows; the state is unchanged.

        Args:
            bitmask: int32 ``[num_rows, ceil(vocab_size / 32)]``, bit ``t % 32`` of word ``t // 32`` set when
                token ``t`` is allowed (mutated).
        """
        matcher = self.matcher
        matcher.fill_next_token_bitmask(bitmask, row)
        for j, token_id in enumerate(draft_token_ids, start=1):
            accepted = matcher.accept_token(token_id)
            assert accepted, "drafts are checked against the grammar before they are scheduled"
            matcher.fill_next_token_bitmask(bitmask, row + j)
        if draft_token_ids:
            matcher.rollback(len(draft_token_ids))

    def forced_token_ids(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> list[int]:
        """Tokens the grammar forces next (jump-forward decoding; SGLang's compressed finite-state machine, Zheng
        et al. 2024, "SGLang"), or an empty list; the state is unchanged.

        The forced text (xgrammar's ``find_jump_forward_string``: what every path of the grammar takes next) is
        tokenized on its own; its last token is left to the model unless the grammar is complete after it, since
        the text that follows may merge with it into another token (the tokenization at the boundary stays the
        model's: ``": "`` then free text may be the token ``' "J'``). When the grammar is complete and allows
        only its stop token, that token is forced.
        """
        matcher = self.matcher
        text = matcher.find_jump_forward_string()
        forced: list[int] = []
        if text:
            for token_id in tokenizer.encode(text, add_special_tokens=False):
                if not matcher.accept_token(token_id):
                    break
                forced.append(token_id)
            if forced and not matcher.is_completed():
                matcher.rollback(1)
                forced.pop()
            if forced:
                matcher.rollback(len(forced))
            return forced
        if matcher.is_completed():
            bitmask = allocate_token_bitmask(1, vocab_size)
            matcher.fill_next_token_bitmask(bitmask, 0)
            allowed = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:vocab_size].nonzero()[0]
            if len(allowed) == 1:
                forced.append(int(allowed[0]))
        return forced


def allocate_token_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """int32 ``[num_rows, ceil(vocab_size / 32)]`` on the CPU (where matchers write), every token allowed."""
    return xgr.allocate_token_bitmask(num_rows, vocab_size)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the logits of disallowed tokens to ``-inf`` in ``rows`` (in place; xgrammar's CPU/CUDA/Triton kernel).

    Args:
        logits: float ``[num_rows, vocab_size]`` (mutated in ``rows`` only).
        bitmask: int32 ``[num_rows, ceil(vocab_size / 32)]``, row ``i`` for logits row ``i``.
        rows: the constrained rows.
    """
    if rows:
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)
