"""Signing in against an LDAP directory (SPEC ID-2): services/identity/ldap.py against a real OpenLDAP
slapd the tests run (tests/ldapd/), and its pure rules (escaping, the transport check, the group walk)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from llmgw.events.schema.identity import LdapSettings
from llmgw.services.identity.ldap import (
    INVALID_LOGIN,
    LdapDirectory,
    LdapError,
    check_settings,
    check_transport,
    domain_of,
    escape_dn_value,
    escape_filter_value,
    in_chain_filter,
    member_filter,
    walk_groups,
    whoami_lookup,
)
from tests.ldapd import harness
from tests.ldapd.harness import GROUPS, PASSWORDS, PEOPLE, READER_DN, READER_PASSWORD, Slapd

TEMPLATE = f"uid={{user}},{PEOPLE}"


def group(cn: str) -> str:
    return f"cn={cn},{GROUPS}"


def person(uid: str) -> str:
    return f"uid={uid},{PEOPLE}"


@pytest.fixture(scope="module")
def slapd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slapd]:
    why = harness.missing()
    if why:
        pytest.skip(why)
    with harness.running(tmp_path_factory.mktemp("slapd")) as server:
        yield server


def over_ldaps(slapd: Slapd, **changes: object) -> LdapSettings:
    """Bind by the DN template over ldaps://, groups walked under ou=groups; ``changes`` on top."""
    base = LdapSettings(url=slapd.ldaps_url, ca_file=slapd.ca_file, user_dn=TEMPLATE, group_base=GROUPS)
    return msgspec.structs.replace(base, **changes)


async def refusal(settings: LdapSettings, user: str, password: str, bind_password: str = "") -> LdapError:
    with pytest.raises(LdapError) as refused:
        await LdapDirectory("corp", settings, bind_password=bind_password).authenticate(user, password)
    return refused.value


# -- pure rules ------------------------------------------------------------------------------------


def test_a_filter_value_has_its_specials_escaped_so_it_can_only_ever_be_one_value() -> None:
    assert escape_filter_value("*)(uid=*") == "\\2a\\29\\28uid=\\2a"
    assert escape_filter_value("a\\b\x00") == "a\\5cb\\00"
    assert escape_filter_value("Zoë O'Brien") == "Zoë O'Brien"


def test_a_dn_value_has_its_specials_escaped_so_a_user_name_never_adds_an_rdn() -> None:
    assert escape_dn_value("smith, jo") == "smith\\, jo"
    assert escape_dn_value('a+b=c;d<e>"f\\') == 'a\\+b\\=c\\;d\\<e\\>\\"f\\\\'
    assert escape_dn_value("#lead and trail ") == "\\#lead and trail\\ "
    assert escape_dn_value(" x") == "\\ x"


def test_active_directorys_filter_is_exactly_the_matching_rule_in_chain_over_the_escaped_dn() -> None:
    dn = "CN=Smith\\, Jo (ops),OU=People,DC=corp,DC=example"
    assert (
        in_chain_filter(dn)
        == "(member:1.2.840.113556.1.4.1941:=CN=Smith\\5c, Jo \\28ops\\29,OU=People,DC=corp,DC=example)"
    )
    assert domain_of(dn) == "DC=corp,DC=example"


def test_one_levels_group_search_asks_for_members_and_unique_members_of_any_dn_given() -> None:
    got = member_filter(["uid=a*,o=x"], "(objectClass=groupOfNames)")
    assert got == "(&(objectClass=groupOfNames)(|(member=uid=a\\2a,o=x)(uniqueMember=uid=a\\2a,o=x)))"


def test_the_group_walk_ends_at_a_cycle_and_at_its_depth_bound_nearest_groups_first() -> None:
    edges = {"u": ["g1"], "g1": ["g2"], "g2": ["G1", "g3"], "g3": []}  # g2 ⊂ g1 again, named in other case

    def direct_of(dns: list[str]) -> list[str]:
        return [g for dn in dns for g in edges[dn.lower()]]

    assert walk_groups(direct_of, "u") == ["g1", "g2", "g3"]
    chain = {f"g{i}": [f"g{i + 1}"] for i in range(100)} | {"u": ["g0"]}
    deep = walk_groups(lambda dns: [g for dn in dns for g in chain[dn]], "u", max_depth=16)
    assert deep == [f"g{i}" for i in range(16)]


