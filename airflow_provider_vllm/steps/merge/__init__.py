"""Merging a run (pure step logic; no Airflow, no I/O on import).

* ``merger``: committed shards -> the published ``results/`` and ``errors/`` folders.
* ``changes``: what moved since the previous run (``changes/``).
"""
