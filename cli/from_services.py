"""What the CLI knows of the services without importing them: the names of the files `llmgw up`
keeps in its data directory, and the admin API's limits.

Importing a service module for a constant would make every `llmgw ctl …` wait for the service's own
imports; tests/test_cli_imports.py holds each value here equal to the service's.
"""

from __future__ import annotations

ADMIN_TOKEN_FILE = "admin-token"  # the first administrator's token (services/people/bootstrap.py TOKEN_FILE)
DEMO_KEY_FILE = "demo-key"  # the demo project's API key (services/access/bootstrap.py)
KEYS_LIMIT = 100  # keys a replay's answer lists unless asked otherwise (services/api/views.py)
KEYS_LIMIT_MAX = 1000  # the most it lists (services/api/views.py)
