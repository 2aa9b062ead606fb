"""People: who may sign in (SPEC TEN-1, TEN-3)."""
