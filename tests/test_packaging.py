"""A regular install carries every module: the wheel is what `pip install .` installs."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROOTS = ("events", "projections", "services", "agent", "cli", "bench")


def test_a_wheel_built_from_the_tree_carries_every_module(tmp_path: Path) -> None:
    # Built from a copy: setuptools reuses a build/ folder, which would hide a missing package.
    source = tmp_path / "src"
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis"),
    )
    out = tmp_path / "wheel"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "-q", "-w", str(out)],
        check=True,
        timeout=300,
    )
    (wheel,) = out.glob("llmgw-*.whl")
    carried = set(zipfile.ZipFile(wheel).namelist())
    in_tree = {
        f"llmgw/{path.relative_to(ROOT).as_posix()}"
        for root in ROOTS
        for path in (ROOT / root).rglob("*.py")
        if "__pycache__" not in path.parts
    }
    missing = sorted(in_tree - carried)
    assert not missing, f"the wheel leaves out {missing}: a folder without __init__.py is not a package"
