"""The benchmark harness (`ingest bench`, `make bench`) and the peer pipelines it compares with.

Every measurement runs in its own subprocess, so that startup is honest and one pipeline's
threads, caches and Ray cluster never slow another. ``bench`` orchestrates, ``runs`` runs the
programs, ``ratios`` judges them, ``report`` prints the table and ``results_model`` holds the
typed results; ``limit``, ``peers`` and ``assembly`` are the measured programs; ``measure``
samples process trees.
Nothing here is imported by the product; `ingest bench` runs ``python -m benchmarks.bench``.
"""

__all__: list[str] = []
