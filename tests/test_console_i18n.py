"""The console in the reader's language (issue 24, item 7): which language, the messages and their
fallbacks, numbers and times in the language's form, and a refusal shown by its code in the language.

The codes a refusal can carry are found in the code itself (by AST), so a new code without a German
sentence fails here by name. The gateway's OpenAI-style error codes (services/router/admission.py) are
not among them: they answer API clients of the gateway and never reach the console, whose refusals
are command outcomes (services/api/act.py) and sign-in refusals (services/api/signin.py).
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from llmgw.services.api.act import STATUS_OF_CODE
from llmgw.services.console import i18n
from llmgw.services.console.i18n import Catalog, Formats, MessageFileError, negotiate

ROOT = Path(__file__).resolve().parent.parent
# The package's rooms (docs/architecture.md §1); tests are not the system.
ROOMS = ("events", "infra", "projections", "services", "agent", "modelfiles", "cli", "bench")


def _python_files() -> Iterator[Path]:
    for room in ROOMS:
        yield from sorted((ROOT / room).rglob("*.py"))


def _code_argument(call: ast.Call) -> ast.expr | None:
    """The refusal code a call passes: ``Rejected(reason, code)``, ``Refused(status, code, message)``,
    ``CommandRejected(..., code=…)`` or ``Outcome(..., code=…)``; None when it passes none."""
    name = call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", None)
    if name not in ("Rejected", "Refused", "CommandRejected", "Outcome"):
        return None
    for keyword in call.keywords:
        if keyword.arg == "code":
            return keyword.value
    if name in ("Rejected", "Refused") and len(call.args) >= 2:
        return call.args[1]
    if name == "Rejected":
        return ast.Constant("rejected")  # Rejected's default code
    return None


def refusal_codes() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(code → where it is refused with, family → where an f-string code of that family is made).

    A code made by an f-string (``f"invalid_{what}"``) is known only by its family (``invalid``), which
    the console falls back to; a code passed on from a variable was made elsewhere and is found there."""
    codes: dict[str, list[str]] = {code: ["services/api/act.py STATUS_OF_CODE"] for code in STATUS_OF_CODE}
    families: dict[str, list[str]] = {}
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            arg = _code_argument(node)
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                codes.setdefault(arg.value, []).append(where)
            elif isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
                family = str(arg.values[0].value).rstrip("_")
                families.setdefault(family, []).append(where)
    return codes, families


def test_every_code_the_system_refuses_with_has_a_german_sentence() -> None:
    catalog = Catalog.load()
    codes, families = refusal_codes()
    missing = {code: where for code, where in codes.items() if catalog.text("de", f"refusals.{code}") is None}
    missing |= {
        f"{family}_*": where for family, where in families.items() if catalog.text("de", f"refusals.{family}") is None
    }
    assert not missing, "refusal codes without a German sentence in services/console/messages/de/refusals.json:\n" + (
        "\n".join(f"  refusals.{code}  (refused at {', '.join(where[:3])})" for code, where in sorted(missing.items()))
    )


def test_the_search_for_refusal_codes_finds_those_of_commands_sign_in_and_acting() -> None:
    codes, families = refusal_codes()
    # One of each kind of place, so that a finder that finds nothing cannot pass the test above.
    assert {"not_found", "invalid_language", "forged_actor"} <= set(codes)  # Rejected in rules and auth
    assert {"invalid_login", "too_many_logins", "user_disabled"} <= set(codes)  # Refused at sign-in
    assert {"internal", "unknown_signer", "timeout", "rejected"} <= set(codes)  # the processor, act(), the default
    assert "invalid" in families  # services/people/rules.py f"invalid_{what}"


def test_every_refusal_sentence_is_in_english_too_so_the_fallback_has_one() -> None:
    en = json.loads((i18n.MESSAGES / "en" / "refusals.json").read_text())
    de = json.loads((i18n.MESSAGES / "de" / "refusals.json").read_text())
    assert sorted(set(de) - set(en)) == []
    assert all(key.startswith("refusals.") for key in [*en, *de])


def test_every_message_file_of_the_console_loads_and_every_german_message_has_an_english_one() -> None:
    catalog = Catalog.load()
    assert sorted(set(catalog.messages["de"]) - set(catalog.messages["en"])) == []


