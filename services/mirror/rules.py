"""The mirror's rules (SPEC MIR-1): pure decisions over what the hub published and what the mirror holds.

The service gathers first (asks the hub about the repository, reads the disk's room: :class:`Asked`),
then :func:`decide` decides purely on that and the folded state (:class:`Facts`).

What is refused is refused before a byte is downloaded, with what to do instead: a name that is not
``owner/name``, a gated repository without a token, pickled weights without ``allow_pickle``,
files the repository does not have, a fetch the disk cannot hold.
"""

from __future__ import annotations

import re
from datetime import datetime

import msgspec

from llmgw.events.commands.shell import Decision
from llmgw.events.folds.mirror import FETCHING, MirrorState, VersionState
from llmgw.events.schema import mirror as E
from llmgw.events.schema.outcomes import Rejected
from llmgw.events.schema.subjects import event_subject

_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_MODEL = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,254}$")
VERSION_LEN = 8  # a commit's first 8 hex digits: short to type, and a repository has few commits


class HubEntry(msgspec.Struct, frozen=True, kw_only=True):
    path: str
    size: int | None = None
    sha256: str | None = None
    blob_id: str | None = None


class HubInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A repository at one revision, as the hub describes it."""

    repo: str
    commit: str
    gated: str | None = None  # "manual" or "auto" when the hub asks for approval
    files: list[HubEntry] = []


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    version: str
    files: list[E.MirrorFile] = []
    message: str
    already: bool = False  # nothing to download: held already, or being fetched


def human(n: int | float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def check_repo(repo: str) -> str:
    """``owner/name``, trimmed; anything else (``../x``, ``a/b/c``) is refused before it reaches a URL."""
    cleaned = repo.strip().strip("/")
    if not _REPO.match(cleaned) or ".." in cleaned:
        raise Rejected(
            f"{repo!r} is not a repository; it looks like owner/name (e.g. Qwen/Qwen2.5-0.5B-Instruct-GGUF)",
            "invalid_repo",
        )
    return cleaned


def check_model(name: str) -> str:
    if not _MODEL.match(name):
        raise Rejected(
            f"model name {name!r} is not allowed: lower-case letters, digits, '.', '_' and '-', "
            "starting with a letter or digit, at most 64 characters",
            "invalid_name",
        )
    return name


def valid_name(name: str) -> bool:
    """A model, version or file name the mirror could hold (the file server refuses anything else)."""
    return bool(_FILE.match(name)) and ".." not in name


def short_version(commit: str) -> str:
    return commit[:VERSION_LEN].lower()


def is_pickled(path: str) -> bool:
    return path.lower().endswith(E.PICKLE_SUFFIXES)


def _listing(paths: list[str], limit: int = 20) -> str:
    shown = ", ".join(paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "") if paths else "no files"


def _choose(cmd: E.MirrorFetch, info: HubInfo) -> list[HubEntry]:
    if not cmd.files:
        if not info.files:
            raise Rejected(f"{info.repo} at {cmd.revision} has no files", "no_files")
        return list(info.files)
    by_path = {e.path: e for e in info.files}
    chosen, missing = [], []
    for wanted in dict.fromkeys(cmd.files):
        entry = by_path.get(wanted)
        if entry is None:
            missing.append(wanted)
        else:
            chosen.append(entry)
    if missing:
        raise Rejected(
            f"{info.repo} at {cmd.revision} has no {', '.join(missing)}; it has: {_listing(sorted(by_path))}",
            "no_such_file",
        )
    return chosen


def plan_fetch(state: MirrorState, cmd: E.MirrorFetch, info: HubInfo, *, has_token: bool, free_bytes: int) -> Plan:
    """What a fetch downloads into MODEL/VERSION, or why it is refused."""
    model = check_model(cmd.model)
    if info.gated and not has_token:
        raise Rejected(
            f"{info.repo} is gated on the hub ({info.gated} approval): accept its terms and configure a token "
            "(HF_TOKEN), or choose another repository",
            "gated",
        )
    entries = _choose(cmd, info)
    pickled = [e.path for e in entries if is_pickled(e.path)]
    if pickled and not cmd.allow_pickle:
        raise Rejected(
            f"{info.repo} has pickled weights ({_listing(pickled)}), which can run code when they are loaded: "
            "fetch other files (--file, e.g. the .safetensors or .gguf ones), or pass --allow-pickle if you "
            f"trust {info.repo.split('/')[0]}",
            "pickle",
        )
    files: list[E.MirrorFile] = []
    seen: dict[str, str] = {}
    for e in entries:
        name = e.path.rsplit("/", 1)[-1]
        if not valid_name(name):
            raise Rejected(
                f"{e.path}: the mirror keeps files under names of letters, digits and '._+-' only", "invalid_file"
            )
        if name in seen:
            raise Rejected(
                f"{seen[name]} and {e.path} would both be {model}/…/{name}: fetch them into different models",
                "invalid_file",
            )
        seen[name] = e.path
        if e.size is None or (e.sha256 is None and e.blob_id is None):
            raise Rejected(
                f"the hub published no size or checksum for {e.path}, so it cannot be verified", "unverified"
            )
        files.append(E.MirrorFile(path=e.path, name=name, size=e.size, sha256=e.sha256, blob_id=e.blob_id))
    version = short_version(info.commit)
    held = state.version(model, version)
    if held is not None and held.commit != info.commit:
        raise Rejected(
            f"{model}/{version} holds commit {held.commit}, and {info.repo} at {cmd.revision} is {info.commit}: "
            "fetch it into another model name",
            "conflict",
        )
    wanted = [f for f in files if held is None or not (held.files.get(f.name) and held.files[f.name].verified)]
    if not wanted:
        return Plan(version=version, already=True, message=f"{model}/{version} is already held ({len(files)} files)")
    if held is not None and held.state == FETCHING:
        if {f.name for f in wanted} <= set(held.fetch_files):
            return Plan(version=version, already=True, message=f"{model}/{version} is already being fetched")
        raise Rejected(
            f"{model}/{version} is being fetched; fetch the other files once it ends (`llmgw mirror list`)", "busy"
        )
    need = sum(f.size for f in wanted)
    if need > free_bytes:
        raise Rejected(
            f"{model}/{version} needs {human(need)} and the mirror has {human(max(free_bytes, 0))} free: "
            "remove what is no longer used (`llmgw mirror remove MODEL[/VERSION]`) or give the mirror more room",
            "disk_full",
        )
    return Plan(
        version=version,
        files=wanted,
        message=f"fetching {len(wanted)} file(s), {human(need)}, of {info.repo} at {info.commit[:12]} "
        f"({cmd.revision}) into {model}/{version}",
    )


class Asked(msgspec.Struct, frozen=True, kw_only=True):
    """What a fetch's decision needs from outside the log, gathered before deciding: the hub's answer
    about the repository and the room on the mirror's disk."""

    fetch: E.MirrorFetch  # the command, its repository and revision as cleaned (check_repo) before asking
    info: HubInfo
    free_bytes: int  # free on the disk now (what fetches under way will still write is taken off when deciding)
    has_token: bool  # a hub token is configured
    hub: str  # the hub as it may be shown: never the credentials an endpoint URL may carry