def test_a_bind_name_that_is_no_dn_is_followed_to_the_entry_the_directory_says_was_bound() -> None:
    assert whoami_lookup("dn:uid=eve,o=x", "eve@corp") == ("dn", "uid=eve,o=x")
    # Active Directory's answer: the account name, never the typed name (eve's principal name may be alice@…)
    assert whoami_lookup("u:CORP\\eve", "alice@corp") == ("filter", "(sAMAccountName=eve)")
    assert whoami_lookup("u:eve*", "eve*") == ("filter", "(uid=eve\\2a)")
    assert whoami_lookup("", "alice@corp.example") == ("filter", "(userPrincipalName=alice@corp.example)")


@pytest.mark.parametrize(
    ("settings", "code", "says"),
    [
        (LdapSettings(url="ldap://dir.example:389", user_base="o=x"), "insecure", "--insecure-plain-ldap"),
        (LdapSettings(url="http://dir.example", user_base="o=x"), "misconfigured", "ldaps://host[:port]"),
        (LdapSettings(url="ldaps://dir.example/o=x?uid", user_base="o=x"), "misconfigured", "more than a host"),
        (LdapSettings(url="ldaps://dir.example", start_tls=True, user_base="o=x"), "misconfigured", "TLS already"),
        (LdapSettings(url="ldaps://dir.example"), "misconfigured", "neither user_dn nor user_base"),
        (LdapSettings(url="ldaps://dir.example", user_dn="uid=x,o=x"), "misconfigured", "has no {user}"),
        (LdapSettings(url="ldaps://dir.example", user_base="o=x", user_filter="(uid=*)"), "misconfigured", "{user}"),
        (
            LdapSettings(url="ldaps://dir.example", user_base="o=x", group_filter="objectClass=group"),
            "misconfigured",
            "group_filter 'objectClass=group' is not one filter in parentheses",
        ),
        (
            LdapSettings(url="ldaps://dir.example", user_base="o=x", user_filter="(uid={user}))("),
            "misconfigured",
            "one",
        ),
    ],
)
def test_a_directory_set_up_wrong_is_refused_before_connecting_saying_what_to_do(
    settings: LdapSettings, code: str, says: str
) -> None:
    with pytest.raises(LdapError) as refused:
        check_settings("corp", settings)
    assert refused.value.code == code
    assert says in refused.value.message


def test_plain_ldap_is_refused_by_name_unless_start_tls_or_plain_text_is_asked_for() -> None:
    with pytest.raises(LdapError, match=r"ldap://dir\.example is plain text: use ldaps://, --start-tls"):
        check_transport("corp", LdapSettings(url="ldap://dir.example"))
    upgraded = check_transport("corp", LdapSettings(url="ldap://dir.example", start_tls=True))
    assert (upgraded.port, upgraded.start_tls, upgraded.plain) == (389, True, False)
    plain = check_transport("corp", LdapSettings(url="ldap://dir.example", allow_plain=True))
    assert (plain.start_tls, plain.plain) == (False, True)
    tls = check_transport("corp", LdapSettings(url="LDAPS://dir.example"))
    assert (tls.host, tls.port, tls.use_ssl) == ("dir.example", 636, True)


# -- against slapd ---------------------------------------------------------------------------------


async def test_alice_binds_by_the_dn_template_and_is_in_everyone_through_two_levels_of_groups(slapd: Slapd) -> None:
    alice = await LdapDirectory("corp", over_ldaps(slapd)).authenticate("alice", PASSWORDS["alice"])
    assert alice.provider == "corp"
    assert alice.subject == person("alice")
    assert (alice.username, alice.display_name, alice.email) == ("alice", "Alice Liddell", "alice@example.org")
    assert alice.groups == (group("ml-admins"), group("engineering"), group("everyone"))


async def test_a_person_is_found_by_a_search_as_the_reader_then_bound_with_their_own_password(slapd: Slapd) -> None:
    settings = over_ldaps(slapd, user_dn="", user_base=PEOPLE, bind_dn=READER_DN)
    bob = await LdapDirectory("corp", settings, bind_password=READER_PASSWORD).authenticate("bob", PASSWORDS["bob"])
    assert bob.subject == person("bob")
    # auditors lists bob as a uniqueMember (groupOfUniqueNames); engineering as a member
    assert bob.groups == (group("auditors"), group("engineering"), group("everyone"))
    wrong = await refusal(settings, "bob", PASSWORDS["alice"], READER_PASSWORD)
    assert (wrong.code, wrong.message) == ("invalid_login", INVALID_LOGIN)


