"""What moved since the previous run: ``changes/changes.parquet`` (one row per id) and
``changes/_changes.json`` (``records.ChangesSummary``: counts, churn rate, the label matrix).

Every id in this run's merged output or the previous run's (``changes.previous_uri``) gets one
``change``:

- ``added``: an answer now, the id was not in the previous run;
- ``removed``: in the previous run (an answer or an error), not in this one;
- ``changed`` / ``unchanged``: an answer in both runs, different / equal;
- ``error``: an error row in this run (``old_status`` says what it was before: 'ok', 'error' or null);
- ``recovered``: an error row in the previous run, an answer now.

A ``changed`` id also says why (``reason``; ``ChangesSummary.reasons`` counts them): ``settings``
(the answers were made under different config hashes: model, prompt, sampling or engine setup; or
the row ran with the same LoRA adapter, by name, whose files changed: another identity in the two
runs' sealed ``_MERGED.json``), ``input`` (the same settings, another engine request: the row's
text or its adapter was edited), ``unified`` (the same request and settings, which the previous run
answered differently for other ids: an inconsistent earlier answer made one, e.g. by the result
cache), ``engine`` (the same request and settings, answered consistently before: the engine's
numerics), ``unknown`` (a run written before requests were hashed, or before its summary recorded
the identity of the adapter the row ran with).

The compared value (``compared``): structured choice and classify -> ``label`` (classify: the
argmax label); json_schema -> ``parsed_json``; otherwise ``output``; embed -> the vector, equal or
not (by a 64-bit hash of it; the file carries no vector values). ``churn_rate`` = changed /
(changed + unchanged): ids whose answer could move; errors have their own QA check.

The previous run counts only when it is complete (its ``_MERGED.json`` exists); otherwise
every id of this run is 'added' (or 'error') and the summary says why; with ``changes.previous_table`` or
``changes.previous_published`` the previous run must hold the sealed merge that was published (``CommitError``
otherwise: the catalog or the Asset event named it, so a folder without it has been tampered with or merged
again). A previous run of
another task or id column is refused (``SpecError`` naming ``changes.previous_uri``), and so is
one whose manifests name anything but its own part files (``../``, a glob, an absolute path, a
local symlink: ``CommitError`` naming the manifest and the name; ``core/part_names.py``): nothing
outside that run is read.

DuckDB does all of it (a full outer join on id, spilled to a local temp folder under a memory
limit; no Python loop over rows). Writes: the Parquet, then the summary, each atomically; a
rerun overwrites both, so a crash between them is repaired by running the step again.
"""

from __future__ import annotations

import hashlib
import logging
import os

import duckdb
from pydantic import ValidationError

from airflow_provider_vllm.core import duck, faults
from airflow_provider_vllm.core import seal as seals
from airflow_provider_vllm.core.errors import CommitError, SealError, SpecError
from airflow_provider_vllm.core.plan import ChangesFrom
from airflow_provider_vllm.core.records import (
    CHANGE_KINDS,
    ChangeCounts,
    ChangesSummary,
    MatrixCell,
    MergeSummary,
)
from airflow_provider_vllm.core.seal import Keyring
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.core.storage import CheckedCopies, FileSystems, Storage, copies_folder
from airflow_provider_vllm.steps.merge.merger import (
    ERRORS,
    MERGED,
    RESULTS,
    checked_parts,
    keep_published,
    manifest_rel,
    published_state,
    read_merged,
    validation_detail,
)

# A run merged before results/ became a folder of parts (provider < 0.2): its two files.

CHANGES = "changes/changes.parquet"
SUMMARY = "changes/_changes.json"
VERSION = 1
# The matrix in the summary keeps the largest cells; 1000 labels could make a million of them.
MAX_MATRIX_CELLS = 10_000
_EMPTY = (
    "SELECT NULL::VARCHAR AS id, NULL::VARCHAR AS st, NULL::VARCHAR AS v, NULL::UBIGINT AS h, "
    "NULL::VARCHAR AS code, NULL::VARCHAR AS cfg, NULL::BIGINT AS ph, NULL::VARCHAR AS ad WHERE false"
)


log = logging.getLogger(__name__)


