"""Offline (batch) LLM inference with vLLM, orchestrated by Apache Airflow.

Importing this package does no I/O and imports neither Airflow nor vLLM: the pod-side
worker (``airflow_provider_vllm.worker``) shares the pure modules with the operators.
"""

from __future__ import annotations

__version__ = "0.1.0"
