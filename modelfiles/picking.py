"""Picking a repository's GGUF file set for ``ctl model serve OWNER/REPO [--quant Q] [--file F]``
(SPEC MIR-3). Pure: it is given the repository's file list (names and sizes) and answers one set.

A set is one ``.gguf`` file, or the shards of a split one (llama.cpp's gguf-split naming,
``name-00001-of-00003.gguf``, loaded from its first shard). Vision projectors (``mmproj``) and
importance matrices (``imatrix``) are GGUF files but not models, so they are never candidates.
A quant matches case-insensitively, as the quant named in the set's path or as a whole word of it
(so ``Q4_K`` does not match ``Q4_K_M``); among matches the fewest shards win, because a repository
that has a quant both joined and split is one download to verify rather than several. A quant the
repository lacks is refused with what it has.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import msgspec

# Asked for nothing, these are tried in turn: a good size/quality balance first, then bigger.
DEFAULT_QUANTS = ("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q5_K_S", "Q6_K", "Q8_0")
NOT_MODELS = ("mmproj", "imatrix")
MAX_NAME_PART = 96  # Hugging Face's limit on an owner or repository name
_LISTED = 30  # how many sets an error lists before "and N more"

_PART = re.compile(r"[A-Za-z0-9._-]+")
_SHARD = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
# A quant label as written in file names: Q4_K_M, IQ2_XXS, Q8_0, UD-Q4_K_XL, BF16, F16, MXFP4_MOE...
_QUANT = re.compile(
    r"(?<![A-Za-z0-9])((?:UD-)?(?:I?Q\d(?:_[A-Za-z0-9]+)*|BF16|FP16|FP32|F16|F32|MXFP4(?:_MOE)?|TQ[12]_0))"
    r"(?![A-Za-z0-9])",
    re.IGNORECASE,
)


class PickError(ValueError):
    """The repository name, or what it holds, does not give a GGUF set; the message says what to do."""


class RepoFile(msgspec.Struct, frozen=True):
    path: str  # within the repository, "/"-separated
    size: int = 0  # bytes
    sha256: str | None = None  # as the registry published it, to verify the download against


class GGUFSet(msgspec.Struct, frozen=True, kw_only=True):
    name: str  # the single file, or the first shard (what llama.cpp is given)
    files: tuple[RepoFile, ...]  # shards in order
    size: int  # bytes, all files
    shards: int  # how many files the set should have
    quant: str | None  # as named in the path, upper-cased; None when the path names none
    missing: tuple[int, ...] = ()  # shard numbers a split set lacks

    @property
    def complete(self) -> bool:
        return not self.missing

    def files_text(self) -> str:
        return self.name if self.shards == 1 else f"{self.name}, {self.shards} shards"

    def describe(self) -> str:
        return f"{self.quant} ({self.files_text()})" if self.quant else self.files_text()


class Pick(msgspec.Struct, frozen=True, kw_only=True):
    repo: str
    set: GGUFSet
    reason: str  # why this set, for the job's step line
    available: tuple[str, ...]  # every model set the repository has, described


def validate_repo_id(repo: str) -> str:
    """``repo`` if it is ``OWNER/NAME``, else :class:`PickError` saying what is allowed.

    Strict because the name becomes a path in the mirror: ``../x`` must not walk out of it.
    """
    rule = (
        "a repository is OWNER/NAME: two parts, each of letters, digits, '.', '_' and '-', "
        f"not starting with '.' or '-', without '..', at most {MAX_NAME_PART} characters"
    )
    if not isinstance(repo, str) or not repo:
        raise PickError(f"no repository named; {rule}")
    parts = repo.split("/")
    if len(parts) != 2:
        raise PickError(f"{repo!r} has {len(parts)} parts; {rule}")
    for part in parts:
        if not part:
            raise PickError(f"{repo!r} has an empty part; {rule}")
        if not _PART.fullmatch(part):
            bad = sorted({c for c in part if not _PART.fullmatch(c)})
            raise PickError(f"{repo!r} contains {', '.join(map(repr, bad))}; {rule}")
        if part[0] in ".-":
            raise PickError(f"{repo!r}: {part!r} starts with {part[0]!r}; {rule}")
        if ".." in part:
            raise PickError(f"{repo!r}: {part!r} contains '..'; {rule}")
        if len(part) > MAX_NAME_PART:
            raise PickError(f"{repo!r}: {part[:20]!r}... is {len(part)} characters; {rule}")
    return repo


def quant_of(path: str) -> str | None:
    """The quant a GGUF path names (the last one in it, upper-cased), e.g. ``Q4_K_M``; None if none."""
    found = _QUANT.findall(path)
    return found[-1].upper() if found else None


def is_model_gguf(path: str) -> bool:
    low = path.lower()
    return low.endswith(".gguf") and not any(word in low for word in NOT_MODELS)


def gguf_sets(files: Iterable[RepoFile]) -> list[GGUFSet]:
    """The repository's model GGUF sets (projectors and imatrices left out), incomplete ones included."""
    singles: list[GGUFSet] = []
    split: dict[tuple[str, int], dict[int, RepoFile]] = {}
    for f in files:
        if not is_model_gguf(f.path):
            continue
        m = _SHARD.match(f.path)
        if m and 1 <= int(m["no"]) <= int(m["count"]):
            split.setdefault((m["prefix"], int(m["count"])), {})[int(m["no"])] = f
        else:
            singles.append(GGUFSet(name=f.path, files=(f,), size=f.size, shards=1, quant=quant_of(f.path)))
    sets = list(singles)
    for (prefix, count), shards in split.items():
        ordered = tuple(shards[n] for n in sorted(shards))
        first = shards.get(1)
        sets.append(
            GGUFSet(
                name=first.path if first else f"{prefix}-00001-of-{count:05d}.gguf",
                files=ordered,
                size=sum(f.size for f in ordered),
                shards=count,
                quant=quant_of(prefix),
                missing=tuple(n for n in range(1, count + 1) if n not in shards),
            )
        )
    return sorted(sets, key=lambda s: s.name)


