"""Weights a node keeps outside its cache: the model directories (SPEC FLEET-8 ``model_dirs``).

llmgw observes storage rather than owning it: a shared mount, a disk image, local NVMe or a hand
copy all look the same, and placement only needs to know whether a model's file is present. The
agent lists the weight files under its model directories and reports their absolute paths with
its heartbeat (beside the cache's ``MODEL/VERSION/FILE`` entries, which never start with ``/``);
the scheduler prefers a node that reports a model's local source path.

A listing walks directories that may be large or remote, so it is bounded (depth and count) and
kept for ``rescan_s`` between walks; it runs in a worker thread.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

WEIGHT_SUFFIXES = (".gguf", ".safetensors")
MAX_DEPTH = 4  # model_dir/OWNER/REPO/REVISION/FILE is as deep as layouts go
MAX_FILES = 10_000  # a mount with more is reported in part (and logged by the caller)


def list_weight_files(dirs: Iterable[Path], max_depth: int = MAX_DEPTH, max_files: int = MAX_FILES) -> list[str]:
    """Absolute, normalised paths of weight files under ``dirs`` (sorted; missing dirs are skipped)."""
    out: list[str] = []
    for top in dirs:
        root = os.path.normpath(os.path.abspath(os.path.expanduser(str(top))))
        stack = [(root, 0)]
        while stack and len(out) < max_files:
            folder, depth = stack.pop()
            try:
                entries = list(os.scandir(folder))
            except OSError:
                continue  # missing, unreadable or unmounted: nothing held there
            for entry in entries:
                try:
                    if entry.is_dir(follow_symlinks=True):
                        if depth < max_depth and not entry.name.startswith("."):
                            stack.append((entry.path, depth + 1))
                    elif entry.name.endswith(WEIGHT_SUFFIXES) and entry.is_file(follow_symlinks=True):
                        out.append(entry.path)
                except OSError:
                    continue
                if len(out) >= max_files:
                    break
    return sorted(set(out))


class ModelDirs:
    """The weight files under a node's model directories, listed at most once per ``rescan_s``."""

    def __init__(self, dirs: Iterable[Path], rescan_s: float = 60.0) -> None:
        self.dirs = [Path(d) for d in dirs]
        self.rescan_s = rescan_s
        self._files: list[str] = []
        self._listed_at: float | None = None

    def due(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return bool(self.dirs) and (self._listed_at is None or now - self._listed_at >= self.rescan_s)

    def rescan(self) -> list[str]:
        """Walk the directories now (blocking: call it in a worker thread)."""
        self._files = list_weight_files(self.dirs)
        self._listed_at = time.monotonic()
        return self._files

    def held(self) -> list[str]:
        """What the last walk found."""
        return list(self._files)
