"""A real OpenLDAP ``slapd`` for the tests: its own config, data from LDIF, a test CA (harness.py)."""