# -- the language ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("person", "header", "shown"),
    [
        ("de", "en-US,en;q=0.9", "de"),  # the person's choice wins over the browser
        ("", "de-DE,de;q=0.9,en;q=0.8", "de"),
        ("", "fr-FR,fr;q=0.9,de;q=0.5,en;q=0.4", "de"),  # the best the console speaks
        ("", "en;q=0.3, de;q=0.7", "de"),  # by weight, not by order
        ("", "de;q=0.5, en;q=0.5", "de"),  # of equal weights, the first
        ("", "de;q=0, en", "en"),  # q=0: not wanted
        ("fr", "fr", "en"),  # neither the choice nor the header is spoken: English
        ("", "", "en"),
        ("", "*", "en"),
        ("", ";;;,,q=x,de;q=abc,<script>", "en"),  # malformed: counts as none, never raises
        ("", "DE-at", "de"),
    ],
)
def test_the_language_is_the_persons_choice_else_the_browsers_best_else_english(
    person: str, header: str, shown: str
) -> None:
    assert negotiate(person, header) == shown


def test_a_very_long_accept_language_header_is_read_in_bounded_time_and_still_answers() -> None:
    assert negotiate("", ",".join(["xx;q=0.9"] * 100_000) + ",de") == "en"  # past the entries read: not seen
    assert negotiate("", "de," + ",".join(["xx"] * 100_000)) == "de"


# -- the catalog and its fallbacks -----------------------------------------------------------------


def write_messages(root: Path, lang: str, name: str, messages: dict[str, object]) -> None:
    (root / lang).mkdir(parents=True, exist_ok=True)
    (root / lang / name).write_text(json.dumps(messages, ensure_ascii=False))


def test_a_message_falls_back_to_english_and_then_to_its_key(tmp_path: Path) -> None:
    write_messages(tmp_path, "en", "nodes.json", {"nodes.title": "Nodes", "nodes.only_en": "Only {what}"})
    write_messages(tmp_path, "de", "nodes.json", {"nodes.title": "Knoten"})
    catalog = Catalog.load(tmp_path)
    de = catalog.translator("de")
    assert de("nodes.title") == "Knoten"
    assert de("nodes.only_en", what="English") == "Only English"
    assert de("nodes.nowhere") == "nodes.nowhere"
    assert catalog.translator("en")("nodes.title") == "Nodes"
    assert catalog.translator("xx")("nodes.title") == "Nodes"  # a language not spoken reads English


def test_a_missing_field_stays_as_it_is_and_nothing_in_a_message_makes_it_raise(tmp_path: Path) -> None:
    write_messages(
        tmp_path,
        "en",
        "core.json",
        {
            "core.hello": "Hello {name}, you have {count} keys",
            "core.odd": "a { stray brace, {0} and {a.b} and {{name}}",
        },
    )
    t = Catalog.load(tmp_path).translator("en")
    assert t("core.hello", name="ann") == "Hello ann, you have {count} keys"
    assert t("core.hello", name="ann", count=3, extra="ignored") == "Hello ann, you have 3 keys"
    assert t("core.odd", name="x", a="y") == "a { stray brace, {0} and {a.b} and {x}"
    assert t("core.hello") == "Hello {name}, you have {count} keys"


def test_a_key_defined_in_two_files_of_one_language_is_refused_at_load_naming_both(tmp_path: Path) -> None:
    write_messages(tmp_path, "de", "nodes.json", {"nodes.cordon": "Absperren"})
    write_messages(tmp_path, "de", "models.json", {"nodes.cordon": "Sperren"})
    with pytest.raises(MessageFileError) as refused:
        Catalog.load(tmp_path)
    assert "nodes.cordon" in str(refused.value)
    assert "de/nodes.json" in str(refused.value) and "de/models.json" in str(refused.value)


def test_the_same_key_in_two_languages_is_no_duplicate(tmp_path: Path) -> None:
    write_messages(tmp_path, "en", "nodes.json", {"nodes.cordon": "Cordon"})
    write_messages(tmp_path, "de", "nodes.json", {"nodes.cordon": "Absperren"})
    assert Catalog.load(tmp_path).translator("de")("nodes.cordon") == "Absperren"


@pytest.mark.parametrize("content", ['{"a": {"nested": "x"}}', '{"a": 1}', "[1, 2]", "{not json"])
def test_a_message_file_that_is_not_a_flat_map_of_text_is_refused_naming_it(tmp_path: Path, content: str) -> None:
    (tmp_path / "en").mkdir()
    (tmp_path / "en" / "broken.json").write_text(content)
    with pytest.raises(MessageFileError, match=r"broken\.json"):
        Catalog.load(tmp_path)


# -- refusals ---------------------------------------------------------------------------------------


def test_a_refusal_is_shown_in_the_language_with_the_services_own_message_after_it() -> None:
    message = "granting viewer of cluster needs cluster-admin of the cluster; dee holds no role"
    assert i18n.refusal("de", "forbidden", message) == f"Dafür fehlt Ihnen die nötige Rolle. — {message}"
    assert i18n.refusal("en", "forbidden", message) == f"You do not hold the role this needs. — {message}"


