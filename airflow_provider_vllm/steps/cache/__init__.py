"""The result cache (pure step logic; no Airflow, no I/O on import).

* ``result_cache``: the key, the store of committed entries, and the plan's hits / misses.
"""
