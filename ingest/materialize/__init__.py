"""Materialized corpora: writing streams' rows to segment files (``writer``) and replaying them as
a stream (``replay``)."""
