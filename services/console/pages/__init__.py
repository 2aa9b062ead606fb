"""The console's pages, in the order of its navigation. Each module exports ``PAGES``."""

from __future__ import annotations

from llmgw.services.console.page import Page
from llmgw.services.console.pages import audit, identity, mirror, models, nodes, overview, people, tenants, usage

PAGES: list[Page] = [
    *overview.PAGES,
    *nodes.PAGES,
    *models.PAGES,
    *tenants.PAGES,
    *people.PAGES,
    *identity.PAGES,
    *usage.PAGES,
    *audit.PAGES,
    *mirror.PAGES,
]
