"""Publishing a merged run, and how a consumer checks what was published (no Airflow).

``_SUCCESS.json`` is written last by the publish task. It names every published file and carries
the sha256 of the two part manifests (which carry the sha256 of every part), of the OpenAI batch files (as
merge sealed them), of QA's report files (the ones QA's sealed ``qa/_QA.json`` names), of the change set and of
the publish task's ``extra_files``, and QA's verdict as that sealed
record gives it (never ``report.json``'s own claim); it is sealed with
the deployment's signing key (``core/seal.py``, domain ``success``, scope the run's output URI).
The Airflow Asset event of the publish task carries the sha256 of the ``_SUCCESS.json`` bytes, so a
consumer that has no signing key can still tie the files to the run Airflow published, through
Airflow's metadata database rather than the bucket.

``verify_published`` does the whole check for a consumer: the marker (by its seal, or by the
sha256 from the Asset event), each manifest against the marker, each part against its manifest,
and every other file the marker has a sha256 for (the OpenAI batch files, QA's files, the change set, the
``extra_files``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from airflow_provider_vllm.core import seal as seals
from airflow_provider_vllm.core.allow_list import canonical_uri, check_uri, store_form
from airflow_provider_vllm.core.errors import CommitError, SpecError
from airflow_provider_vllm.core.part_names import check_inside, run_file
from airflow_provider_vllm.core.plan import ChangesFrom, LastPublished
from airflow_provider_vllm.core.records import SHA256_HEX, PartsManifest
from airflow_provider_vllm.core.seal import Keyring
from airflow_provider_vllm.core.storage import RECORD_MAX_BYTES, FileSystems, Storage
from airflow_provider_vllm.steps.merge.merger import ERRORS, RESULTS, SUCCESS, manifest_rel, success_doc, verify_parts
from airflow_provider_vllm.steps.qa.store import REPORT_JSON


def success_bytes(doc: dict[str, Any], keyring: Keyring, output_uri: str) -> bytes:
    """``_SUCCESS.json``'s bytes: ``doc`` plus its seal."""
    sealed = dict(doc, seal=keyring.seal(seals.SUCCESS, seals.scope_of(output_uri), doc).model_dump(mode="json"))
    return json.dumps(sealed, indent=1, sort_keys=True).encode()


def pin_last_published(
    last: LastPublished,
    own_uri: str,
    *,
    keyring: Keyring,
    storage_options: dict[str, Any] | None = None,
    filesystems: FileSystems | None = None,
    allowed_prefixes: Sequence[str] | None = None,
) -> ChangesFrom:
    """``changes.previous_published``: the run the job's Asset event names, pinned with the merge it published.

    The event (Airflow's metadata database) names the run's output prefix and the sha256 of the ``_SUCCESS.json``
    its publish wrote; that file must have exactly those bytes and this deployment's seal for that prefix, and
    names the results manifest the change set then compares with (``changes._check_pinned``) and the report QA's
    gate compares with (``qa.previous_published``, ``store.load_pinned_report``). No event: nothing
    to compare. SpecError for a prefix outside ``allowed_prefixes`` (the deployment's allow-list) or this run's
    own; CommitError for a marker that is missing, changed or not sealed for it.
    """
    if last.output_uri is None:
        return ChangesFrom(source="published", identifier=last.asset, snapshot_id=None, previous_uri=None)
    where = f"changes.previous_published: Asset {last.asset} event {last.event_id} names run {last.output_uri!r}"
    run = canonical_uri(last.output_uri, "changes.previous_published", resolve=False)
    if store_form(run) == store_form(canonical_uri(own_uri, "io.output_uri", resolve=False)):
        raise SpecError(f"{where}: this run's own output prefix")
    if allowed_prefixes is not None:
        try:
            check_uri(last.output_uri, allowed_prefixes, "changes.previous_published")
        except SpecError as e:
            raise SpecError(f"{where}: {e}") from None
    if last.success_sha256 is None or not SHA256_HEX.fullmatch(last.success_sha256):
        raise CommitError(f"{where} without a success_sha256: not an event of this provider's publish")
    prev = Storage(last.output_uri, storage_options or {}, filesystems)
    try:
        raw = prev.read_bytes(SUCCESS)
    except FileNotFoundError:
        raise CommitError(
            f"{where}, which has no {SUCCESS} now: the published run was removed or moved; restore it, or compare "
            "with another run (changes.previous_uri)"
        ) from None
    if hashlib.sha256(raw).hexdigest() != last.success_sha256:
        raise CommitError(
            f"{where}: its {SUCCESS} is not the marker that publish wrote (sha256 differs from the event's); restore "
            "the published run's files, or compare with another run (changes.previous_uri)"
        )
    try:
        doc = success_doc(prev, raw, keyring)
    except ValueError as e:  # not JSON, not a seal
        raise CommitError(f"{where}: its {SUCCESS} is not a publish marker ({e})") from None
    sha = doc.get("checksums", {}).get(manifest_rel(RESULTS)) if isinstance(doc.get("checksums"), dict) else None
    if not isinstance(sha, str) or not SHA256_HEX.fullmatch(sha):
        raise CommitError(f"{where}: its {SUCCESS} names no results manifest")
    report = doc["checksums"].get(REPORT_JSON)  # qa.previous_published: the report QA's gate compares with
    return ChangesFrom(
        source="published",
        identifier=last.asset,
        snapshot_id=None,
        previous_uri=last.output_uri,
        results_manifest_sha256=sha,
        event_id=last.event_id,
        published_at=last.timestamp,
        report_sha256=report if isinstance(report, str) and SHA256_HEX.fullmatch(report) else None,
    )


