"""Planning a run (pure step logic; no Airflow, no I/O on import).

* ``planner``: ``plan_job`` / ``build_plan``: the input listed and split into shards, ``_plan.json``.
* ``sizing``: rows or tokens per shard from the throughput history.
* ``memory``: the GPU memory plan and layout from a model's config.json.
* ``dry_run``: what a run would do, without running it.
"""