def compared_column(spec: JobSpec) -> str:
    """The result column whose value decides 'changed' for this job."""
    if spec.task == "embed":
        return "embedding"
    if spec.task == "classify":
        return "label"
    st = spec.sampling.structured
    if st is not None and st.choice:
        return "label"
    if st is not None and st.json_schema is not None:
        return "parsed_json"
    return "output"


def _results_relation(
    out: Storage, kind: str, merged: MergeSummary, copies: CheckedCopies, verified: list[str] | None = None
) -> str:
    """SQL for a merged run's ``results`` or ``errors`` rows: the one place that knows the file layout.

    Only parts the run's sealed ``_MERGED.json`` names, read from local ``copies`` checked (size and sha256) as
    they were copied (``checked_parts``); ``verified``: those copies when the caller has them already.
    """
    parts = verified if verified is not None else checked_parts(out, kind, merged, copies)
    return f"read_parquet({duck.local_list(parts)})"


def _side(
    out: Storage,
    col: str,
    merged: MergeSummary,
    con: duckdb.DuckDBPyConnection,
    copies: CheckedCopies,
    results: str | None = None,
    verified: dict[str, list[str]] | None = None,
) -> str:
    """One run's rows as (id, st 'ok'|'error', v the compared value, h a vector's hash, code the error code,
    cfg the config hash that made the answer, ph its request's prompt hash, ad the LoRA adapter it ran with;
    ph and ad null in runs written before them).
    ``verified``: the run's parts per kind as ``checked_parts`` returned them (else they are copied here)."""
    verified = verified or {}
    if col == "embedding":
        v, h = "NULL::VARCHAR", "hash(embedding)"
    elif col == "label":
        # classify rows have scores; a label-less one (no class names) compares by its scores
        v, h = "coalesce(label, CAST(scores AS VARCHAR))", "NULL::UBIGINT"
    else:
        v, h = f"{col}", "NULL::UBIGINT"
    results = results or _results_relation(out, RESULTS, merged, copies, verified.get(RESULTS))  # copied once
    have = {r[0] for r in con.execute(f"DESCRIBE SELECT * FROM {results}").fetchall()}
    ph = "prompt_hash" if "prompt_hash" in have else "NULL::BIGINT"
    ad = "adapter" if "adapter" in have else "NULL::VARCHAR"
    return (
        f"SELECT id, 'ok' AS st, {v} AS v, {h} AS h, NULL::VARCHAR AS code, config_hash AS cfg, {ph} AS ph, "
        f"{ad} AS ad FROM {results} UNION ALL SELECT id, 'error', NULL, NULL, error_code, config_hash, NULL, NULL "
        f"FROM {_results_relation(out, ERRORS, merged, copies, verified.get(ERRORS))}"
    )


# Why a 'changed' answer moved (changes.parquet's ``reason``; null for the other kinds):
REASONS = ("settings", "input", "unified", "engine", "unknown")
_REASON = (
    "CASE WHEN o.cfg IS DISTINCT FROM n.cfg THEN 'settings' "  # another model, prompt, sampling or engine setup
    # the same adapter by name, other files (the config hash names adapters by source, not by their bytes)
    "WHEN o.ad IS NOT DISTINCT FROM n.ad AND n.ad IN (SELECT name FROM adapters_moved) THEN 'settings' "
    # a run written before requests were hashed, or a request that samples at random (no hash: its answers
    # differ by design, whatever else moved)
    "WHEN o.ph IS NULL OR n.ph IS NULL THEN 'unknown' "
    "WHEN o.ad IN (SELECT name FROM adapters_unknown) THEN 'unknown' "  # its adapter's identity was not recorded
    "WHEN o.ph <> n.ph THEN 'input' "  # the row's rendered prompt is not the same: the input was edited
    # the same request, which the previous run answered differently for other ids: an inconsistent
    # earlier answer made one (e.g. by the result cache, which holds one answer per prompt)
    "WHEN o.ph IN (SELECT ph FROM prev_inconsistent) THEN 'unified' "
    "ELSE 'engine' END"  # the same request and settings, answered consistently before: the engine's numerics
)


