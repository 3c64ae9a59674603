#!/bin/bash
# One device call: install the carried wheels, GPU-relevant tests, then the given benchmark command.
# Usage (on the device, from the copied worktree): bash bench/gpu_call.sh TESTS_TIMEOUT_S CMD...
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "${WHL:-.gpu/whl}"/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
t=$1; shift
# the image's site-packages hold no bytecode and are read-only: without this every process compiles torch's and
# transformers' sources as it imports them (~10 s of a CLI process, 2026-12-05), which a pip install does not
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=/tmp/pyc
SP=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
python3 -m compileall -q -j 0 "$SP" watchdog probes bench /tmp/site >/dev/null 2>&1
if [ "$t" -gt 0 ]; then
  timeout "$t" python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_gpu.py tests/test_gpu_read.py \
    tests/test_gpu_bandwidth.py tests/test_fp8.py tests/test_engines_torch.py tests/test_replay.py -rs \
    > "$OUT/tests.txt" 2>&1
  echo "tests rc=$?"; tail -25 "$OUT/tests.txt"
fi
"$@" 2>&1 | grep -v -E "Loading weights|Writing model" | tee "$OUT/bench.txt"
