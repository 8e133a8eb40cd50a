"""Airflow-side helpers of the operators (no operators here, no I/O on import).

* ``job_spec``: the job spec a task receives (params, XCom), the runner check, and data-plane
  errors mapped to Airflow's retry / no-retry exceptions.
* ``deployment``: the deployment's ``[vllm_batch]`` configuration (allow-list, remote code, pod defaults).
* ``provenance``: who set each value of the rendered spec (DAG file, Variable, trigger).
* ``worker_process``: the local runner's worker child process (command line, streaming, manifest).
* ``pod_spec``: the ``kubernetes.client`` objects of a shard's pod.
* ``worker_outcome``: a finished worker's exit code and manifest -> the task's result or exception.
* ``openlineage_facets``: lineage facts -> OpenLineage datasets (imported lazily).
* ``merged_run``: the merged run a step between QA and publish reads (checked copies of the reported merge's parts).
"""
