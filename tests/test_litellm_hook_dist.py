"""Issue 20 §7: the LiteLLM hook as its own distribution (``integrations/litellm-hook``,
``fp8-watchdog-litellm``, import name ``fp8_watchdog_litellm``) installs next to PyPI's ``watchdog``
(the file-system library) without either breaking, and runs in a real ``litellm`` proxy.

A fresh venv (cached under ``.cache/`` by a hash of what goes into it) gets PyPI's ``watchdog`` and
the hook's wheel with the hook's declared dependencies, installed by pip from the index, with the
shared dependencies held to the versions of this test environment (constraints). ``pip check`` must
pass there and both packages must import, with no file in common. LiteLLM itself (~500 MB, ~90 s
to install) is not installed again: for the proxy run a ``.pth`` line appends this test
environment's site-packages *after* the venv's own, so the venv's ``watchdog`` (PyPI's), the hook
and the hook's dependencies win and only what the venv lacks (litellm and its proxy modules) comes
from here. The proxy runs from a temporary directory without ``PYTHONPATH``: the repository's
``watchdog`` package is not importable in it.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import uuid
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiohttp")
if any(importlib.util.find_spec(m) is None for m in ("litellm", "fastapi", "litellm_cli")):
    pytest.skip("the LiteLLM proxy's dependencies are not installed (pip install -e '.[litellm]')",
                allow_module_level=True)

import httpx  # noqa: E402

from tests.helpers import read_events  # noqa: E402
from tests.scripted_upstream import Upstream  # noqa: E402
from watchdog.dev.embedded import free_port  # noqa: E402

pytestmark = [pytest.mark.services, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
HOOK = ROOT / "integrations" / "litellm-hook"
#: PyPI's file-system events library, the one a LiteLLM environment may already hold
FS_WATCHDOG = "watchdog==7.1.0"
#: held to this environment's versions, so that litellm (borrowed from here) sees what it was tested with
SHARED = ("kafka-python", "crc32c", "redis", "pydantic", "pydantic-core", "PyYAML", "orjson", "typing-extensions",
          "annotated-types", "typing-inspection")
MASTER_KEY = "sk-llmwd-hook-" + "0" * 32
BORROW_ENV = "LLMWD_TEST_BORROW_SITE"


def _sh(argv: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 300) -> str:
    r = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{argv}: rc {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", BORROW_ENV)
            and not k.startswith("LLMWD_")}


def _load_setup() -> Any:
    spec = importlib.util.spec_from_file_location("fp8_watchdog_litellm_setup", HOOK / "setup.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # not __main__: defines SOURCES and generate(), builds nothing
    return mod


def test_the_hook_sources_are_closed_and_point_at_the_copy(tmp_path: Path) -> None:
    """Every project module the copied files import is copied too, and no copy imports ``watchdog``."""
    setup = _load_setup()
    written = setup.generate(ROOT, tmp_path / "_watchdog")
    assert len(written) == len(setup.SOURCES)
    for path in written:
        for line in path.read_text().splitlines():
            words = line.split()
            if words[:1] in (["from"], ["import"]):
                assert not words[1].startswith("watchdog"), f"{path}: {line}"
    with pytest.raises(ValueError, match="not in SOURCES"):
        setup.rewrite("x.py", "from watchdog.policy.engine import PolicyEngine\n")
    main = metadata.version("fp8-watchdog")
    text = (HOOK / "pyproject.toml").read_text()
    assert f'version = "{main}"' in text, "the hook's version follows fp8-watchdog's"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hook-dist")
    src = out / "src"
    shutil.copytree(HOOK, src / "integrations" / "litellm-hook",
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "_watchdog", "__pycache__"))
    shutil.copytree(ROOT / "watchdog", src / "watchdog", ignore=shutil.ignore_patterns("__pycache__"))
    _sh([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out / "dist"),
         str(src / "integrations" / "litellm-hook")], out, _clean_env())
    return next((out / "dist").glob("fp8_watchdog_litellm-*.whl"))


@pytest.fixture(scope="module")
def venv(wheel: Path) -> Path:
    """The cached venv: PyPI's watchdog + the hook's dependencies; the hook's wheel reinstalled."""
    constraints = "".join(f"{n}=={metadata.version(n)}\n" for n in SHARED if _installed(n))
    key = hashlib.sha256("\n".join([sys.version, FS_WATCHDOG, constraints,
                                    (HOOK / "pyproject.toml").read_text()]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("LLMWD_TEST_CACHE", ROOT / ".cache"))
    cache.mkdir(parents=True, exist_ok=True)
    venv = cache / f"litellm-hook-venv-{key}"
    py = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(py)]
    env = _clean_env()
    with (cache / f"litellm-hook-venv-{key}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another session building the same venv: wait for it
        if not (venv / ".complete").exists():
            shutil.rmtree(venv, ignore_errors=True)
            t0 = time.monotonic()
            _sh([sys.executable, "-m", "venv", "--without-pip", str(venv)], cache, env)
            (venv / "constraints.txt").write_text(constraints)
            _sh([*pip, "install", "-q", "-c", str(venv / "constraints.txt"), FS_WATCHDOG, str(wheel)], cache, env)
            site = Path(_sh([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cache,
                            env).strip())
            # appended only when the variable is set (the proxy run), after the venv's own packages
            (site / "zz_borrow_test_site.pth").write_text(
                f"import os, sys; p = os.environ.get({BORROW_ENV!r}); p and p not in sys.path and sys.path.append(p)\n")
            (venv / ".complete").write_text(f"built in {time.monotonic() - t0:.1f} s\n")
        _sh([*pip, "install", "-q", "--no-deps", "--force-reinstall", str(wheel)], venv, env)
    return venv


def _installed(name: str) -> bool:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def test_installs_next_to_pypi_watchdog_pip_check_clean_and_both_import(venv: Path, tmp_path: Path) -> None:
    py = str(venv / "bin" / "python")
    env = _clean_env()
    out = _sh([sys.executable, "-m", "pip", "--python", py, "check"], tmp_path, env)
    assert "No broken requirements found" in out, out
    probe = """
import json, importlib.metadata as md
import sys, time, pathlib
import watchdog, watchdog.events, watchdog.observers
import fp8_watchdog_litellm
# PyPI's watchdog works: a file created in a watched folder is seen
seen = []
class H(watchdog.events.FileSystemEventHandler):
    def on_created(self, event):
        seen.append(event.src_path)
obs = watchdog.observers.Observer()
obs.schedule(H(), sys.argv[1])
obs.start()
pathlib.Path(sys.argv[1], "new.txt").write_text("x")
deadline = time.monotonic() + 5
while not seen and time.monotonic() < deadline:
    time.sleep(0.05)
obs.stop(); obs.join()
files = {d: {str(f) for f in md.files(d)} for d in ("watchdog", "fp8-watchdog-litellm")}
print(json.dumps({"watchdog": watchdog.__file__, "seen": seen,
                  "hook": fp8_watchdog_litellm.__file__, "common": sorted(files["watchdog"] & files["fp8-watchdog-litellm"]),
                  "hook_top": sorted({f.split("/")[0] for f in files["fp8-watchdog-litellm"]}),
                  "versions": {d: md.version(d) for d in ("watchdog", "fp8-watchdog-litellm")}}))
"""
    (tmp_path / "watched").mkdir()
    got = json.loads(_sh([py, "-c", probe, str(tmp_path / "watched")], tmp_path, env))
    site = str(venv)
    assert got["watchdog"].startswith(site) and got["hook"].startswith(site), got
    assert got["seen"] == [str(tmp_path / "watched" / "new.txt")], got
    assert got["versions"]["watchdog"] == FS_WATCHDOG.split("==")[1]
    assert got["common"] == [] and "watchdog" not in got["hook_top"], got


@pytest.fixture(scope="module")
def upstream() -> Iterator[Upstream]:
    up = Upstream().start()
    yield up
    up.stop()


def test_a_real_litellm_proxy_runs_the_hook_from_the_new_distribution(venv: Path, upstream: Upstream,
                                                                      redis_service: Any, kafka_service: Any,
                                                                      tmp_path: Path) -> None:
    py = str(venv / "bin" / "python")
    env = {**_clean_env(), BORROW_ENV: sysconfig.get_path("purelib"), "LITELLM_LOCAL_MODEL_COST_MAP": "True",
           "NO_DOCS": "True", "DISABLE_ADMIN_UI": "True"}
    # what the proxy process will import: the hook and PyPI's watchdog from the venv, litellm from here
    where = json.loads(_sh([py, "-c", "import json, litellm, watchdog, watchdog.observers, fp8_watchdog_litellm as h;"
                            "print(json.dumps([h.WatchdogLogger.__module__, __import__(h.WatchdogLogger.__module__)"
                            ".__file__, watchdog.__file__, litellm.__file__]))"], tmp_path, env))
    assert where[0] == "fp8_watchdog_litellm._watchdog.integrations.litellm" and where[1].startswith(str(venv))
    assert where[2].startswith(str(venv)) and not where[3].startswith(str(venv)), where

    topic = f"llm.inference.logs.hook.{uuid.uuid4().hex[:8]}"
    (tmp_path / "llmwd.yaml").write_text(f"""\
redis_url: redis://127.0.0.1:{redis_service.port}/0
redis_prefix: hook{uuid.uuid4().hex[:6]}
bootstrap_servers: {kafka_service.address}
topic: {topic}
variants:
  m: {{fp8: m-fp8, fp16: m-fp16}}
default_route: default
""")
    (tmp_path / "proxy.yaml").write_text(f"""\
model_list:
  - model_name: m-fp8
    litellm_params: {{model: openai/m, api_base: "{upstream.base_url}", api_key: none, timeout: 10}}
  - model_name: m-fp16
    litellm_params: {{model: openai/m, api_base: "{upstream.base_url}", api_key: none, timeout: 10}}
  - model_name: m
    litellm_params: {{model: openai/m, api_base: "{upstream.base_url}", api_key: none, timeout: 10}}
litellm_settings:
  callbacks: fp8_watchdog_litellm.handler
  num_retries: 0
general_settings:
  master_key: {MASTER_KEY}
""")
    env["LLMWD_LITELLM_CONFIG"] = str(tmp_path / "llmwd.yaml")
    port = free_port()
    log = tmp_path / "proxy.log"
    with log.open("w") as logf:
        proc = subprocess.Popen([py, "-c", "import sys; from litellm_cli.main import proxy_server; "
                                 "sys.argv[0] = 'litellm'; sys.exit(proxy_server())",
                                 "--config", str(tmp_path / "proxy.yaml"), "--host", "127.0.0.1", "--port", str(port),
                                 "--num_workers", "1"], cwd=tmp_path, env=env, stdout=logf, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                assert proc.poll() is None, f"litellm proxy exited {proc.returncode}:\n{log.read_text()[-3000:]}"
                try:
                    if httpx.get(f"{url}/health/liveliness", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, f"litellm proxy not up in 120 s:\n{log.read_text()[-3000:]}"
                time.sleep(0.3)
            upstream.mode = "ok"
            # a client-chosen call id (LiteLLM honours x-litellm-call-id) must not become the event id
            r = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {MASTER_KEY}",
                                                                 "x-litellm-call-id": "chosen-by-client"},
                           json={"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4},
                           timeout=30)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == " answer 0."
            assert upstream.requests and upstream.requests[-1]["model"] == "m"
            events = read_events(kafka_service.address, topic, 1, timeout=20.0)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
    assert len(events) == 1, log.read_text()[-3000:]
    ev = events[0]
    # no flag for (m, default): the default precision, fp8, served by the m-fp8 deployment
    assert (ev.model, ev.route, ev.precision, ev.status, ev.engine) == ("m", "default", "fp8", "ok", "litellm:m-fp8")
    assert ev.latency_ms > 0 and ev.prompt_tokens >= 0
    assert ev.request_id != "chosen-by-client" and len(ev.request_id) == 32
    assert ev.extra.get("litellm_call_id") == "chosen-by-client"