def _matches(quant: str, sets: list[GGUFSet]) -> list[GGUFSet]:
    """Sets whose named quant is ``quant``; else those with ``quant`` as a whole word of their path."""
    q = quant.upper()
    exact = [s for s in sets if s.quant == q]
    if exact:
        return exact
    word = re.compile(rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9_])", re.IGNORECASE)
    return [s for s in sets if any(word.search(f.path) for f in s.files) or word.search(s.name)]


def _listing(sets: list[GGUFSet]) -> str:
    shown = [s.describe() for s in sets[:_LISTED]]
    more = f", and {len(sets) - _LISTED} more" if len(sets) > _LISTED else ""
    return ", ".join(shown) + more


def _fewest_shards(repo: str, what: str, found: list[GGUFSet]) -> GGUFSet:
    """The match with the fewest shards; a tie is refused rather than guessed."""
    complete = [s for s in found if s.complete]
    if not complete:
        s = found[0]
        raise PickError(
            f"{repo}: {what} is only here as an incomplete split set: {s.name} lacks shard(s) "
            f"{', '.join(f'{n:05d}' for n in s.missing)} of {s.shards:05d}"
        )
    fewest = min(s.shards for s in complete)
    best = [s for s in complete if s.shards == fewest]
    if len(best) > 1:
        raise PickError(f"{repo}: several GGUF sets match {what}: {_listing(best)}; choose one with --file")
    return best[0]


def pick_gguf(repo: str, files: Iterable[RepoFile], *, quant: str | None = None, file: str | None = None) -> Pick:
    """The GGUF set to serve from ``repo``: the set holding ``file`` when given (the whole split set
    for a shard), else the fewest-shards set matching ``quant``, else the first of
    :data:`DEFAULT_QUANTS` present, else the smallest set (single files before split ones)."""
    validate_repo_id(repo)
    files = list(files)
    sets = gguf_sets(files)
    whole = [s for s in sets if s.complete]
    available = tuple(s.describe() for s in whole)
    if not sets:
        gguf = [f.path for f in files if f.path.lower().endswith(".gguf")]
        if gguf:
            raise PickError(
                f"{repo} has no model GGUF file, only vision projectors or importance matrices: "
                f"{', '.join(gguf[:_LISTED])}"
            )
        found = ", ".join(f.path for f in files[:_LISTED]) or "nothing"
        raise PickError(
            f"{repo} has no GGUF files; the nodes run llama.cpp, which needs one (found: {found}"
            f"{f', and {len(files) - _LISTED} more' if len(files) > _LISTED else ''})"
        )

    if file:
        chosen = _by_file(repo, file, files, sets)
        if quant and chosen not in _matches(quant, [chosen]):
            raise PickError(
                f"{repo}: --file {file} is {chosen.quant or 'of no named quant'}, not the {quant} asked for; "
                "give one or the other"
            )
        return Pick(repo=repo, set=chosen, reason=f"--file {file}: {chosen.files_text()}", available=available)

    if quant:
        found = _matches(quant, sets)
        if not found:
            raise PickError(f"{repo} has no {quant.upper()} GGUF; it has: {_listing(whole) or 'no complete set'}")
        chosen = _fewest_shards(repo, quant.upper(), found)
        return Pick(
            repo=repo, set=chosen, reason=f"--quant {quant.upper()}: {chosen.files_text()}", available=available
        )

    for q in DEFAULT_QUANTS:
        found = [s for s in _matches(q, sets) if s.complete]
        if found:
            chosen = _fewest_shards(repo, q, found)
            return Pick(repo=repo, set=chosen, reason=f"default quant {q}: {chosen.files_text()}", available=available)
    if not whole:
        raise PickError(f"{repo} has only incomplete split GGUF sets: {_listing(sets)}")
    chosen = min(whole, key=lambda s: (s.shards, s.size, s.name))
    return Pick(
        repo=repo,
        set=chosen,
        reason=f"none of {', '.join(DEFAULT_QUANTS)} here; the smallest set: {chosen.describe()}",
        available=available,
    )


def _by_file(repo: str, file: str, files: list[RepoFile], sets: list[GGUFSet]) -> GGUFSet:
    want = file.removeprefix("./")
    paths = {f.path for f in files}
    if want not in paths:
        # Forgiving only where unambiguous: the case, or the bare name of a file in a quant folder.
        by_case = [p for p in paths if p.lower() == want.lower()]
        by_name = [p for p in paths if p.rsplit("/", 1)[-1].lower() == want.lower()]
        hits = by_case or by_name
        if len(hits) > 1:
            raise PickError(f"{repo}: --file {file} names several files: {', '.join(sorted(hits))}; give its path")
        if not hits:
            listed = [s.describe() for s in sets[:_LISTED]]
            raise PickError(f"{repo} has no file {file}; its GGUF sets: {', '.join(listed)}")
        want = hits[0]
    if not want.lower().endswith(".gguf"):
        raise PickError(f"{repo}: --file {want} is not a GGUF file; the nodes run llama.cpp, which needs one")
    if not is_model_gguf(want):
        raise PickError(f"{repo}: --file {want} is a vision projector or importance matrix, not a model")
    chosen = next(s for s in sets if any(f.path == want for f in s.files))
    if not chosen.complete:
        raise PickError(
            f"{repo}: {want} is a shard of {chosen.name}, which lacks shard(s) "
            f"{', '.join(f'{n:05d}' for n in chosen.missing)} of {chosen.shards:05d}"
        )
    return chosen
