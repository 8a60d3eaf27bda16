"""The study: a study file (plan), a parameter search on validation (search), the command (cli)."""

from freeze.pipeline.study.cli import main, splice_tables

__all__ = ["main", "splice_tables"]
