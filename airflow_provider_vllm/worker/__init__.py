"""The pod-side shard worker. Imports no Airflow: the worker image does not ship it.

Entry point: ``python -m airflow_provider_vllm.worker '<shard task json>'``.
"""
