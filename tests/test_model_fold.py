"""The one model lifecycle every reader folds (the scheduler, the routers, the catalog service)."""

from __future__ import annotations

from llmgw.events.folds import models as MF
from llmgw.events.schema import models as M


def spec(name: str = "m", lo: int = 1, hi: int | None = None) -> M.ModelSpec:
    return M.ModelSpec(
        name=name, source="/m.gguf", scaling=M.Scaling(min=lo, max=hi), profiles=[M.Profile(min_memory_gb=1)]
    )


def fold(*payloads: object) -> MF.ModelStatus | None:
    status = None
    for p in payloads:
        status = MF.fold_model(status, p)
    return status


def test_max_follows_min_when_left_out() -> None:
    s = fold(M.ModelAdded(spec=spec(lo=2)))
    assert (s.min, s.max) == (2, 2)


def test_a_stop_keeps_the_scaling_and_a_start_restores_it() -> None:
    s = fold(M.ModelAdded(spec=spec(lo=2, hi=3)), M.ModelStopped(saved_min=2, saved_max=3))
    assert s.stopped and s.saved == (2, 3)
    s = MF.fold_model(s, M.ModelStarted(min=2, max=3))
    assert not s.stopped and (s.min, s.max) == (2, 3)


def test_a_changed_definition_unparks_but_keeps_the_scaling() -> None:
    s = fold(M.ModelAdded(spec=spec()), M.ModelScaled(min=4, max=5), M.ModelParked(reason="bad file", failures=5))
    assert s.parked == "bad file"
    s = MF.fold_model(s, M.ModelChanged(spec=spec(lo=1)))
    assert s.parked is None and (s.min, s.max) == (4, 5)


def test_retry_unparks() -> None:
    assert fold(M.ModelAdded(spec=spec()), M.ModelParked(reason="x", failures=5), M.ModelRetried()).parked is None


def test_a_removed_model_is_gone_and_a_re_added_one_starts_afresh() -> None:
    assert fold(M.ModelAdded(spec=spec()), M.ModelRemoved()) is None
    s = fold(
        M.ModelAdded(spec=spec()), M.ModelStopped(saved_min=1, saved_max=1), M.ModelRemoved(), M.ModelAdded(spec=spec())
    )
    assert s is not None and not s.stopped


def test_events_for_a_model_that_does_not_exist_change_nothing() -> None:
    assert fold(M.ModelScaled(min=3, max=3), M.ModelParked(reason="x", failures=5)) is None