def test_a_refusal_without_a_sentence_is_its_message_as_it_is_and_a_family_code_takes_its_familys(
    tmp_path: Path,
) -> None:
    write_messages(tmp_path, "en", "refusals.json", {"refusals.invalid": "Not valid."})
    write_messages(tmp_path, "de", "refusals.json", {"refusals.invalid": "Ungültig."})
    catalog = Catalog.load(tmp_path)
    assert catalog.refusal("de", "brand_new_code", "what to do") == "what to do"
    assert catalog.refusal("de", None, "what to do") == "what to do"
    assert catalog.refusal("de", "invalid_display_name", "at most 100") == "Ungültig. — at most 100"
    assert catalog.refusal("de", "invalid", "") == "Ungültig."
    assert i18n.refusal("de", "", "plain") == "plain"


# -- numbers and times --------------------------------------------------------------------------------

AT = datetime(2026, 12, 3, 15, 4, 5, tzinfo=UTC)


def test_numbers_percentages_and_money_are_written_as_each_language_writes_them() -> None:
    en, de = Formats("en"), Formats("de")
    assert (en.number(1234.5), de.number(1234.5)) == ("1,234.5", "1.234,5")
    assert (en.number(2.0, digits=2), de.number(2.0, digits=2)) == ("2.00", "2,00")
    assert (en.integer(1234567), de.integer(1234567)) == ("1,234,567", "1.234.567")
    assert (en.percent(0.25), de.percent(0.25)) == ("25%", "25\xa0%")
    assert (en.percent(0.2555, digits=1), de.percent(0.2555, digits=1)) == ("25.6%", "25,6\xa0%")
    assert (en.usd(1234.5), de.usd(1234.5)) == ("$1,234.50", "1.234,50\xa0$")
    assert en.usd(0.00042) == "$0.00042"  # a price per token keeps its decimals


def test_sizes_are_said_as_the_cli_says_them_decimal_or_binary() -> None:
    en, de = Formats("en"), Formats("de")
    assert (en.bytes(1_500_000_000), de.bytes(1_500_000_000)) == ("1.5 GB", "1,5 GB")  # as the mirror's files
    assert en.bytes(16 * 2**30, binary=True) == "16.0 GiB"  # as a node's memory in `ctl nodes`
    assert (en.bytes(512), en.bytes(None)) == ("512 B", "?")
    assert de.bytes(1234, binary=True) == "1,2 KiB"


def test_times_are_in_utc_in_each_languages_form_and_say_so() -> None:
    en, de = Formats("en"), Formats("de")
    assert en.datetime(AT) == "Dec 3, 2026, 3:04:05\u202fPM UTC"
    assert de.datetime(AT) == "03.12.2026, 15:04:05 UTC"
    # The same moment given in another zone is still shown in UTC.
    assert de.datetime(AT.astimezone(ZoneInfo("Europe/Berlin"))) == "03.12.2026, 15:04:05 UTC"
    assert (en.time(AT), de.time(AT)) == ("3:04:05\u202fPM UTC", "15:04:05 UTC")


def test_how_long_ago_reads_naturally_in_each_language() -> None:
    en, de = Formats("en"), Formats("de")
    then = AT - timedelta(minutes=3)
    assert (en.ago(then, AT), de.ago(then, AT)) == ("3 minutes ago", "vor 3 Minuten")
    assert (en.ago(AT - timedelta(days=2), AT), de.ago(AT - timedelta(days=2), AT)) == ("2 days ago", "vor 2 Tagen")
    assert en.ago(AT + timedelta(seconds=2), AT) == "1 second ago"  # a clock a little ahead: never "in 2 seconds"
    assert "ago" in en.ago(datetime.now(UTC) - timedelta(hours=1))  # now by default


def test_a_language_not_spoken_formats_as_english() -> None:
    assert Formats("xx").number(1234.5) == "1,234.5"


def test_a_value_not_known_reads_as_a_question_mark_and_a_moment_may_come_as_the_read_models_iso_text() -> None:
    de = Formats("de")
    assert [de.number(None), de.integer(None), de.percent(None), de.usd(None), de.bytes(None)] == ["?"] * 5
    assert [de.datetime(None), de.time(None), de.ago(None), de.datetime("not a time")] == ["?"] * 4
    assert de.datetime("2026-12-03T15:04:05+00:00") == "03.12.2026, 15:04:05 UTC"
    assert de.ago("2026-12-03T15:01:05+00:00", AT) == "vor 3 Minuten"
