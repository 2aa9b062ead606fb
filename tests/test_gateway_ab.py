"""The side-by-side gateway bench's own parts: trees exported as an install sees them, cells named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench.gateway_ab import ROOT, cells_of, export, ratios


def test_an_exported_revision_imports_from_its_own_tree(tmp_path: Path) -> None:
    tree = export("HEAD", tmp_path / "head")
    code = "import llmgw.events.runtime.store as m, tests.bench.gateway as g; print(m.__file__, g.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tree / "src",
        env={"PYTHONPATH": f"{tree / 'pkg'}:{tree / 'src'}", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    store, bench = out.stdout.split()
    assert store.startswith(str(tree)) and bench.startswith(str(tree)), out.stdout
    assert not (tree / "src" / ".git").exists(), "an export holds the revision's files, not the repository"


def test_the_working_tree_is_linked_not_copied(tmp_path: Path) -> None:
    tree = export("WORK", tmp_path / "work")
    assert (tree / "src").resolve() == ROOT.resolve()
    assert (tree / "pkg" / "llmgw" / "services").resolve() == (ROOT / "services").resolve()


def test_a_patch_is_applied_to_the_export_and_one_that_does_not_apply_is_refused_by_name(tmp_path: Path) -> None:
    adds = tmp_path / "adds.patch"
    adds.write_text(
        "diff --git a/PATCHED b/PATCHED\nnew file mode 100644\n--- /dev/null\n+++ b/PATCHED\n@@ -0,0 +1 @@\n+yes\n"
    )
    tree = export("HEAD", tmp_path / "head", adds)
    assert (tree / "src" / "PATCHED").read_text() == "yes\n"
    assert not (ROOT / "PATCHED").exists(), "the working tree untouched"
    stale = tmp_path / "stale.patch"
    stale.write_text("diff --git a/NOT_THERE b/NOT_THERE\n--- a/NOT_THERE\n+++ b/NOT_THERE\n@@ -1 +1 @@\n-a\n+b\n")
    with pytest.raises(ValueError, match=r"stale\.patch does not apply to HEAD: .*NOT_THERE"):
        export("HEAD", tmp_path / "stale", stale)
    with pytest.raises(ValueError, match="not to the working tree"):
        export("WORK", tmp_path / "work", adds)


def test_cells_are_named_by_concurrency_with_s_for_streamed() -> None:
    assert cells_of("16,64s") == [(16, False), (64, True)]
    assert len(cells_of(None)) == 6


def test_ratios_pair_each_round_with_the_other_sides_same_round() -> None:
    base = [{"cpu_us": 100.0}, {"cpu_us": 200.0}, {"cpu_us": 0.0}]
    after = [{"cpu_us": 110.0}, {"cpu_us": 180.0}, {"cpu_us": 5.0}]
    assert ratios(base, after, "cpu_us") == [1.1, 0.9]  # a round with nothing measured on BASE is left out
