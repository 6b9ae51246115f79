"""The engine's structured-output manager: one compile per distinct constraint, off the step's path, time-limited.

As vLLM V1's ``StructuredOutputManager``: the engine hands it a request's ``StructuredOutputsParams`` when the
request is added; the constraint is canonicalized and its schema checked (quick), then parsed and compiled once
per engine on a background thread and cached by its canonical text; every sequence of the request gets its own
matcher. ``add_request`` waits for the compile up to ``compile_timeout_s``: a pathological constraint fails its
own line (``InvalidParameterError``) and never holds a step; its compile is left to finish on its thread
(xgrammar cannot be interrupted) and a later line with the same constraint finds the result in the cache.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from worker.engine.errors import InvalidParameterError
from worker.engine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerBase

    from worker.engine.structured_output.backend_xgrammar import (
        GrammarSpec,
        StructuredOutputGrammar,
        XgrammarBackend,
    )

_COMPILE_THREADS = 2  # a compile that overruns its time limit keeps one; the other serves the next lines


@dataclass(slots=True)
class CompileStats:
    """Compile counters: ``compile_times_s`` (seconds of each compile, i.e. each cache miss) and
    ``num_cache_hits`` (constraints found compiled or compiling)."""

    compile_times_s: list[float] = field(default_factory=list)
    num_cache_hits: int = 0


def validate_structured_outputs(params: StructuredOutputsParams) -> None:
    """Check a constraint before any engine work, without a tokenizer (the request mapping may call it).

    Checks the JSON Schema against its metaschema, refuses keywords the grammar cannot enforce, and parses the
    schema, regex or grammar with xgrammar (milliseconds; a pathological constraint, such as a pattern repeated
    thousands of times, can take seconds here, without a limit). The compile against the vocabulary and its
    time limit are ``LLMEngine.add_request``'s.

    Raises:
        InvalidParameterError: ``param="structured_outputs"``, with a message naming the problem.
    """
    from worker.engine.structured_output.backend_xgrammar import canonical_spec, check_syntax

    check_syntax(canonical_spec(params))


class StructuredOutputManager:
    """Compiles and caches grammars for one engine; builds each constrained sequence's matcher.

    Args:
        tokenizer: the engine's tokenizer; vocab_size: the model's logits width; eos_token_id: the stop token.
        compile_timeout_s: the longest ``add_request`` waits for one compile (seconds).

    The backend (xgrammar and its view of the vocabulary, about half a second to build) is made at the first
    constrained request, so engines that never see one never import xgrammar.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        eos_token_id: int | None,
        compile_timeout_s: float,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_id = eos_token_id
        self.compile_timeout_s = compile_timeout_s
        self._backend: XgrammarBackend | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._compiled: dict[GrammarSpec, Future[xgr.CompiledGrammar]] = {}
        self._specs: dict[tuple[object, ...], GrammarSpec] = {}
        self.stats = CompileStats()

    @property
    def backend(self) -> XgrammarBackend:
        if self._backend is None:
            from worker.engine.structured_output.backend_xgrammar import XgrammarBackend

            self._backend = XgrammarBackend(self._tokenizer, self._vocab_size, self._eos_token_id)
        return self._backend

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of ``params``: from the cache, or compiled now (waiting at most
        ``compile_timeout_s``).

        Raises:
            InvalidParameterError: as :func:`validate_structured_outputs`; a grammar the compiler refuses; a
                compile that overran ``compile_timeout_s`` (its line fails; a later line with the same
                constraint finds the finished compile, or its error, in the cache).
        """
        from worker.engine.structured_output.backend_xgrammar import PARAM, canonical_spec

        # NOTE: a job sends one constraint on many lines: its metaschema check runs once, not per line.
        key = (
            json.dumps(params.json) if isinstance(params.json, dict) else params.json,
            params.regex,
            params.choice,
            params.grammar,
            params.json_object,
        )
        spec = self._specs.get(key)
        if spec is None:
            spec = self._specs[key] = canonical_spec(params)
        backend = self.backend
        future = self._compiled.get(spec)
        if future is None:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(_COMPILE_THREADS, thread_name_prefix="grammar-compile")
            future = self._compiled[spec] = self._executor.submit(self._timed_compile, backend, spec)
        else:
            self.stats.num_cache_hits += 1
        try:
            return future.result(timeout=self.compile_timeout_s)
        except FutureTimeoutError:
            raise InvalidParameterError(
                f"the constraint took longer than {self.compile_timeout_s:g} s to compile: simplify it", PARAM
            ) from None

    def _timed_compile(self, backend: XgrammarBackend, spec: GrammarSpec) -> xgr.CompiledGrammar:
        start_s = time.perf_counter()
        try:
            return backend.compile(spec)
        finally:
            self.stats.compile_times_s.append(time.perf_counter() - start_s)

    def new_grammar(self, compiled: xgr.CompiledGrammar) -> StructuredOutputGrammar:
        """A matcher at the start of ``compiled`` for one sequence."""
        return self.backend.new_grammar(compiled)

    def make_stats(self) -> CompileStats:
        """The compile counters since the last call (take and reset)."""
        stats, self.stats = self.stats, CompileStats()
        return stats
