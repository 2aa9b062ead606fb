"""Benchmarks: figures printed as ratios against a baseline measured in the same run, never pass/fail.

`llmgw bench …` (``llmgw.cli.bench``) is the entry point; the work is here.
"""


class BenchError(RuntimeError):
    """A run that produced no figures, and why (the CLI prints it as an error)."""
