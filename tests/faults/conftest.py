"""The fault suite runs only when asked for by its marker (`-m faults`, `make test-faults`): a whole
cluster under load, one fault after another, takes about ten minutes — never part of `make test`,
whatever other ``-m`` a run is given."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "faults" in (config.option.markexpr or ""):
        return
    ours = [i for i in items if i.get_closest_marker("faults")]
    if ours:
        config.hook.pytest_deselected(items=ours)
        items[:] = [i for i in items if not i.get_closest_marker("faults")]
