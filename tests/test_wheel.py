"""The built wheel, not the checkout: fresh venv + install + init + validate + config check + run.

Dependencies come from the test interpreter's site-packages through a ``.pth`` line (no network,
seconds); that directory's own ``.pth`` files (the editable install of a checkout) are not
processed, so ``watchdog`` is imported from the wheel. Everything runs from a temporary cwd.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import httpx
import pytest

from watchdog.dev.embedded import Service, free_port

pytestmark = [pytest.mark.services, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
_SKIP = shutil.ignore_patterns(".git", ".venv", ".cache", "build", "dist", "*.egg-info", "__pycache__", ".*_cache",
                               "var", ".demo", ".whl", ".gpu", "tests")


def _sh(argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=_SKIP)  # a clean tree: no stale build/ leaks into the wheel
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    built = _sh([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp / "dist"), "."],
                src, env)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    wheel = next((tmp / "dist").glob("fp8_watchdog-*.whl"))
    venv = tmp / "venv"
    made = _sh([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp, env)
    assert made.returncode == 0, made.stderr
    py = venv / "bin" / "python"
    site = Path(_sh([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp, env).stdout.strip())
    (site / "_deps_from_test_env.pth").write_text(sysconfig.get_path("purelib") + "\n")
    inst = _sh([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", str(wheel)],
               tmp, env)
    assert inst.returncode == 0, inst.stdout[-2000:] + inst.stderr[-2000:]
    return venv


def test_wheel_init_validate_check_and_run(venv: Path, tmp_path: Path, redis_service: Service,
                                           kafka_service: Service) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("LLMWD_")}
    exe = str(venv / "bin" / "fp8-watchdog")
    where = _sh([str(venv / "bin" / "python"), "-c", "import watchdog; print(watchdog.__file__)"], tmp_path, env)
    assert where.stdout.startswith(str(venv)), where.stdout + where.stderr  # the wheel, not a checkout

    out = _sh([exe, "init", "wd"], tmp_path, env)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "wd/policies/default.yaml").is_file() and (tmp_path / "wd/golden_sets/code/manifest.yaml").is_file()
    assert _sh([exe, "init", "wd"], tmp_path, env).returncode == 2  # refuses to overwrite

    out = _sh([exe, "policy", "validate", "wd/policies"], tmp_path, env)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr
    out = _sh([exe, "golden", "--root", "wd/golden_sets", "validate"], tmp_path, env)
    assert out.returncode == 0, out.stdout + out.stderr

    port = free_port()
    env |= {"LLMWD_REDIS__URL": f"redis://:s3cret@{redis_service.address}/0",
            "LLMWD_KAFKA__BOOTSTRAP_SERVERS": kafka_service.address, "LLMWD_SERVER__PORT": str(port),
            "LLMWD_KAFKA__TOPIC": f"wheel.{port}"}
    out = _sh([exe, "config", "check", "--config", "wd/config.yaml"], tmp_path, env)
    assert out.returncode == 0, out.stderr
    assert kafka_service.address in out.stdout and "s3cret" not in out.stdout and ":***@" in out.stdout

    env["LLMWD_REDIS__URL"] = f"redis://{redis_service.address}/0"
    proc = subprocess.Popen([exe, "run", "--config", "wd/config.yaml"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the daemon from the wheel never answered /healthz"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=20)
        assert rc == 0, proc.communicate()[0][-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_installed_wheel_names_nothing_of_the_checkout(venv: Path) -> None:
    site = next((venv / "lib").glob("python*/site-packages"))
    dist = next(site.glob("fp8_watchdog-*.dist-info"))
    files = [site / line.split(",", 1)[0] for line in (dist / "RECORD").read_text().splitlines() if line]
    assert any(f.match("watchdog/starter/policies/default.yaml") for f in files)
    assert any(f.match("watchdog/starter/golden_sets/code/items.jsonl") for f in files)
    needles = [str(ROOT)]  # the checkout the wheel was built from
    leaks = [str(f.relative_to(site)) for f in files if f.is_file() and f.suffix in (".py", ".yaml", ".json", ".txt",
             ".lua", ".jsonl") and any(n in f.read_text(errors="replace") for n in needles)]
    assert not leaks, leaks
