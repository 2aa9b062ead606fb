"""The console in the reader's language: which language, its messages, and numbers and times in its form.

- :func:`negotiate` picks the language: the person's choice (``user.language_set``, kept on the log
  with them), else the best of the browser's ``Accept-Language``, else English.
- :class:`Catalog` holds every message, read once from ``messages/<lang>/*.json`` (each file flat:
  key → text with ``{name}`` fields). A translator falls back to English, then to the key itself,
  and never raises for a missing field: a page half translated still renders.
- :class:`Formats` writes numbers, percentages, money, sizes and times as the language does (Babel).
- :func:`refusal` shows a refused command in the language: a general sentence for its code
  (``refusals.<code>``) followed by the service's own message, which says exactly what to do.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path

from babel import Locale
from babel.dates import format_datetime, format_time, format_timedelta
from babel.numbers import format_currency, format_percent

from llmgw.events.schema.people import LANGUAGES

__all__ = ["DEFAULT", "LANGUAGES", "Catalog", "Formats", "MessageFileError", "negotiate", "refusal"]

DEFAULT = "en"
MESSAGES = Path(__file__).parent / "messages"
REFUSALS = "refusals."  # a refusal code's general sentence is the message refusals.<code>
_FIELD = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_TAG = re.compile(r"^[A-Za-z]{1,8}(-[A-Za-z0-9]{1,8})*$|^\*$")

Translator = Callable[..., str]


class MessageFileError(ValueError):
    """A message file that cannot be used: not a flat JSON map of text, or a key another file defines too."""


def negotiate(person_language: str, accept_language: str) -> str:
    """The language to show: the person's choice when it is one of LANGUAGES, else the best language of
    an ``Accept-Language`` header (``de-DE,de;q=0.9,en;q=0.8``) that the console speaks, else English.
    A malformed header counts as none."""
    if person_language in LANGUAGES:
        return person_language
    best, best_q = DEFAULT, 0.0
    for part in accept_language.split(",")[:32]:  # bounded: a header is client input
        tag, _, params = part.strip().partition(";")
        tag = tag.strip()
        if not _TAG.match(tag):
            continue
        q = 1.0
        for param in params.split(";"):
            name, _, value = param.strip().partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        if not 0.0 < q <= 1.0:
            continue
        primary = tag.split("-")[0].lower()
        if primary in LANGUAGES and q > best_q:  # of equal weights, the first listed wins
            best, best_q = primary, q
    return best


class Catalog:
    """Every message of every language, read once from ``root/<lang>/*.json``.

    Raises :class:`MessageFileError` at load for a file that is not a flat map of text, or a key defined
    in two files of one language (naming both)."""

    def __init__(self, root: Path = MESSAGES) -> None:
        self.messages: dict[str, dict[str, str]] = {lang: {} for lang in LANGUAGES}
        for lang in LANGUAGES:
            where: dict[str, Path] = {}
            for path in sorted((root / lang).glob("*.json")):
                for key, text in _read(path).items():
                    if key in where:
                        raise MessageFileError(
                            f"message {key!r} of language {lang} is defined in both {where[key]} and {path}: "
                            "keep it in one file (each page area owns keys starting with its name)"
                        )
                    where[key] = path
                    self.messages[lang][key] = text

    @classmethod
    def load(cls, root: Path = MESSAGES) -> Catalog:
        """The catalog of ``root`` (by default the console's own messages)."""
        return cls(root)

    def text(self, lang: str, key: str) -> str | None:
        """The message ``key`` in ``lang`` itself (no fallback), or None."""
        return self.messages.get(lang, {}).get(key)

    def translator(self, lang: str) -> Translator:
        """``t(key, **fields)``: the message in ``lang``, else in English, else the key; ``{name}`` fields
        filled, a field not given left as ``{name}``."""
        own = self.messages.get(lang, {})
        english = self.messages.get(DEFAULT, {})

        def t(key: str, /, **fields: object) -> str:
            text = own.get(key)
            if text is None:
                text = english.get(key, key)
            return fill(text, fields) if fields else text

        return t

    def refusal(self, lang: str, code: str | None, message: str) -> str:
        """A refusal in ``lang``: the code's general sentence followed by the original message when ``lang``
        has one for the code (or its family: ``invalid_label`` → ``invalid``), else the message as it is."""
        general = None
        while code and general is None:  # a code without a sentence of its own takes its family's (invalid_x → invalid)
            general = self.text(lang, REFUSALS + code)
            code = code.rpartition("_")[0]
        if general is None:
            return message
        return f"{general} — {message}" if message else general


def fill(text: str, fields: Mapping[str, object]) -> str:
    """``text`` with each ``{name}`` given in ``fields`` replaced; the others stay as they are."""

    def one(m: re.Match[str]) -> str:
        name = m.group(1)
        return str(fields[name]) if name in fields else m.group(0)

    return _FIELD.sub(one, text)


def _read(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MessageFileError(f"{path} is not readable JSON ({exc}): fix the file") from exc
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise MessageFileError(f"{path} must be one flat JSON object of key → text (no nesting, no numbers)")
    return data


@functools.cache
def default_catalog() -> Catalog:
    """The console's own messages, read at the first call (they ship in the wheel and never change)."""
    return Catalog.load()


def refusal(lang: str, code: str | None, message: str, catalog: Catalog | None = None) -> str:
    """A refused command's text in ``lang`` (see :meth:`Catalog.refusal`), from the console's messages."""
    return (catalog or default_catalog()).refusal(lang, code, message)


UNKNOWN = "?"  # what a value not known reads as, as in the CLI's tables
_DECIMAL_UNITS = (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3))
_BINARY_UNITS = (("TiB", 2.0**40), ("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10))


class Formats:
    """Numbers, percentages, money, sizes and times in the form of ``lang`` (times in UTC, and saying so).
    A value not known (None) reads as ``?`` rather than failing the page."""

    def __init__(self, lang: str) -> None:
        self.lang = lang if lang in LANGUAGES else DEFAULT
        self.locale = _locale(self.lang)
        self._symbols = _symbols(self.lang)

    def number(self, x: float | int | None, digits: int | None = None) -> str:
        """1234.5 → ``1,234.5`` (en) / ``1.234,5`` (de); ``digits`` fixes the decimals shown."""
        if x is None:
            return UNKNOWN
        if digits is None:  # the locale's own: up to three decimals, trailing zeros dropped
            return self._decimal(x, 3, trim=True)
        return self._decimal(x, max(digits, 0))

    def integer(self, n: int | float | None) -> str:
        """1234 → ``1,234`` / ``1.234`` (a float is rounded)."""
        if n is None:
            return UNKNOWN
        return self._decimal(round(n), 0)

    def _decimal(self, x: float | int, digits: int, trim: bool = False) -> str:
        """``x`` grouped by thousands with ``digits`` decimals in the locale's symbols. Python's formatting
        with the symbols swapped: a page formats hundreds of numbers, and Babel's ``format_decimal`` costs
        30-40 µs each (both languages group by three, as its patterns do). A value exactly half-way between
        two shown (0.0005 to three places) may round the other way than Babel would."""
        text = f"{x:,.{digits}f}"
        if trim and "." in text:
            text = text.rstrip("0").rstrip(".")
        return text.translate(self._symbols)

    def percent(self, x: float | None, digits: int = 0) -> str:
        """0.25 → ``25%`` (en) / ``25 %`` (de, with a no-break space); ``digits`` decimals at most."""
        if x is None:
            return UNKNOWN
        if digits <= 0:
            return format_percent(x, locale=self.locale)
        return format_percent(round(x, digits + 2), locale=self.locale, decimal_quantization=False)

    def usd(self, x: float | None) -> str:
        """Dollars: ``$1,234.50`` / ``1.234,50 $``; a price per token keeps its small decimals (``$0.00042``)."""
        if x is None:
            return UNKNOWN
        return format_currency(round(x, 8), "USD", locale=self.locale, decimal_quantization=False)

    def bytes(self, n: int | float | None, binary: bool = False) -> str:
        """A size as the CLI says it: decimal units by default (``1.5 GB``, as the mirror's files), binary
        with ``binary=True`` (``15.6 GiB``, as a node's memory in `ctl nodes`); ``?`` when unknown."""
        if n is None:
            return UNKNOWN
        for unit, size in _BINARY_UNITS if binary else _DECIMAL_UNITS:
            if abs(n) >= size:
                return f"{self.number(n / size, digits=1)} {unit}"
        return f"{self.integer(n)} B"

    def datetime(self, dt: datetime | str | None) -> str:
        """A moment, medium length, in UTC and saying so: ``Dec 3, 2026, 3:04:05 PM UTC`` /
        ``03.12.2026, 15:04:05 UTC``. Also an ISO string, as the read models keep moments."""
        dt = _moment(dt)
        if dt is None:
            return UNKNOWN
        return f"{format_datetime(_utc(dt), 'medium', tzinfo=UTC, locale=self.locale)} UTC"

    def time(self, dt: datetime | str | None) -> str:
        """The time of day in UTC: ``3:04:05 PM UTC`` / ``15:04:05 UTC``."""
        dt = _moment(dt)
        if dt is None:
            return UNKNOWN
        return f"{format_time(_utc(dt), 'medium', tzinfo=UTC, locale=self.locale)} UTC"

    def ago(self, dt: datetime | str | None, now: datetime | None = None) -> str:
        """How long before ``now`` (default: this moment): ``3 minutes ago`` / ``vor 3 Minuten``. A moment
        a little ahead (clocks differ) reads as a second ago."""
        dt = _moment(dt)
        if dt is None:
            return UNKNOWN
        now = _utc(now) if now is not None else datetime.now(UTC)
        delta = max(now - _utc(dt), timedelta(seconds=1))
        return format_timedelta(-delta, add_direction=True, locale=self.locale)


@functools.cache
def _locale(lang: str) -> Locale:
    return Locale.parse(lang)


@functools.cache
def _symbols(lang: str) -> dict[int, str]:
    """Python's ``,`` and ``.`` as the language writes them (``.`` and ``,`` in German)."""
    symbols = _locale(lang).number_symbols["latn"]
    return str.maketrans({",": symbols["group"], ".": symbols["decimal"]})


def _moment(dt: datetime | str | None) -> datetime | None:
    """A moment given as a datetime or an ISO string; None when it is neither (shown as unknown)."""
    if isinstance(dt, str):
        try:
            return datetime.fromisoformat(dt)
        except ValueError:
            return None
    return dt if isinstance(dt, datetime) else None


def _utc(dt: datetime) -> datetime:
    """``dt`` in UTC; a naive moment is taken to be UTC already (as the log writes them)."""
    return dt.replace(tzinfo=UTC) if dt.tzinfo is None else dt.astimezone(UTC)
