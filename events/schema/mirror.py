"""The mirror: model weights fetched from a Hugging Face–compatible hub, verified, served (SPEC MIR-1, MIR-2).

One aggregate per mirrored model (``llmgw.evt.mirror.<model>``); each event names the version it
is about (the repository's commit, short), so a model's versions share one ordered history. A
fetch is ``fetch_started`` (everything it will download, with the sizes and checksums the hub
published), then per file progress and ``file_verified``, then ``fetch_completed`` or
``fetch_failed``. ``removed`` is a tombstone: what it names stays gone, and a peer mirror kept in
step (MIR-4) reads it so it does not copy the files back.
"""

from __future__ import annotations

import msgspec

from llmgw.events.schema.registry import EventType
from llmgw.events.schema.subjects import TELEMETRY_ROOT, encode_token

AGGREGATE = "mirror"
SERVICE = "mirror"

# Formats that unpickle on load, i.e. can run code: refused unless the fetch says allow_pickle.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


class MirrorFile(msgspec.Struct, frozen=True, kw_only=True):
    """One file of a fetch, as the hub published it."""

    path: str  # in the repository, e.g. "Q4_K_M/model-00001-of-00002.gguf"
    name: str  # on the mirror: MODEL/VERSION/<name>, the path's last element
    size: int
    sha256: str | None = None  # published for LFS files
    blob_id: str | None = None  # the git blob id (sha1), the only checksum the hub publishes for small files


class FetchStarted(msgspec.Struct, frozen=True, kw_only=True):
    version: str
    repo: str
    revision: str  # as asked: a branch, tag or commit
    commit: str  # what it resolved to; every file is fetched at this commit
    files: list[MirrorFile]
    hub: str = ""


class FileProgress(msgspec.Struct, frozen=True, kw_only=True):
    """Written by earlier releases as a durable event; progress is telemetry now (:class:`DownloadProgress`)."""

    version: str
    file: str
    done: int
    size: int


class DownloadProgress(msgspec.Struct, frozen=True, kw_only=True):
    """Telemetry, not an event: bytes of one file on disk, on :func:`progress_subject` about twice a
    second while it downloads (a person watching `mirror fetch` or `ctl model serve` sees a bar move;
    the log keeps only what lasts: the file verified)."""

    model: str
    version: str
    file: str
    done: int
    size: int
    at: float  # epoch seconds, for the watcher's rate


PROGRESS_ROOT = f"{TELEMETRY_ROOT}.mirror"


def progress_subject(model: str) -> str:
    return f"{PROGRESS_ROOT}.{encode_token(model)}"


class FileVerified(msgspec.Struct, frozen=True, kw_only=True):
    version: str
    file: str
    size: int
    sha256: str
    resumed_from: int = 0  # bytes already on disk from an earlier attempt


class FetchCompleted(msgspec.Struct, frozen=True, kw_only=True):
    version: str
    files: int
    bytes: int
    downloaded: int  # bytes that crossed the network this time (less than `bytes` after a resume)
    seconds: float


class FetchFailed(msgspec.Struct, frozen=True, kw_only=True):
    version: str
    reason: str
    file: str | None = None
    code: str = "failed"  # checksum, disk_full, network, refused, internal


class MirrorRemoved(msgspec.Struct, frozen=True, kw_only=True):
    """A tombstone: every version of the model, or the one named, is gone from the mirror."""

    version: str | None = None


class PeerFileCopied(msgspec.Struct, frozen=True, kw_only=True):
    """A peer mirror (MIR-4) copied one file from its primary and its sha256 matched the primary's."""

    model: str
    version: str
    file: str
    size: int
    sha256: str
    source: str  # the primary's file server
    resumed_from: int = 0


class PeerCopyFailed(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    version: str
    file: str
    reason: str
    code: str = "failed"  # checksum, network, refused, disk_full


class PeerFileDeleted(msgspec.Struct, frozen=True, kw_only=True):
    """A peer deleted its copy: the primary's ``removed`` tombstone names it."""

    model: str
    version: str
    file: str


PEER_AGGREGATE = "mirror_peer"  # llmgw.evt.mirror_peer.<peer name>: outside mirror.>, so no mirror reads it as a fetch

EVENTS = (
    EventType(
        "mirror.fetch_started",
        1,
        FetchStarted,
        "The mirror began fetching a model version: the commit, and each file with its published size and checksum.",
    ),
    EventType(
        "mirror.file_progress",
        1,
        FileProgress,
        "Bytes of one file on disk (written by earlier releases; progress is telemetry now, not an event).",
    ),
    EventType(
        "mirror.file_verified", 1, FileVerified, "A file arrived whole and its checksum matches what the hub published."
    ),
    EventType("mirror.fetch_completed", 1, FetchCompleted, "Every file of a fetch is verified and served."),
    EventType("mirror.fetch_failed", 1, FetchFailed, "A fetch stopped, with a reason a person can act on."),
    EventType("mirror.removed", 1, MirrorRemoved, "A model, or one of its versions, was deleted from the mirror."),
    EventType(
        "mirror_peer.file_copied",
        1,
        PeerFileCopied,
        "A peer mirror copied a file from its primary; the bytes' sha256 matched the one the primary verified.",
    ),
    EventType(
        "mirror_peer.copy_failed",
        1,
        PeerCopyFailed,
        "A peer mirror could not copy a file (a checksum mismatch is deleted, never served).",
    ),
    EventType(
        "mirror_peer.file_deleted", 1, PeerFileDeleted, "A peer mirror deleted its copy after a `mirror.removed`."
    ),
)


# -- commands ----------------------------------------------------------------------------------


class MirrorFetch(msgspec.Struct, frozen=True, kw_only=True, tag="fetch", forbid_unknown_fields=True):
    model: str
    repo: str
    revision: str = "main"
    files: list[str] | None = None  # paths in the repository; all of them when left out
    allow_pickle: bool = False


class MirrorRemove(msgspec.Struct, frozen=True, kw_only=True, tag="remove", forbid_unknown_fields=True):
    model: str
    version: str | None = None


MirrorCommand = MirrorFetch | MirrorRemove
