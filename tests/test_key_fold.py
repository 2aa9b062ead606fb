"""One fold of keys, limits, prices and budgets, whoever reads them.

The access service (which decides), the routers (which enforce), the tenancy service (which keeps a
project with live keys from being deleted) and the ``access`` projection (what `ctl key list` and
the API show) each folded the access events their own way. Now they call ``events/folds/keys.py``,
and a property test holds the SQL projection's rows, the access service's state and the router's
state to one another over generated event sequences.
"""

from __future__ import annotations

import asyncio
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.events.folds import keys as K
from llmgw.events.schema import access as A
from llmgw.events.schema.catalog import default_registry
from llmgw.events.schema.envelope import Envelope, RecordedEvent
from llmgw.events.schema.subjects import event_subject
from llmgw.projections.access import AccessProjection
from llmgw.projections.apply import commit_batch, create_tables
from llmgw.projections.backends import open_backend
from llmgw.services.access.rules import AccessState
from llmgw.services.router.state import RouterState
from llmgw.services.tenancy.tree import TenancyTree

T0 = 1_700_000_000.0
REGISTRY = default_registry()
EXPIRES = datetime(2031, 1, 1, tzinfo=UTC)


def created(key_id: str = "k1", rpm: int | None = None, tpm: int | None = None, name: str = "") -> A.KeyCreated:
    return A.KeyCreated(
        key_id=key_id,
        prefix=f"pre{key_id}".ljust(8, "0"),
        secret_sha256="0" * 64,
        project_id="p1",
        name=name,
        rpm=rpm,
        tpm=tpm,
        models=["m"],
        expires_at=EXPIRES,
    )


def replay(*payloads: msgspec.Struct) -> K.AccessBook:
    book = K.AccessBook()
    for p in payloads:
        book.apply(p)
    return book


# -- the fold itself ------------------------------------------------------------------------------


def test_a_key_is_created_once_and_a_second_creation_changes_nothing() -> None:
    book = replay(created(name="ci", rpm=5), created(name="other", rpm=50))
    assert (book.keys["k1"].name, book.keys["k1"].rpm) == ("ci", 5)


def test_revoking_is_final_and_keeps_the_first_reason() -> None:
    book = replay(created(), A.KeyRevoked(key_id="k1", reason="leaked"), A.KeyRevoked(key_id="k1", reason="again"))
    assert (book.keys["k1"].revoked, book.keys["k1"].revoke_reason) == (True, "leaked")
    assert replay(A.KeyRevoked(key_id="k1")).keys == {}, "revoking a key never created makes none"


def test_a_keys_own_limits_are_its_creation_until_a_limit_set_on_it_replaces_or_clears_them() -> None:
    book = replay(created(rpm=5))
    assert book.limit_of("key:k1") == K.Limit(rpm=5)
    book.apply(A.LimitSet(scope="key:k1", tpm=1000))
    assert book.limit_of("key:k1") == K.Limit(tpm=1000)
    book.apply(A.LimitSet(scope="key:k1"))
    assert book.limit_of("key:k1") is None and "key:k1" not in book.limits


def test_a_limit_or_a_budget_set_without_values_clears_it_and_a_price_is_the_latest() -> None:
    book = replay(
        A.LimitSet(scope="team:t", rpm=10),
        A.BudgetSet(scope="team:t", usd=5.0, period="day"),
        A.PriceSet(model="m", input_usd_per_m=1.0, output_usd_per_m=2.0),
        A.PriceSet(model="m", input_usd_per_m=3.0, output_usd_per_m=4.0),
    )
    assert (book.limit_of("team:t"), book.budgets["team:t"]) == (K.Limit(rpm=10), K.Budget(usd=5.0, period="day"))
    assert book.prices["m"] == K.Price(input_usd_per_m=3.0, output_usd_per_m=4.0)
    book.apply(A.LimitSet(scope="team:t"))
    book.apply(A.BudgetSet(scope="team:t", usd=None))
    assert (book.limits, book.budgets) == ({}, {})


# -- every reader agrees --------------------------------------------------------------------------


def recorded(payloads: list[msgspec.Struct]) -> list[RecordedEvent]:
    out = []
    for seq, p in enumerate(payloads, 1):
        match p:
            case A.KeyCreated() | A.KeyRevoked():
                subject = event_subject(A.KEY_AGGREGATE, p.key_id)
            case A.LimitSet():
                subject = event_subject(A.LIMIT_AGGREGATE, p.scope)
            case A.PriceSet():
                subject = event_subject(A.PRICE_AGGREGATE, p.model)
            case _:
                subject = event_subject(A.BUDGET_AGGREGATE, p.scope)
        env = Envelope(
            id=f"e{seq}", type=REGISTRY.type_of(p).name, at=datetime.fromtimestamp(T0 + seq, UTC), actor="user:test"
        )
        out.append(RecordedEvent(envelope=env, payload=p, subject=subject, seq=seq))
    return out


