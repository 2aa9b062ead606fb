"""A regular install carries every module: the wheel is what `pip install .` installs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROOTS = ("events", "projections", "services", "agent", "cli", "bench", "modelfiles")
PIP = [sys.executable, "-m", "pip"]


def build_wheel(tmp_path: Path) -> Path:
    """The wheel `pip install .` would install, built from a copy of the tree: setuptools reuses a
    build/ folder, which would hide a missing package."""
    source = tmp_path / "src"
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis"),
    )
    out = tmp_path / "wheel"
    subprocess.run([*PIP, "wheel", str(source), "--no-deps", "-q", "-w", str(out)], check=True, timeout=300)
    (wheel,) = out.glob("llmgw-*.whl")
    return wheel


def test_a_wheel_built_from_the_tree_carries_every_module(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    carried = set(zipfile.ZipFile(wheel).namelist())
    in_tree = {
        f"llmgw/{path.relative_to(ROOT).as_posix()}"
        for root in ROOTS
        for path in (ROOT / root).rglob("*.py")
        if "__pycache__" not in path.parts
    }
    missing = sorted(in_tree - carried)
    assert not missing, f"the wheel leaves out {missing}: a folder without __init__.py is not a package"
    # The console's pages, scripts, styles and messages: served from the wheel, never built or fetched.
    console = ROOT / "services" / "console"
    assets = {
        f"llmgw/{path.relative_to(ROOT).as_posix()}"
        for folder in ("templates", "static", "messages")
        for path in (console / folder).rglob("*")
        if path.is_file()
    }
    assert any(a.endswith("htmx.min.js") for a in assets)
    assert not sorted(assets - carried), f"the wheel leaves out the console's {sorted(assets - carried)}"


def test_the_installed_wheel_imports_every_module_and_runs_llmgw_help(tmp_path: Path) -> None:
    wheel, target = build_wheel(tmp_path), tmp_path / "site"
    subprocess.run([*PIP, "install", "--no-deps", "-q", "--target", str(target), str(wheel)], check=True, timeout=300)
    # The installed copy comes first on the path, ahead of the editable install this venv has.
    check = (
        "import importlib, pathlib, sys\n"
        f"site = pathlib.Path({str(target)!r})\n"
        "for f in sorted((site / 'llmgw').rglob('*.py')):\n"
        "    name = '.'.join(f.relative_to(site).with_suffix('').parts).removesuffix('.__init__')\n"
        "    module = importlib.import_module(name)\n"
        "    assert str(module.__file__).startswith(str(site)), (name, module.__file__)\n"
        "from llmgw.cli.main import main\n"
        "main(['--help'])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    run = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Usage: " in run.stdout and " up " in run.stdout