def adapters_moved(prev: MergeSummary | None, now: MergeSummary) -> tuple[list[str], list[str]]:
    """(this run's adapters whose identity differs from the previous run's adapter of that name, this run's
    adapters whose previous identity is not known: a previous summary written before it recorded them)."""
    mine = now.adapters or {}
    if prev is None:
        return [], []
    if prev.adapters is None:
        return [], sorted(mine)
    return sorted(n for n, ident in mine.items() if n in prev.adapters and prev.adapters[n] != ident), []


def _previous_state(prev: Storage, where: str, keyring: Keyring) -> tuple[str, MergeSummary | None]:
    """The previous run's state and, when complete, its merge summary, sealed by this deployment's merge.

    A summary without that seal (forged, moved from another folder, or written before seals) is
    ``unverified``: nothing of that run is read, every id of this run is then 'added'.
    """
    if prev.exists(MERGED):
        try:
            return "complete", read_merged(prev, keyring)
        except SealError as e:
            log.warning("%s: not compared: %s", where, e)
            return "unverified", None
        except ValidationError as e:  # not a merge summary this provider wrote (e.g. files outside its run)
            raise SpecError(f"{where}: its {MERGED} is not a merge summary ({validation_detail(e)})") from e
        except ValueError as e:
            raise SpecError(f"{where}: its {MERGED} is not a merge summary ({str(e).splitlines()[0]})") from e
    return ("incomplete" if prev.exists("_plan.json") else "absent"), None


def _check_pinned(pinned: ChangesFrom, previous_uri: str, state: str, prev_merged: MergeSummary | None) -> None:
    """CommitError unless the previous run holds the sealed merge whose results manifest the pinned snapshot
    published. The catalog is the channel the run folder's other writers cannot touch: an earlier merge of that run
    put back (sealed for that folder too), a folder merged again since, or a summary removed would otherwise
    compare this run with answers the table never held, or make every id 'added'."""
    where = f"{pinned.describe()} published run "
    if pinned.previous_uri != previous_uri:
        raise CommitError(f"{where}{pinned.previous_uri!r}, but the change set compares with {previous_uri!r}")
    where += repr(previous_uri)
    if pinned.results_manifest_sha256 is None:
        raise CommitError(
            f"{where}, but this run's plan does not record which merge of it (a plan made before the check); plan the "
            "run under a new output prefix"
        )
    if prev_merged is None:
        what = {
            "incomplete": "has no _MERGED.json",
            "unverified": "has a _MERGED.json without this deployment's seal",
        }.get(state, "holds no run")
        raise CommitError(
            f"{where}, which now {what}: the answers published cannot be compared; restore that run's files "
            "(its sealed _MERGED.json, manifests and parts as published), or compare with another run "
            "(changes.previous_uri)"
        )
    got = prev_merged.checksums.get(manifest_rel(RESULTS))
    if got != pinned.results_manifest_sha256:
        raise CommitError(
            f"{where} with results manifest {pinned.results_manifest_sha256[:12]}..., but its sealed _MERGED.json "
            f"names {(got or 'none')[:12]}...: not the merge that was published (the folder was merged again, or an "
            "earlier merge put back); restore the published merge's files, or compare with another run "
            "(changes.previous_uri)"
        )


def _check_foreign(spec: JobSpec, merged: MergeSummary, con, col: str, results: str) -> None:
    """Refuse a previous run of another task or id column (SpecError naming changes.previous_uri)."""
    where = f"changes.previous_uri {spec.changes.previous_uri!r}"
    if merged.task is not None and merged.task != spec.task:
        raise SpecError(
            f"{where} is a run of task {merged.task!r}, this job's task is {spec.task!r}: "
            "its answers cannot be compared; point it at a run of this job"
        )
    if merged.id_column is not None and merged.id_column != spec.prompt.id_column:
        raise SpecError(
            f"{where} took its ids from column {merged.id_column!r}, this job from "
            f"{spec.prompt.id_column!r}: the ids do not name the same rows"
        )
    # Older summaries lack task/id_column: the data must at least have the compared values.
    value = (
        "embedding" if col == "embedding" else ("coalesce(label, CAST(scores AS VARCHAR))" if col == "label" else col)
    )
    try:
        ok, with_value = con.execute(f"SELECT count(*), count({value}) FROM {results}").fetchall()[0]
    except (duckdb.BinderException, duckdb.InvalidInputException) as e:  # a file of another schema
        raise SpecError(
            f"{where}: its results cannot be read as this job's ({type(e).__name__}: {str(e).splitlines()[0]})"
        ) from e
    if ok and not with_value and merged.ok_rows:
        raise SpecError(
            f"{where}: none of its {ok} answers has a {col!r} value, which this job compares: "
            "a run of another task or structured setting"
        )


