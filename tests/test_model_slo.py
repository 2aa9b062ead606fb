"""A model's SLO (CAT-1): `ctl model slo` decided by the catalog, and the CLI's signed command end to end."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import models as M
from llmgw.events.schema.envelope import Envelope, RecordedEvent, utc_now
from llmgw.events.schema.outcomes import Rejected
from llmgw.events.schema.subjects import event_subject
from llmgw.services.catalog.rules import Catalog, decide
from tests.fleet import Fleet
from tests.scheduler_world import spec
from tests.support import NatsServer
from tests.test_quota_cli import ctl


def _catalog(slo: M.Slo | None = None, declared: bool = False) -> Catalog:
    catalog = Catalog()
    env = Envelope(id="e1", type="model.added", at=utc_now(), actor="user:t")
    added = M.ModelAdded(spec=msgspec.structs.replace(spec("chat", 1), slo=slo), declared=declared)
    catalog.apply("chat", RecordedEvent(envelope=env, payload=added, subject="s", seq=1))
    return catalog


SLO = M.Slo(ttft_p95_s=2.0, tokens_per_s=20.0)

EDITS = [
    ("an SLO is set", M.SetSlo(name="chat", ttft_p95_s=2, tokens_per_s=20), None,
     "model chat now has SLO time to first token p95 2 s, 20 tokens/s per request", SLO),
    ("one half of an SLO is set", M.SetSlo(name="chat", ttft_p95_s=0.5), None,
     "model chat now has SLO time to first token p95 0.5 s", M.Slo(ttft_p95_s=0.5)),
    ("the same SLO is no change", M.SetSlo(name="chat", ttft_p95_s=2, tokens_per_s=20), SLO,
     "model chat already has SLO time to first token p95 2 s, 20 tokens/s per request", "unchanged"),
    ("none clears it", M.SetSlo(name="chat"), SLO, "model chat now has no SLO", None),
]  # fmt: skip


@pytest.mark.parametrize(("_name", "command", "before", "message", "after"), EDITS, ids=[c[0] for c in EDITS])
def test_an_slo_edit(_name: str, command: M.SetSlo, before: M.Slo | None, message: str, after: object) -> None:
    d = decide(_catalog(before), command)
    assert (d.result["model"], d.message) == ("chat", message)
    if after == "unchanged":
        assert d.payloads == []
        return
    [changed] = d.payloads
    assert isinstance(changed, M.ModelChanged) and changed.spec.slo == after
    assert M.spec_hash(changed.spec) == M.spec_hash(_catalog(before).models["chat"].spec), "no restart for an SLO"


REFUSALS = [
    ("a time to first token of zero", M.SetSlo(name="chat", ttft_p95_s=0), "SLO --ttft-p95 0 must be above 0"),
    ("negative tokens per second", M.SetSlo(name="chat", tokens_per_s=-3), "SLO --tokens-per-sec -3 must be above 0"),
    ("an unknown model", M.SetSlo(name="nope", ttft_p95_s=1), "there is no model 'nope'"),
]  # fmt: skip


@pytest.mark.parametrize(("_name", "command", "says"), REFUSALS, ids=[c[0] for c in REFUSALS])
def test_an_slo_that_cannot_hold_is_refused_saying_why(_name: str, command: M.SetSlo, says: str) -> None:
    with pytest.raises(Rejected) as exc:
        decide(_catalog(), command)
    assert says in str(exc.value)


def test_a_declared_models_slo_is_edited_in_its_file() -> None:
    with pytest.raises(Rejected) as exc:
        decide(_catalog(declared=True), M.SetSlo(name="chat", ttft_p95_s=1))
    assert "change the SLO of" in str(exc.value)


@pytest.fixture
async def fleet(store: EventStore, nats: NatsServer, tmp_path: Path) -> AsyncIterator[Fleet]:
    f = await Fleet(store, nats.url, tmp_path).start(services=("catalog", "projections", "api"))
    yield f
    await f.stop()


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_ctl_model_slo_sets_the_models_slo_as_a_signed_command(fleet: Fleet) -> None:
    await fleet.command("add", M.AddModel(spec=spec("chat", 1)))
    done = await ctl(fleet, "model", "slo", "chat", "--ttft-p95", "1.5", "--tokens-per-sec", "30")
    assert done.exit_code == 0, done.output
    assert "model chat now has SLO time to first token p95 1.5 s, 30 tokens/s per request" in done.output
    [*_, last] = await fleet.store.read(event_subject(M.AGGREGATE, "chat"))
    assert isinstance(last.payload, M.ModelChanged) and last.payload.spec.slo == M.Slo(ttft_p95_s=1.5, tokens_per_s=30)
    assert last.envelope.actor.startswith("user:"), "the proven sender"

    usage = await ctl(fleet, "model", "slo", "chat")
    assert usage.exit_code != 0 and "--ttft-p95" in usage.output
