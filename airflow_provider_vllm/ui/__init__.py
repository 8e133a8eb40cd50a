"""The Airflow UI side of the provider: the QA report link and the plugin that serves reports.

``report_access`` is pure (which file a request may read); ``links`` holds the operator
extra link; ``plugin`` is the Airflow plugin (a FastAPI app under ``/vllm-batch``).
"""
