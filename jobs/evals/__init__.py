"""Evaluation runs in the shapes of OpenAI's Evals API (evals, runs, output items, graders); see docs/api.md."""