def compute_changes(
    spec: JobSpec,
    filesystems: FileSystems | None = None,
    memory_limit: str = "1GB",
    keyring: Keyring | None = None,
    verified: tuple[MergeSummary, dict[str, list[str]]] | None = None,
    pinned: ChangesFrom | None = None,
) -> ChangesSummary:
    """Write ``changes/changes.parquet`` and ``changes/_changes.json`` for a merged run; return the summary.

    Needs this run's ``_MERGED.json`` and ``changes.previous_uri`` set. Raises SpecError for a
    previous run of another task / id column, CommitError for one whose manifests name files
    outside it; a missing or incomplete one is not an error. ``verified``: this run's sealed merge summary
    (``read_merged``) and its parts per kind as ``checked_parts`` returned them (local copies checked as they
    were copied), when the caller (QA) has them: they are read as they are; else both are read and copied here.
    Either run's parts are read from such copies only.
    ``pinned``: with ``changes.previous_table`` or ``changes.previous_published``, the run the plan pinned
    (``Plan.changes_from``: from the catalog, or the Asset event): the previous run must then hold exactly the merge
    that was published (``_check_pinned``).
    """
    if not spec.changes.previous_uri:
        raise SpecError("changes.previous_uri is not set: nothing to compare against")
    out = Storage(spec.io.output_uri, spec.io.storage_options, filesystems)
    prev = Storage(spec.changes.previous_uri, spec.io.storage_options, filesystems)
    if prev.uri().rstrip("/") == out.uri().rstrip("/"):
        raise SpecError(f"changes.previous_uri {spec.changes.previous_uri!r} is this run's own output prefix")
    keyring = keyring or Keyring.from_env()
    merged, parts = verified if verified is not None else (read_merged(out, keyring), None)
    if merged.seal is None:  # read_merged checked it: the change set names the merge it was made from
        raise SealError(f"{out.uri(MERGED)}: a merge summary without a seal; nothing to compare")
    col = compared_column(spec)
    state, prev_merged = _previous_state(prev, f"changes.previous_uri {spec.changes.previous_uri!r}", keyring)
    if pinned is not None:
        _check_pinned(pinned, spec.changes.previous_uri, state, prev_merged)
    notes: list[str] = []
    con = duck.connect(out, prev, memory_limit=memory_limit)
    with copies_folder("changes") as tmp:  # swept by the next one when a task killed with SIGKILL leaves it
        try:
            con.execute(f"SET temp_directory = '{tmp.replace(chr(39), chr(39) * 2)}/spill'")
            if prev_merged is not None:
                try:
                    prev_copies = CheckedCopies(prev, os.path.join(tmp, "previous"))
                    prev_results = _results_relation(prev, RESULTS, prev_merged, prev_copies)  # copied once
                    _check_foreign(spec, prev_merged, con, col, prev_results)
                    old = _side(prev, col, prev_merged, con, prev_copies, prev_results)
                except CommitError as e:  # a name in its manifests leaves the run, or is a glob
                    raise CommitError(
                        f"changes.previous_uri {spec.changes.previous_uri!r}: refusing the previous run: {e}"
                    ) from None
            else:
                old = _EMPTY
                notes.append(
                    f"no previous run to compare: {spec.changes.previous_uri} "
                    + {
                        "incomplete": "has no _MERGED.json (not complete)",
                        "unverified": "has a _MERGED.json without this deployment's seal (not read)",
                    }.get(state, "holds no run")
                    + "; every id is 'added'"
                )
            local = os.path.join(tmp, "changes.parquet")
            values = "" if col == "embedding" else "o.v AS old_value, n.v AS new_value, "
            cmp = "o.h IS NOT DISTINCT FROM n.h" if col == "embedding" else "o.v IS NOT DISTINCT FROM n.v"
            vv = "CAST(h AS VARCHAR)" if col == "embedding" else "coalesce(v, chr(0))"
            moved, unknown = adapters_moved(prev_merged, merged)
            for table, names in (("adapters_moved", moved), ("adapters_unknown", unknown)):
                con.execute(f"CREATE TEMP TABLE {table} AS SELECT unnest(?::VARCHAR[]) AS name", [names])
            con.execute(
                f"CREATE TEMP TABLE prev_inconsistent AS SELECT ph FROM ({old}) WHERE st = 'ok' AND ph IS NOT NULL "
                f"GROUP BY ph HAVING min({vv}) <> max({vv})"
            )
            new = _side(out, col, merged, con, CheckedCopies(out, os.path.join(tmp, "run")), verified=parts)
            change = (
                f"CASE WHEN n.id IS NULL THEN 'removed' WHEN n.st = 'error' THEN 'error' WHEN o.id IS NULL THEN "
                f"'added' WHEN o.st = 'error' THEN 'recovered' WHEN {cmp} THEN 'unchanged' ELSE 'changed' END"
            )
            con.execute(
                f"COPY (SELECT coalesce(n.id, o.id) AS id, {change} AS change, "
                f"o.st AS old_status, n.st AS new_status, {values}"
                f"o.code AS old_error_code, n.code AS new_error_code, "
                f"CASE WHEN {change} = 'changed' THEN {_REASON} END AS reason "
                f"FROM ({old}) o FULL OUTER JOIN ({new}) n ON o.id = n.id ORDER BY 1) "
                f"TO '{local.replace(chr(39), chr(39) * 2)}' (FORMAT parquet, COMPRESSION zstd)"
            ).fetchall()
            src = f"read_parquet('{local.replace(chr(39), chr(39) * 2)}')"
            by_kind = dict(con.execute(f"SELECT change, count(*) FROM {src} GROUP BY 1").fetchall())
            reasons = dict(
                con.execute(f"SELECT reason, count(*) FROM {src} WHERE reason IS NOT NULL GROUP BY 1").fetchall()
            )
            counts = ChangeCounts(**{k: int(by_kind.get(k, 0)) for k in CHANGE_KINDS})
            matrix, cells = None, None
            if col == "label":
                cells = con.execute(
                    f"SELECT count(*) FROM (SELECT DISTINCT old_value, new_value FROM {src} "
                    f"WHERE change IN ('added', 'removed', 'changed', 'unchanged') "
                    "AND coalesce(old_status, 'ok') = 'ok')"
                ).fetchall()[0][0]
                matrix = [
                    MatrixCell(old=o, new=n, count=c)
                    for o, n, c in con.execute(
                        f"SELECT old_value, new_value, count(*) AS c FROM {src} "
                        f"WHERE change IN ('added', 'removed', 'changed', 'unchanged') "
                        "AND coalesce(old_status, 'ok') = 'ok' "
                        f"GROUP BY 1, 2 ORDER BY c DESC, 1 NULLS FIRST, 2 NULLS FIRST LIMIT {MAX_MATRIX_CELLS}"
                    ).fetchall()
                ]
                if cells > MAX_MATRIX_CELLS:
                    notes.append(f"the label matrix has {cells} cells; the {MAX_MATRIX_CELLS} largest are listed")
            faults.hit("changes.before_write")
            size = os.path.getsize(local)  # what this step wrote, not what the bucket holds later
            digest = Storage(tmp).sha256("changes.parquet", size)
            # a published run keeps the change set its publish vouched for (the same bytes again go on)
            keep_published(out, published_state(out, keyring), CHANGES, digest, "QA")
            _publish(out, local, CHANGES)
        finally:
            con.close()
    faults.hit("changes.after_data")
    in_both = counts.changed + counts.unchanged
    if prev_merged is not None and prev_merged.config_hash != merged.config_hash:
        notes.append(
            "the previous run had another config (model, prompt or sampling): "
            "changed answers may come from that, not from the input"
        )
    if moved and prev_merged is not None:
        was, now = prev_merged.adapters or {}, merged.adapters or {}
        notes.append(
            "LoRA adapter(s) with other files than in the previous run: "
            + ", ".join(f"{n} ({was[n]} -> {now[n]})" for n in moved)
            + "; the answers of rows that ran with them moved for that reason ('settings')"
        )
    summary = ChangesSummary(
        version=VERSION,
        previous_uri=spec.changes.previous_uri,
        previous_state=state,
        previous_config_hash=prev_merged.config_hash if prev_merged is not None else None,
        config_hash=merged.config_hash,
        compared=col,
        ids=sum(by_kind.values()),
        counts=counts,
        in_both=in_both,
        churn_rate=counts.changed / in_both if in_both else None,
        reasons={k: int(reasons.get(k, 0)) for k in REASONS} if counts.changed else None,
        matrix=matrix,
        matrix_cells=cells,
        files={"changes": CHANGES},
        checksums={CHANGES: digest},
        sizes={CHANGES: size},
        notes=notes,
        merged_mac=merged.seal.mac,
        previous_merged_mac=prev_merged.seal.mac if prev_merged is not None and prev_merged.seal else None,
    )
    summary = seals.seal_record(keyring, seals.CHANGES, seals.scope_of(out.uri()), summary)
    with faults.writing("changes.mid_marker"):
        out.write_atomic(SUMMARY, seals.record_bytes(summary))
    faults.hit("changes.after_marker")
    return summary


