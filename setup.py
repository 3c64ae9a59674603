"""Build hook: the wheel carries the starter files (``policies/``, ``golden_sets/`` and
``deploy/config.example.yaml``) as package data under ``watchdog/starter/``, so that
``llm-watchdog init DIR`` works from an installed wheel. In a checkout they stay where they are
(``watchdog.cli.init`` falls back to the repository paths). Everything else is in pyproject.toml.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
STARTER = {"policies": "policies", "golden_sets": "golden_sets",
           "deploy/config.example.yaml": "config.example.yaml"}


class BuildWithStarter(build_py):
    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "watchdog" / "starter"
        for src, dst in STARTER.items():
            path = ROOT / src
            if path.is_dir():
                shutil.copytree(path, target / dst, dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            elif path.is_file():
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target / dst)


setup(cmdclass={"build_py": BuildWithStarter})