class Facts(msgspec.Struct, frozen=True, kw_only=True):
    """What the mirror decides on: what it holds (the fold), and for a fetch what the hub and disk said."""

    state: MirrorState
    asked: Asked | None = None


class Preflight(msgspec.Struct, frozen=True, kw_only=True):
    """A gated repository's first file, to ask the hub for (HEAD) before a fetch is promised: a token is
    configured, but has its owner accepted the terms?"""

    repo: str
    commit: str
    path: str


def reserved(state: MirrorState) -> int:
    """Bytes that fetches under way will still write: promised already, so not free."""
    return sum(max(f.size - f.done, 0) for v in state.fetching() for f in v.files.values() if not f.verified)


def decide(facts: Facts, command: E.MirrorCommand, now: datetime) -> Decision:
    """Pure: a fetch or a removal over what the mirror holds (and what was asked) → its :class:`Decision`."""
    if isinstance(command, E.MirrorFetch):
        assert facts.asked is not None, "a fetch is decided on what the hub said"
        return decide_fetch(facts.state, facts.asked)
    return decide_remove(facts.state, command)


def decide_fetch(state: MirrorState, asked: Asked) -> Decision:
    cmd, info = asked.fetch, asked.info
    model = cmd.model
    plan = plan_fetch(state, cmd, info, has_token=asked.has_token, free_bytes=asked.free_bytes - reserved(state))
    result = {"model": model, "version": plan.version, "commit": info.commit}
    if plan.already:
        held = state.version(model, plan.version)
        return Decision(message=plan.message, result={**result, "state": held.state if held else FETCHING})
    started = E.FetchStarted(
        version=plan.version,
        repo=cmd.repo,
        revision=cmd.revision,
        commit=info.commit,
        files=plan.files,
        hub=asked.hub,
    )
    return Decision(
        subject=event_subject(E.AGGREGATE, model),
        payloads=[started],
        message=plan.message,
        result={**result, "state": FETCHING, "files": len(plan.files), "bytes": sum(f.size for f in plan.files)},
        confirm=Preflight(repo=cmd.repo, commit=info.commit, path=plan.files[0].path) if info.gated else None,
    )


def targets(state: MirrorState, p: E.MirrorRemove) -> list[VersionState]:
    """The versions a removal removes, or why there is nothing to remove."""
    versions = state.models.get(p.model)
    if not versions:
        held = ", ".join(sorted(state.models)) or "nothing"
        raise Rejected(f"the mirror holds no model {p.model!r} (it holds: {held})", "not_found")
    if p.version is not None and p.version not in versions:
        raise Rejected(
            f"the mirror holds no {p.model}/{p.version}; versions of {p.model}: {', '.join(sorted(versions))}",
            "not_found",
        )
    return [versions[p.version]] if p.version is not None else list(versions.values())


def decide_remove(state: MirrorState, p: E.MirrorRemove) -> Decision:
    removed = targets(state, p)
    what = f"{p.model}/{p.version}" if p.version else f"{p.model} ({', '.join(v.version for v in removed)})"
    files = sum(len(v.files) for v in removed)
    size = sum(v.size for v in removed)
    return Decision(
        subject=event_subject(E.AGGREGATE, p.model),
        payloads=[E.MirrorRemoved(version=p.version)],
        message=f"removed {what} from the mirror: {files} file(s), {human(size)}",
        result={"model": p.model, "versions": [v.version for v in removed]},
    )


def should_report(
    done: int, size: int, last_done: int, last_at: float, now: float, *, interval_s: float = 1.0, step: float = 0.05
) -> bool:
    """Progress goes on the log once a second or every 5 %, whichever comes first; never per chunk."""
    if done <= last_done or done >= size:
        return False  # the end is `file_verified`
    return now - last_at >= interval_s or done - last_done >= step * size
