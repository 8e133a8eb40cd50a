"""The job's LoRA adapters on the worker: the folders vLLM loads them from, each one the plan's.

Local and object store adapters are copied into a private temporary folder (``storage.copies_folder``, under
``VLLM_BATCH_ADAPTER_DIR`` when set: pods set the ``/cache`` emptyDir, since an adapter may be larger than
``/tmp``; one a worker killed with SIGKILL left is removed by the next worker's) and used only when the
copy's fingerprint is the one the sealed plan recorded (``core.adapters.fetch_adapter``): a file changed
or swapped after the plan fails the shard (terminal) instead of answering under the planned identity.
Hub adapters are fetched at their pinned commit (``huggingface_hub.snapshot_download``, which reads the
pod's ``HF_HUB_CACHE``: the model-cache PVC), the commit naming the files. The folders live until the
context ends, i.e. as long as the engine that may (re)load them. No vLLM import here.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from airflow_provider_vllm.core import envs
from airflow_provider_vllm.core.adapters import check_refs, fetch_adapter
from airflow_provider_vllm.core.errors import SpecError, TransientError
from airflow_provider_vllm.core.plan import Plan
from airflow_provider_vllm.core.spec import AdapterSpec, JobSpec
from airflow_provider_vllm.core.storage import copies_folder

log = logging.getLogger("airflow_provider_vllm.worker")


@contextlib.contextmanager
def local_adapters(spec: JobSpec, plan: Plan) -> Iterator[dict[str, str]]:
    """Adapter name -> the local folder to hand vLLM, for the job's adapters (empty without adapters)."""
    if not spec.model.adapters:
        yield {}
        return
    refs = check_refs(spec, plan.adapters)
    root = envs.ADAPTER_DIR.get()  # in a pod: the large /cache emptyDir, not the small /tmp
    if root:
        os.makedirs(root, mode=0o700, exist_ok=True)
    with copies_folder("adapters", root or None) as tmp:  # swept by the next one when a killed worker leaves it
        paths: dict[str, str] = {}
        for i, a in enumerate(spec.model.adapters):
            if a.kind == "hub":
                paths[a.name] = _hub(a)
            else:
                paths[a.name] = fetch_adapter(a, refs[a.name], os.path.join(tmp, str(i)), spec.io.storage_options)
            log.info("adapter %s: %s (%s)", a.name, a.source, refs[a.name].identity())
        yield paths


def _hub(a: AdapterSpec) -> str:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError
    except ImportError as e:  # pragma: no cover - vLLM brings it
        raise SpecError(f"model.adapters[{a.name}]: a hub adapter needs huggingface_hub: {e}") from None
    try:
        return snapshot_download(repo_id=a.source, revision=a.revision)
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise SpecError(f"model.adapters[{a.name}]: {a.source}@{a.revision} is not on the hub: {e}") from None
    except LocalEntryNotFoundError as e:
        raise SpecError(
            f"model.adapters[{a.name}]: {a.source}@{a.revision} is not in the hub cache and the hub cannot be "
            f"reached (offline): {e}"
        ) from None
    except OSError as e:  # the network: a retry may reach it
        raise TransientError(f"model.adapters[{a.name}]: fetching {a.source}@{a.revision} failed: {e}") from e