def verify_published(
    output_uri: str,
    *,
    keyring: Keyring | None = None,
    success_sha256: str | None = None,
    storage_options: dict[str, Any] | None = None,
    filesystems: FileSystems | None = None,
) -> dict[str, Any]:
    """Check a published run before reading it; returns its ``_SUCCESS.json`` (without the seal).

    Give ``keyring`` (the deployment's signing keys) to check the marker's seal, or ``success_sha256``
    (the Asset event's ``success_sha256``) to check its bytes; at least one. Then every part of
    ``results/`` and ``errors/`` must have the size and sha256 of its manifest, each manifest and every
    other file in the marker's ``checksums`` (the OpenAI batch files, QA's files, the change set, the
    ``extra_files``) the sha256 the marker names.
    Raises CommitError (SealError) naming the first file that does not.
    """
    if keyring is None and success_sha256 is None:
        raise ValueError("give keyring or success_sha256: a file in a bucket proves nothing by itself")
    out = Storage(output_uri, storage_options or {}, filesystems)
    raw = out.read_bytes(SUCCESS)
    if success_sha256 is not None and hashlib.sha256(raw).hexdigest() != success_sha256:
        raise CommitError(f"{out.uri(SUCCESS)} is not the marker the publish task wrote (sha256 differs)")
    doc = success_doc(out, raw, keyring)
    checksums = dict(doc.get("checksums", {}))
    sizes = _sizes(doc.get("sizes"), out.uri(SUCCESS))  # absent in markers written before sizes were recorded
    for kind in (RESULTS, ERRORS):
        rel = manifest_rel(kind)
        size = sizes.get(rel)
        body = out.read_bytes(rel, limit=RECORD_MAX_BYTES if size is None else min(size, RECORD_MAX_BYTES))
        if (size is not None and len(body) != size) or hashlib.sha256(body).hexdigest() != checksums.pop(rel, None):
            raise CommitError(f"{out.uri(rel)} is not the manifest {SUCCESS} names (size or sha256 differs)")
        verify_parts(out, kind, PartsManifest.model_validate_json(body))
    for rel, sha in sorted(checksums.items()):  # every other file it has a sha256 for: no more bytes than its size
        try:
            check_inside(out, run_file(rel), out.uri(SUCCESS))
            digest = out.sha256(rel, sizes.get(rel))
        except ValueError as e:
            raise CommitError(f"{out.uri(SUCCESS)}: {e}") from None
        except FileNotFoundError:
            raise CommitError(f"{out.uri(rel)} is missing; {SUCCESS} names it") from None
        if digest != sha:
            raise CommitError(f"{out.uri(rel)} is not the file {SUCCESS} names (size or sha256 differs)")
    return doc


def _sizes(value: Any, where: str) -> dict[str, int]:
    """A marker's ``sizes`` (path -> bytes; {} when absent); CommitError when it is anything else."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and type(v) is int and v >= 0 for k, v in value.items()
    ):
        raise CommitError(f"{where}: its sizes are not a map of paths to byte counts")
    return value
