"""A model path that does not exist is named in the project's words ("model path X does not exist"),
never as a Hugging Face "Repo id must use ..." error, and before torch is imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from probes.engines.model_path import ModelPathError, check_model_path

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("value", "says"), [
    ("/x/y", "model path /x/y does not exist"),
    ("./models/llama", "model path ./models/llama does not exist"),
    ("../llama", "model path ../llama does not exist"),
    ("~/no-such-model-dir-h13", "does not exist"),
    ("models/llama/8b", "model path models/llama/8b does not exist"),
    ("org/na--me", "does not exist"),
    ("bad name", "does not exist"),
])
def test_a_missing_local_path_is_named(value: str, says: str) -> None:
    with pytest.raises(ModelPathError, match="Hugging Face repo id such as org/name") as err:
        check_model_path(value)
    assert says in str(err.value) and "Repo id must" not in str(err.value)


def test_existing_dirs_and_repo_ids_pass_and_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    check_model_path(tmp_path)
    check_model_path("meta-llama/Llama-3.1-8B-Instruct")  # may be in the HF cache or on the Hub: the engine's call
    check_model_path("gpt2")
    (tmp_path / "model.safetensors").write_text("")
    with pytest.raises(ModelPathError, match="is a file, not a model directory"):
        check_model_path(tmp_path / "model.safetensors")


def test_the_engines_say_it_before_importing_torch() -> None:
    code = ("import sys\nfrom probes.engines import get_engine\n"
            "for kind in ('torch', 'tensorrt_llm'):\n"
            "    try:\n        get_engine(kind, model_path='/x/y', precision='fp16')\n"
            "    except ValueError as exc:\n        print(kind, exc)\n"
            "print('torch imported:', 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    assert out.returncode == 0, out.stderr
    assert lines[0].startswith("torch model path /x/y does not exist"), lines
    assert lines[1].startswith("tensorrt_llm model path /x/y does not exist"), lines
    assert lines[2] == "torch imported: False"


def test_replay_with_a_missing_model_is_one_line_in_our_words() -> None:
    out = subprocess.run([sys.executable, "-m", "watchdog.cli.main", "replay", "--set", "code", "--engine", "torch",
                          "-o", "model_path=/x/y", "--no-progress"], cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    err = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(err) == 1, err
    assert "model path /x/y does not exist" in err[0] and "Repo id" not in err[0], err


def test_calibrate_with_a_missing_model_is_one_line_in_our_words() -> None:
    out = subprocess.run([sys.executable, "-m", "watchdog.cli.main", "calibrate", "--model", "/x/y", "--set", "code"],
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                         timeout=120)
    err = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(err) == 1 and out.stdout == "", (out.stdout, err)
    assert err[0] == ("calibrate: model path /x/y does not exist (give a local model directory with config.json, "
                      "or a Hugging Face repo id such as org/name)"), err


def test_replay_with_a_directory_that_holds_no_model_is_one_line_in_our_words(tmp_path: Path) -> None:
    # before: transformers' five-line "Couldn't instantiate the backend tokenizer ..." about sentencepiece
    out = subprocess.run([sys.executable, "-m", "watchdog.cli.main", "replay", "--set", "code", "--engine", "torch",
                          "-o", f"model_path={tmp_path}", "--no-progress"], cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    err = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(err) == 1, err
    assert f"model path {tmp_path} has no config.json" in err[0], err
