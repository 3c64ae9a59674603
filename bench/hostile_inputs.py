"""Hostile policy files: how long validating each takes, at what peak memory, and what it says.

Each file is validated by ``watchdog.policy.load_policy_files`` (what ``policy validate`` and the
daemon's reload run) in a child process with a wall-clock limit and an address-space cap, so the
code of another checkout can be measured as the baseline::

    python bench/hostile_inputs.py                       # this checkout
    python bench/hostile_inputs.py --code /work/main     # the code before (baseline)

It also measures how long the main loop is blocked by ``PolicyLoader.check()`` while a large
valid file (just under the size limit) reloads: synchronous vs ``background=True``.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HEAD = "policies:\n  - name: p\n"
RULE = "    rules:\n      - name: r\n        metric: error_rate\n        fail_if: {cond}\n"


def _policy(cond: str = "candidate > 0.05", extra: str = "") -> str:
    return HEAD + extra + RULE.format(cond=cond)


def hostile_files() -> dict[str, str]:
    """name -> file text."""
    laughs = 'x0: &x0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    for i in range(1, 10):
        laughs += f"x{i}: &x{i} [" + ",".join([f"*x{i - 1}"] * 9) + "]\n"
    big_desc = "x" * (20 * 1024 * 1024)
    globs = ", ".join(f'"route-{i}/*"' for i in range(40_000))
    return {
        "billion_laughs": laughs + _policy(),
        "yaml_500_deep": "policies: " + "[" * 500 + "]" * 500 + "\n",
        "parens_120": _policy("'" + "(" * 120 + "candidate > 0.05" + ")" * 120 + "'"),
        "nots_1000": _policy("'" + "not " * 1000 + "candidate > 0.05'"),
        "size_20mb": _policy(extra=f"    description: {big_desc}\n"),
        "scope_globs_40k": _policy(extra=f"    scope:\n      routes: [{globs}]\n"),
        "nan_cooldown": _policy(extra="    cooldown: .nan\n"),
        "nan_promote_after": _policy(extra="    promote:\n      mode: auto\n      after: .nan\n"),
        "inf_judge_effect": HEAD + "    rules:\n      - name: r\n        metric: latency_p99_ms\n"
                                   "        judge: {test: mann_whitney, effect: .inf}\n",
        "zero_div_condition": _policy("candidate > 0 / 0"),
        "python_tag_mapping": _policy(extra="    scope: !!python/object/apply:os.system {args: [\"true\"]}\n"),
        "confusable_scope": _policy(extra="    scope:\n      routes: [\"\u0441hat/*\"]\n"),
    }


CHILD = textwrap.dedent("""
    import resource, sys, time
    from watchdog.policy import PolicyError, load_policy_files
    t0 = time.perf_counter()
    try:
        load_policy_files([sys.argv[1]])
        verdict = "ACCEPTED"
    except PolicyError as exc:
        verdict = "rejected: " + exc.messages[0].split(": ", 1)[-1][:110]
    except BaseException as exc:
        verdict = "CRASH " + type(exc).__name__ + ": " + str(exc)[:80]
    mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{time.perf_counter() - t0:.3f}\\t{mib:.0f}\\t{verdict}")
""")


def measure(path: Path, code: Path, timeout_s: float, mem_gb: float) -> tuple[float, float, str]:
    """(seconds, peak MiB, verdict) of validating ``path`` with the package found in ``code``."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    cap = int(mem_gb * 2**30)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], env=env, cwd=code, preexec_fn=limit,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        peak = _vm_hwm_mib(proc.pid)
        proc.kill()
        proc.communicate()
        return time.perf_counter() - t0, peak, f"TIMEOUT after {timeout_s:.0f} s (still running)"
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not out.strip():
        tail = (err.strip().splitlines() or ["?"])[-1][:100]
        return wall, float("nan"), f"CRASH rc={proc.returncode}: {tail}"
    secs, mib, verdict = out.strip().splitlines()[-1].split("\t", 2)
    return float(secs), float(mib), verdict


def _vm_hwm_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def blocked_main_loop(code: Path) -> str:
    """Longest ``check()`` call while a ~1 MB valid policy file reloads (sync vs background)."""
    child = textwrap.dedent("""
        import os, sys, time, inspect
        from pathlib import Path
        from watchdog.policy import PolicyLoader
        d = Path(sys.argv[1]); p = d / "p.yaml"
        desc = "    description: " + "x" * 900_000 + "\\n"
        rules = "".join(f"      - name: r{i}\\n        metric: error_rate\\n        fail_if: candidate > 0.{i % 9 + 1}\\n"
                        for i in range(1500))
        body = "policies:\\n  - name: p\\n" + desc + "    rules:\\n" + rules
        p.write_text(body)
        kw = {"background": True} if "background" in inspect.signature(PolicyLoader).parameters and sys.argv[2] == "bg" else {}
        loader = PolicyLoader([p], **kw)
        p.write_text(body.replace("name: p\\n", "name: q\\n", 1)); st = p.stat()
        os.utime(p, ns=(st.st_mtime_ns + 10**9, st.st_mtime_ns + 10**9))
        worst, t_end = 0.0, time.perf_counter() + 30
        while loader.policy_set.names != ["q"] and time.perf_counter() < t_end:
            t0 = time.perf_counter(); loader.check(); worst = max(worst, time.perf_counter() - t0)
            time.sleep(0.001)
        print(f"{worst * 1000:.1f}\\t{loader.policy_set.names}")
    """)
    out = []
    for mode in ("sync", "bg"):
        with tempfile.TemporaryDirectory() as d:
            r = subprocess.run([sys.executable, "-c", child, d, mode], env={**os.environ, "PYTHONPATH": str(code)},
                               cwd=code, capture_output=True, text=True, timeout=120)
            res = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else f"CRASH {r.stderr.strip()[-100:]}"
            out.append(f"{mode}: longest check() {res.split(chr(9))[0]} ms")
    return "; ".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--code", type=Path, default=Path(__file__).resolve().parents[1],
                    help="checkout whose watchdog package is measured (default: this one)")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--mem-gb", type=float, default=3.0)
    ap.add_argument("--only", nargs="*", help="names of the files to try")
    args = ap.parse_args(argv)
    print(f"code: {args.code}  (limit {args.timeout:.0f} s, {args.mem_gb:g} GiB address space per file)")
    print(f"{'file':<22} {'seconds':>8} {'peak MiB':>9}  verdict")
    with tempfile.TemporaryDirectory() as d:
        for name, text in hostile_files().items():
            if args.only and name not in args.only:
                continue
            path = Path(d) / f"{name}.yaml"
            path.write_text(text, encoding="utf-8")
            secs, mib, verdict = measure(path, args.code, args.timeout, args.mem_gb)
            print(f"{name:<22} {secs:8.3f} {mib:9.0f}  {verdict}", flush=True)
            path.unlink()
    print("reload of a 1 MB policy file:", blocked_main_loop(args.code))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
