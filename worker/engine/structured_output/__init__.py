"""Structured outputs: constrained decoding by grammar (docs/engine.md, "Structured outputs"; vLLM V1's names).

``manager``: compile once per distinct constraint (cached, time-limited, off the step's path) and
:func:`validate_structured_outputs` for early checks; ``backend_xgrammar``: the xgrammar compiler, a matcher per
sequence and the token bitmask. Importing this package does not import xgrammar.
"""

from worker.engine.structured_output.manager import StructuredOutputManager, validate_structured_outputs

__all__ = ["StructuredOutputManager", "validate_structured_outputs"]
