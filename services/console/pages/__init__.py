"""The console's pages, in the order of its navigation. Each module exports ``PAGES``."""

from __future__ import annotations

from llmgw.services.console.page import Page
from llmgw.services.console.pages import models, nodes, overview

PAGES: list[Page] = [*overview.PAGES, *nodes.PAGES, *models.PAGES]
