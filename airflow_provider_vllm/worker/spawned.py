"""What a process that multiprocessing spawns from the worker runs before anything else (vLLM's engine core).

A spawned child imports its parent's main module by the name in ``__main__.__spec__`` before it unpickles
its target (``multiprocessing.spawn``: ``init_main_from_name``, run as ``__mp_main__``), but never a
package's ``__main__``, which is how the worker starts (``python -m airflow_provider_vllm.worker``). The
worker names this module there instead (``imports.carry_to_spawned``), so its engine core marks the same
modules absent (``VLLM_BATCH_SKIP_IMPORTS``, inherited) before it unpickles vLLM's engine and imports vLLM.
Importing it does nothing else: ``__mp_main__`` is not ``__main__``.
"""

from __future__ import annotations

from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.worker.imports import skip_unused_imports

try:
    skip_unused_imports()
except SpecError:  # the worker refused the same variable before it started an engine: nothing to spare here
    pass
