"""Graders of eval runs (docs/api.md, "Graders"): `grade_item` and the sandbox it runs untrusted code in."""

from worker.grading.grade import GradeResult, grade_item, grade_items
from worker.grading.model_graders import ModelGrader

__all__ = ["GradeResult", "ModelGrader", "grade_item", "grade_items"]