def read_changes(out: Storage, keyring: Keyring | None = None) -> ChangesSummary:
    """``changes/_changes.json`` of the run under ``out``, validated, its seal checked, and ``changes.parquet``
    checked against it (its size, when recorded, and sha256: a streaming read, no further than that size);
    CommitError/SealError otherwise."""
    return _read_changes(out, keyring or Keyring.from_env())[0]


def _read_changes(out: Storage, keyring: Keyring) -> tuple[ChangesSummary, bytes]:
    """``read_changes`` and the summary's bytes as read."""
    raw = out.read_bytes(SUMMARY)
    summary = ChangesSummary.model_validate_json(raw)
    seals.verify_record(keyring, seals.CHANGES, seals.scope_of(out.uri()), summary, out.uri(SUMMARY))
    for rel, sha in summary.checksums.items():
        if rel != CHANGES or out.sha256(rel, (summary.sizes or {}).get(rel)) != sha:
            raise CommitError(f"{out.uri(rel)} is not the file the sealed {SUMMARY} names (sha256 differs)")
    return summary, raw


def changes_to_publish(
    out: Storage, keyring: Keyring, merged: MergeSummary, changes_mac: str | None
) -> dict[str, tuple[int | None, str]]:
    """The change set's files with their size (None: not recorded) and sha256 (``changes.parquet`` and
    ``_changes.json`` as read), when it is the one QA made from this merge and judged: ``read_changes``, made from
    ``merged`` (the sealed ``_MERGED.json`` being published: its ``merged_mac``) and the one whose seal
    ``changes_mac`` names (QA's sealed verdict).

    Every record of an earlier merge or QA of this folder is sealed for it too: a change set put back from one
    (a QA that ran before the previous run was merged, then again after; a merge run again) would be published
    with this verdict. CommitError naming the file otherwise, also for records written before these fields
    (fail closed: run QA again)."""
    summary, raw = _read_changes(out, keyring)
    where = out.uri(SUMMARY)
    rerun = "run the QA task again (it computes and seals the change set of this merge), then publish"
    if summary.merged_mac is None:
        raise CommitError(f"{where} names no merge (written before change sets named theirs); {rerun}")
    if summary.merged_mac != getattr(merged.seal, "mac", None):
        raise CommitError(
            f"{where} is the change set of another merge of this folder (an earlier one put back), not of "
            f"{out.uri(MERGED)}; {rerun}"
        )
    if changes_mac is None:
        raise CommitError(f"QA's sealed verdict names no change set (QA of an earlier version); {rerun}")
    if getattr(summary.seal, "mac", None) != changes_mac:
        raise CommitError(
            f"{where} is not the change set QA's sealed verdict names (an earlier QA of this folder put back); {rerun}"
        )
    sizes = summary.sizes or {}
    return {
        **{rel: (sizes.get(rel), sha) for rel, sha in summary.checksums.items()},
        SUMMARY: (len(raw), hashlib.sha256(raw).hexdigest()),
    }


def _publish(out: Storage, local: str, rel: str) -> None:
    """Move a finished local file to rel: readers see all of it or nothing."""
    out.publish(local, rel, temp=f"{os.path.basename(rel)}.tmp-{os.getpid()}", fault="changes.mid_file")