async def projected(events: list[RecordedEvent], db: Path) -> dict[str, dict[str, Any]]:
    """The access projection's rows after ``events``, applied as the runner applies a batch."""
    projection = AccessProjection()
    backend = await open_backend(f"sqlite:///{db}")
    try:
        async with backend.transaction(projection) as tx:
            await create_tables(tx, projection)
        await commit_batch(backend, projection, events)
        keys = await backend.query(
            projection,
            "SELECT id, prefix, project_id, name, user_name, rpm, tpm, models, expires_at, revoked, revoke_reason "
            "FROM {keys}",
        )
        limits = await backend.query(projection, "SELECT scope, rpm, tpm FROM {limits}")
        prices = await backend.query(projection, "SELECT model, input_usd_per_m, output_usd_per_m FROM {prices}")
        budgets = await backend.query(projection, "SELECT scope, usd, period FROM {budgets}")
    finally:
        await backend.close()
    return {
        "keys": {r[0]: tuple(r[1:]) for r in keys},
        "limits": {r[0]: tuple(r[1:]) for r in limits},
        "prices": {r[0]: tuple(r[1:]) for r in prices},
        "budgets": {r[0]: tuple(r[1:]) for r in budgets},
    }


def as_rows(state: AccessState) -> dict[str, dict[str, Any]]:
    """The access service's fold in the projection's columns."""
    keys = {
        k.id: (
            k.prefix,
            k.project_id,
            k.name,
            k.user,
            k.rpm,
            k.tpm,
            msgspec.json.encode(k.models).decode(),
            k.expires_at.isoformat() if k.expires_at else None,
            int(k.revoked),
            k.revoke_reason,
        )
        for k in state.keys.values()
    }
    return {
        "keys": keys,
        "limits": {s: (v.rpm, v.tpm) for s, v in state.limits.items()},
        "prices": {m: (v.input_usd_per_m, v.output_usd_per_m) for m, v in state.prices.items()},
        "budgets": {s: (v.usd, v.period) for s, v in state.budgets.items()},
    }


KEY_IDS = ["k1", "k2", "k3"]
SCOPES = ["key:k1", "key:k2", "project:p1", "team:t1"]
per_minute = st.one_of(st.none(), st.integers(1, 100))
access_events = st.one_of(
    st.builds(created, st.sampled_from(KEY_IDS), per_minute, per_minute, st.sampled_from(["", "ci", "bot"])),
    st.builds(A.KeyRevoked, key_id=st.sampled_from(KEY_IDS), reason=st.sampled_from(["", "leaked", "left"])),
    st.builds(A.LimitSet, scope=st.sampled_from(SCOPES), rpm=per_minute, tpm=per_minute),
    st.builds(
        A.PriceSet,
        model=st.sampled_from(["m", "n"]),
        input_usd_per_m=st.sampled_from([0.0, 0.5, 2.0]),
        output_usd_per_m=st.sampled_from([0.0, 1.5]),
    ),
    st.builds(
        A.BudgetSet,
        scope=st.sampled_from(SCOPES),
        usd=st.one_of(st.none(), st.sampled_from([1.0, 20.0])),
        period=st.sampled_from(A.PERIODS),
    ),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(access_events, max_size=30))
def test_the_projection_the_access_service_and_the_router_fold_keys_limits_prices_and_budgets_alike(
    payloads: list[msgspec.Struct],
) -> None:
    events = recorded(payloads)
    state = AccessState()
    router = RouterState()
    tree = TenancyTree()
    for e in events:
        state.apply(e)
        router.apply(e)
        if isinstance(e.payload, A.KeyCreated | A.KeyRevoked):
            tree.apply_key(e)
    with tempfile.TemporaryDirectory() as tmp:
        rows = asyncio.run(projected(events, Path(tmp) / "projections.db"))
    fold = as_rows(state)
    assert rows["keys"] == fold["keys"], "`ctl key list` and the access service disagree about a key"
    assert rows["limits"] == fold["limits"], "`ctl limit list` and the access service disagree about a limit"
    assert rows["prices"] == fold["prices"]
    assert rows["budgets"] == fold["budgets"]

    live = {k.prefix: k for k in state.keys.values() if not k.revoked}
    assert router.keys == live, "a router accepts a key the access service holds revoked, or the reverse"
    held = {s: state.book.limit_of(s) for s in {*state.limits, *(f"key:{k}" for k in state.keys)}}
    assert router.limits == {s: (v.rpm, v.tpm) for s, v in held.items() if v is not None}
    assert (router.prices, router.budgets) == (state.prices, state.budgets)

    live_by_project: dict[str, dict[str, str]] = {}
    for k in state.keys.values():
        if not k.revoked:
            live_by_project.setdefault(k.project_id, {})[k.id] = k.name or k.id
    assert tree.live_keys == live_by_project, "the tenancy service counts a project's live keys differently"
