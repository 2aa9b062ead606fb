"""What the mirror holds, folded from its events: the mirror service, its file server and peer, and
`llmgw mirror list` and `mirror fetch` (which fold the log themselves, so they answer while the
mirror is down) all call this one fold.

Pure: no I/O. Events are applied once each (by sequence), so the service may fold from a live
follower and from a catch-up read without counting anything twice.
"""

from __future__ import annotations

from typing import Any

import msgspec

from llmgw.events.schema import mirror as E
from llmgw.events.schema.envelope import RecordedEvent

FETCHING, PRESENT, FAILED = "fetching", "present", "failed"


class FileState(msgspec.Struct, kw_only=True):
    name: str
    path: str
    size: int
    published_sha256: str | None = None
    blob_id: str | None = None
    done: int = 0
    sha256: str | None = None  # set once verified
    verified: bool = False


class VersionState(msgspec.Struct, kw_only=True):
    model: str
    version: str
    repo: str
    revision: str
    commit: str
    state: str = FETCHING
    files: dict[str, FileState] = {}
    error: str | None = None
    error_code: str | None = None
    causation: str | None = None  # the command of the latest fetch
    correlation: str | None = None  # that command's correlation: its later events carry it too
    fetch_files: list[str] = []  # names the latest fetch downloads, in order
    updated_at: str = ""

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files.values())

    @property
    def done(self) -> int:
        return sum(f.size if f.verified else min(f.done, f.size) for f in self.files.values())


class MirrorState:
    """Every model version the mirror holds or fetches, with its files, folded from ``mirror.*`` events."""

    def __init__(self) -> None:
        self.models: dict[str, dict[str, VersionState]] = {}
        self.position = 0
        self.tombstones: dict[str, dict[str | None, int]] = {}  # model -> version (None: all) -> seq

    def apply(self, model: str, event: RecordedEvent) -> None:
        if event.seq <= self.position:
            return  # seen already (the follower and a catch-up both read the log)
        self.position = event.seq
        p = event.payload
        at = event.envelope.at.isoformat()
        versions = self.models.setdefault(model, {})
        match p:
            case E.FetchStarted():
                v = versions.get(p.version)
                if v is None:
                    v = versions[p.version] = VersionState(
                        model=model, version=p.version, repo=p.repo, revision=p.revision, commit=p.commit
                    )
                v.state, v.error, v.error_code = FETCHING, None, None
                v.causation = event.envelope.causation
                v.correlation = event.envelope.correlation
                v.fetch_files = [f.name for f in p.files]
                for f in p.files:
                    old = v.files.get(f.name)
                    if old is None or not old.verified:
                        v.files[f.name] = FileState(
                            name=f.name, path=f.path, size=f.size, published_sha256=f.sha256, blob_id=f.blob_id
                        )
                v.updated_at = at
            case E.FileProgress():
                f = self._file(model, p.version, p.file)
                if f is not None:
                    f.done = p.done
            case E.FileVerified():
                f = self._file(model, p.version, p.file)
                if f is not None:
                    f.done, f.sha256, f.verified = p.size, p.sha256, True
            case E.FetchCompleted():
                v = versions.get(p.version)
                if v is not None:
                    v.state, v.error, v.error_code, v.updated_at = PRESENT, None, None, at
            case E.FetchFailed():
                v = versions.get(p.version)
                if v is not None:
                    v.state, v.error, v.error_code, v.updated_at = FAILED, p.reason, p.code, at
                    f = v.files.get(p.file) if p.file else None
                    if f is not None and not f.verified and p.code in ("checksum", "disk_full"):
                        f.done = 0  # its partial file was deleted
            case E.MirrorRemoved():
                self.tombstones.setdefault(model, {})[p.version] = event.seq
                if p.version is None:
                    versions.clear()
                else:
                    versions.pop(p.version, None)
        if not versions:
            self.models.pop(model, None)

    def _file(self, model: str, version: str, name: str) -> FileState | None:
        v = self.models.get(model, {}).get(version)
        return v.files.get(name) if v is not None else None

    def version(self, model: str, version: str) -> VersionState | None:
        return self.models.get(model, {}).get(version)

    def fetching(self) -> list[VersionState]:
        return [v for versions in self.models.values() for v in versions.values() if v.state == FETCHING]

    def verified(self, model: str, version: str, name: str) -> FileState | None:
        """A file the file server may hand out: arrived whole, checksum matched, not removed."""
        f = self._file(model, version, name)
        return f if f is not None and f.verified else None

    def rows(self) -> list[dict[str, Any]]:
        """One row per model version, for `llmgw mirror list` and the file server's listing."""
        out = []
        for model in sorted(self.models):
            for name in sorted(self.models[model]):
                v = self.models[model][name]
                out.append(
                    {
                        "model": model,
                        "version": v.version,
                        "repo": v.repo,
                        "revision": v.revision,
                        "commit": v.commit,
                        "state": v.state,
                        "bytes": v.size,
                        "done": v.done,
                        "error": v.error,
                        "updated_at": v.updated_at,
                        "files": [
                            {
                                "name": f.name,
                                "path": f.path,
                                "size": f.size,
                                "done": f.size if f.verified else f.done,
                                "verified": f.verified,
                                "sha256": f.sha256,
                            }
                            for f in sorted(v.files.values(), key=lambda f: f.name)
                        ],
                    }
                )
        return out