async def test_an_anonymous_search_finds_the_person_and_memberof_gives_their_groups_without_a_group_base(
    slapd: Slapd,
) -> None:
    settings = over_ldaps(slapd, user_dn="", user_base=PEOPLE, group_base="")
    alice = await LdapDirectory("corp", settings).authenticate("alice", PASSWORDS["alice"])
    assert alice.groups == (group("ml-admins"),)  # memberOf lists direct groups only


async def test_a_wrong_password_and_an_unknown_user_are_refused_the_same_way(slapd: Slapd) -> None:
    by_template = over_ldaps(slapd)
    by_search = over_ldaps(slapd, user_dn="", user_base=PEOPLE)
    refusals = [
        await refusal(by_template, "alice", "not-her-password"),
        await refusal(by_template, "nobody", "not-her-password"),
        await refusal(by_search, "alice", "not-her-password"),
        await refusal(by_search, "nobody", "not-her-password"),
    ]
    assert {(r.code, r.message) for r in refusals} == {("invalid_login", "the user name or the password is wrong")}


async def test_an_empty_password_is_refused_before_binding_since_an_unauthenticated_bind_would_pass(
    slapd: Slapd,
) -> None:
    for settings in (over_ldaps(slapd), over_ldaps(slapd, user_dn="", user_base=PEOPLE)):
        refused = await refusal(settings, "alice", "")
        assert refused.code == "invalid_login"


async def test_a_filter_injected_in_the_user_name_finds_nobody(slapd: Slapd) -> None:
    settings = over_ldaps(slapd, user_dn="", user_base=PEOPLE)
    for user in ("*)(uid=*", "*", "alice)(|(uid=*"):
        refused = await refusal(settings, user, PASSWORDS["alice"])
        assert refused.code == "invalid_login"


async def test_a_user_name_with_a_comma_binds_as_one_escaped_rdn(slapd: Slapd) -> None:
    jo = await LdapDirectory("corp", over_ldaps(slapd)).authenticate("smith, jo", PASSWORDS["smith, jo"])
    assert jo.subject == "uid=smith\\2C jo,ou=people,dc=example,dc=org"
    assert jo.groups == (group("everyone"),)
    # an RDN smuggled into the name is one value, not a way to another entry
    refused = await refusal(over_ldaps(slapd), "alice,ou=people", PASSWORDS["alice"])
    assert refused.code == "invalid_login"


async def test_a_bind_name_template_that_is_no_dn_finds_the_entry_the_directory_bound(slapd: Slapd) -> None:
    # user_dn "{user}": people type their bind name whole; who they are is what "Who am I?" answers
    settings = over_ldaps(slapd, user_dn="{user}")
    alice = await LdapDirectory("corp", settings).authenticate(person("alice"), PASSWORDS["alice"])
    assert (alice.subject, alice.username) == (person("alice"), "alice")
    assert alice.groups == (group("ml-admins"), group("engineering"), group("everyone"))
    refused = await refusal(settings, person("alice"), PASSWORDS["bob"])
    assert (refused.code, refused.message) == ("invalid_login", INVALID_LOGIN)


async def test_a_cycle_in_groups_ends_the_walk_with_each_group_once(slapd: Slapd) -> None:
    carol = await LdapDirectory("corp", over_ldaps(slapd)).authenticate("carol", PASSWORDS["carol"])
    assert carol.groups == (group("everyone"), group("loop-a"), group("loop-b"))


async def test_a_person_in_no_group_signs_in_with_none_and_dave_with_his_one(slapd: Slapd) -> None:
    erin = await LdapDirectory("corp", over_ldaps(slapd)).authenticate("erin", PASSWORDS["erin"])
    assert erin.groups == ()
    dave = await LdapDirectory("corp", over_ldaps(slapd)).authenticate("dave", PASSWORDS["dave"])
    assert dave.groups == (group("contractors"),)


async def test_start_tls_upgrades_plain_ldap_and_verifies_the_certificate(slapd: Slapd) -> None:
    settings = over_ldaps(slapd, url=slapd.ldap_url, start_tls=True)
    alice = await LdapDirectory("corp", settings).authenticate("alice", PASSWORDS["alice"])
    assert alice.subject == person("alice")
    untrusted = await refusal(msgspec.structs.replace(settings, ca_file=slapd.other_ca_file), "alice", "x")
    assert untrusted.code == "insecure"
    assert f"does not verify against ca_file {slapd.other_ca_file}" in untrusted.message
    assert "set ca_file (--ca-file) to the CA that signed it" in untrusted.message


async def test_plain_ldap_is_refused_unless_asked_for_and_then_works(slapd: Slapd) -> None:
    plain = over_ldaps(slapd, url=slapd.ldap_url, ca_file="")
    refused = await refusal(plain, "alice", PASSWORDS["alice"])
    assert (refused.code, refused.message) == (
        "insecure",
        f"{slapd.ldap_url} is plain text: use ldaps://, --start-tls, or --insecure-plain-ldap if you mean it",
    )
    allowed = msgspec.structs.replace(plain, allow_plain=True)
    alice = await LdapDirectory("corp", allowed).authenticate("alice", PASSWORDS["alice"])
    assert alice.username == "alice"


async def test_a_certificate_from_another_ca_is_refused_naming_ca_file(slapd: Slapd) -> None:
    refused = await refusal(over_ldaps(slapd, ca_file=slapd.other_ca_file), "alice", PASSWORDS["alice"])
    assert refused.code == "insecure"
    assert "set ca_file (--ca-file) to the CA that signed it" in refused.message
    system = await refusal(over_ldaps(slapd, ca_file=""), "alice", PASSWORDS["alice"])
    assert "does not verify against the system's CAs (no ca_file set)" in system.message


async def test_a_certificate_for_another_host_is_refused(slapd: Slapd) -> None:
    # the certificate names 127.0.0.1 only; localhost reaches the same slapd by another name
    settings = over_ldaps(slapd, url=slapd.ldaps_url.replace("127.0.0.1", "localhost"))
    refused = await refusal(settings, "alice", PASSWORDS["alice"])
    assert refused.code == "insecure"
    assert "is not for the host localhost" in refused.message


async def test_a_missing_ca_file_is_named(slapd: Slapd, tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.pem")
    refused = await refusal(over_ldaps(slapd, ca_file=missing), "alice", PASSWORDS["alice"])
    assert (refused.code, refused.message) == (
        "misconfigured",
        f"the LDAP provider corp's ca_file {missing} does not exist on this server",
    )


async def test_a_search_account_with_the_wrong_password_is_a_misconfiguration_not_the_persons_fault(
    slapd: Slapd,
) -> None:
    settings = over_ldaps(slapd, user_dn="", user_base=PEOPLE, bind_dn=READER_DN, bind_password_env="LDAP_READER")
    refused = await refusal(settings, "alice", PASSWORDS["alice"], bind_password="wrong")
    assert refused.code == "misconfigured"
    assert "check bind_dn and the password in LDAP_READER" in refused.message
    unset = await refusal(settings, "alice", PASSWORDS["alice"], bind_password="")
    assert unset.code == "misconfigured"
    assert "set LDAP_READER where the server runs" in unset.message


async def test_a_search_base_that_does_not_exist_is_named(slapd: Slapd) -> None:
    settings = over_ldaps(slapd, user_dn="", user_base="ou=staff,dc=example,dc=org")
    refused = await refusal(settings, "alice", PASSWORDS["alice"])
    assert refused.code == "misconfigured"
    assert "search base ou=staff,dc=example,dc=org does not exist" in refused.message


async def test_a_directory_that_is_down_or_silent_is_unavailable_saying_where() -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # accepts, never answers
        url = f"ldaps://127.0.0.1:{silent.getsockname()[1]}"
        quiet = await refusal(LdapSettings(url=url, user_dn=TEMPLATE, timeout_s=0.5), "alice", "x")
        assert quiet.code == "unavailable"
        assert f"the directory corp at {url} did not answer within 0.5 s" in quiet.message
        port = silent.getsockname()[1]
    with socket.socket() as probe:  # a port nothing listens on any more
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    down = await refusal(LdapSettings(url=f"ldaps://127.0.0.1:{port}", user_dn=TEMPLATE), "alice", "x")
    assert down.code == "unavailable"
    assert f"the directory corp at ldaps://127.0.0.1:{port} cannot be reached" in down.message
