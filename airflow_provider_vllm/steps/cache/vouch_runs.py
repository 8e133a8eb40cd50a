"""Vouch, after the upgrade, for the cache entries of runs published before it (no Airflow).

Since ADR 0012 an entry serves later runs only with publish's sealed vouch record (``store.CacheVouch``). Entries
filed before the upgrade have none, so each key config's first run after it would infer every row again.
``vouch_run`` writes that record for the entry of one run that *was* published, on the same evidence publish has,
all of it sealed with this deployment's key: a file in a bucket proves nothing about who wrote it.

A run's entry is vouched for only when

1. its ``_MERGED.json``, ``_plan.json`` and ``_SUCCESS.json`` carry this deployment's seals for that run folder, and
   the merge summary names that plan (``plan_mac``);
2. ``_SUCCESS.json`` is the publish of that merge: the same spec and config hash, the same row counts, and the
   sha256 of every file the merge sealed (the part manifests among them);
3. the merge summary names the entry (``cache.entry_id``) and the cache folder (``cache.uri``, the plan's), the
   sealed plan its key config (``cache.key_hash``);
4. the entry's commit in the cache folder carries this deployment's seal (a genuine merge wrote it), names this run
   (its output prefix and spec hash), and, where the merge summary records it (``cache.commit_mac``), is exactly
   that commit;
5. the entry holds the published merge's answers: its id is the one a merge of exactly the computed parts that the
   published results manifest names files (``result_cache.entry_id``: the id covers their sha256), or, for an id of
   a version before that (the run alone: spec hash and output prefix), the published merge summary says that merge
   committed it itself (``committed_by: this_merge``). Such a version merging a run again over other parts (its
   shards run again, say after QA caught a faulty node) found the first merge's commit under the same id and
   appended nothing (``earlier_merge``): that entry holds answers no publish approved, and is skipped.

With ``locations`` (the command passes the deployment's), the rules publish applies to a spec
(``utils.deployment.check_spec_allowed``) apply to the run: its output prefix must be a valid location under the
allow-list (no credentials, ``..`` or empty segments), its cache folder one under the deployment's cache locations;
a run that breaks one is ``refused`` before anything of it is read. Without it only the syntax is checked.

The record written is publish's own (``CacheStore.vouch``, by ``publish``), naming that commit's seal. A run that
fails a check is ``refused``; one with nothing to vouch for (not published, no cache, no entry, its entry gone) is
``skipped``. Nothing is written with ``dry_run``.

Not vouched for: an entry a compaction of an earlier version made. It names only the ids of the entries it folded
(whose commits it removed), and it folded every sealed entry, also those of runs that failed QA or were never
published: nothing sealed says which. Its rows are inferred once, by the first run after the upgrade.

"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from airflow_provider_vllm.core.allow_list import check_cache_location, check_uri, redact_userinfo
from airflow_provider_vllm.core.errors import CommitError, SealError, SpecError
from airflow_provider_vllm.core.plan import PLAN_FILE, Plan, parse_plan
from airflow_provider_vllm.core.records import CacheCommit, MergeSummary
from airflow_provider_vllm.core.seal import Keyring, scope_of
from airflow_provider_vllm.core.storage import FileSystems, Storage
from airflow_provider_vllm.steps.cache.result_cache import entry_id, made_from, run_entry_id
from airflow_provider_vllm.steps.cache.store import CacheStore
from airflow_provider_vllm.steps.merge.merger import (
    MERGED,
    RESULTS,
    SUCCESS,
    manifest_rel,
    read_merged,
    success_doc,
    verified_manifest,
)

log = logging.getLogger(__name__)

Outcome = Literal["vouched", "would_vouch", "already_vouched", "skipped", "refused"]


class RunVouch(BaseModel):
    """What ``vouch_run`` did for one run (the command prints one per run)."""

    model_config = ConfigDict(extra="forbid")
    run_uri: str = Field(description="the run's output prefix, as given (credentials in it masked)")
    outcome: Outcome = Field(
        description="vouched, would_vouch (dry run), already_vouched, skipped (nothing to vouch for) or refused "
        "(a check failed: nothing is trusted)"
    )
    reason: str = Field("", description="why it was skipped or refused; empty otherwise")
    cache_uri: str | None = Field(None, description="the cache folder the entry is in")
    entry_id: str | None = Field(None, description="the entry vouched for (or that would be)")

    def line(self) -> str:
        where = f" entry {self.entry_id} in {self.cache_uri}" if self.entry_id else ""
        return f"{self.run_uri}: {self.outcome.replace('_', ' ')}{where}{': ' + self.reason if self.reason else ''}"


@dataclass(frozen=True)
class Locations:
    """The deployment's rules for where runs and caches are (``check_spec_allowed`` applies them to a spec)."""

    allowed: list[str]  # canonical URI prefixes; empty: any location (the deployment's allow_any_location)
    caches: list[str]  # canonical prefixes result caches may live under; empty: nowhere
    caches_setting: str  # the setting that names them, for the refusal


class _Stop(Exception):
    def __init__(self, outcome: Outcome, reason: str, **kw: Any) -> None:
        super().__init__(reason)
        self.result = (outcome, reason, kw)


def vouch_run(
    run_uri: str,
    keyring: Keyring,
    filesystems: FileSystems | None = None,
    *,
    dry_run: bool = False,
    locations: Locations | None = None,
) -> RunVouch:
    """Vouch for the cache entry of the run published under ``run_uri`` (see the module docstring); what was done
    (its ``run_uri`` with any credentials masked). A store that does not answer (``TransientError``) is raised."""
    shown = redact_userinfo(run_uri)
    try:
        eid, cache_uri = _vouch(run_uri, keyring, filesystems, dry_run, locations)
    except _Stop as s:
        outcome, reason, kw = s.result
        return RunVouch(run_uri=shown, outcome=outcome, reason=reason, **kw)
    return RunVouch(run_uri=shown, outcome="would_vouch" if dry_run else "vouched", cache_uri=cache_uri, entry_id=eid)


def _refuse(reason: str, **kw: Any) -> _Stop:
    return _Stop("refused", reason, **kw)


def _skip(reason: str, **kw: Any) -> _Stop:
    return _Stop("skipped", reason, **kw)


def _vouch(
    run_uri: str, keyring: Keyring, filesystems: FileSystems | None, dry_run: bool, locations: Locations | None
) -> tuple[str, str]:
    try:
        check_uri(run_uri, locations.allowed if locations else [], "run URI")
    except SpecError as e:
        raise _refuse(str(e)) from None
    out = Storage(run_uri, {}, filesystems)
    if not out.exists(MERGED):
        raise _skip(f"no {MERGED}: the run was not merged")
    merged = _merged(out, keyring)
    c = merged.cache
    if c is None:
        raise _skip("the result cache was off for this run")
    if c.entry_id is None:
        raise _skip(f"the merge filed no cache entry ({c.skipped or 'nothing computed to file'})")
    if not out.exists(SUCCESS):
        raise _skip(f"no {SUCCESS}: the run was not published (publish vouches for it when it publishes)")
    _check_success(out, keyring, merged)
    plan = _plan(out, keyring, merged)
    assert plan.cache is not None
    plan_cache = plan.cache
    known = {"cache_uri": plan_cache.uri, "entry_id": c.entry_id}
    if scope_of(c.uri) != scope_of(plan_cache.uri):
        raise _refuse(f"the merge summary names cache {c.uri}, the sealed plan {plan_cache.uri}", **known)
    if locations is not None:
        try:
            check_cache_location(plan_cache.uri, locations.caches, locations.caches_setting)
        except SpecError as e:
            raise _refuse(str(e), **known) from None
    store = CacheStore(plan_cache.uri, {}, keyring, filesystems)
    khash, eid = plan_cache.key_hash, c.entry_id
    rel = f"{store.commit_dir(khash)}/{eid}.json"
    if not store.st.exists(rel):
        raise _skip(
            f"its entry's commit {store.st.uri(rel)} is not in the cache folder (folded into a compacted entry, or "
            "removed); an entry compacted before the upgrade may hold answers of runs never published and is not "
            "vouched for: its rows are inferred once",
            **known,
        )
    commit = store.read_commit(khash, eid)
    if commit is None or commit.seal is None:
        raise _refuse(f"its entry's commit {store.st.uri(rel)} does not verify with this deployment's seal", **known)
    if scope_of(commit.source_output_uri) != scope_of(run_uri) or commit.source_spec_hash != merged.spec_hash:
        raise _refuse(f"its entry's commit {store.st.uri(rel)} was filed by another run", **known)
    if c.commit_mac is not None and c.commit_mac != commit.seal.mac:
        raise _refuse(
            f"its entry's commit {store.st.uri(rel)} is not the one the merge summary names (written again since)",
            **known,
        )
    why = _not_made_from_published(out, merged, plan, commit)
    if why:
        raise _skip(why, **known)
    if store.vouched(khash, commit):
        raise _Stop("already_vouched", "", **known)
    if not dry_run:
        if not store.vouch(khash, eid, commit.seal.mac, "publish", run_uri):
            raise _skip(f"its entry's commit {store.st.uri(rel)} was removed while the record was written", **known)
        if not store.vouched(khash, commit):  # read back: what the plan will read
            raise _refuse(f"the vouch record written for entry {eid} does not read back", **known)
        log.info("cache %s: entry %s of the published run %s vouched for", plan_cache.uri, eid, run_uri)
    return eid, plan_cache.uri


def _merged(out: Storage, keyring: Keyring) -> MergeSummary:
    try:
        return read_merged(out, keyring)
    except SealError as e:
        raise _refuse(f"{MERGED}: {e}") from None
    except (ValueError, CommitError) as e:  # pydantic's ValidationError is a ValueError
        raise _refuse(f"{out.uri(MERGED)} is not a merge summary: {str(e)[:300]}") from None


def _check_success(out: Storage, keyring: Keyring, merged: MergeSummary) -> None:
    """``_SUCCESS.json``: this deployment's publish of this run folder, and of this very merge."""
    try:
        doc = success_doc(out, out.read_bytes(SUCCESS), keyring)
    except SealError as e:
        raise _refuse(f"{SUCCESS}: {e}") from None
    except (ValueError, CommitError) as e:
        raise _refuse(f"{out.uri(SUCCESS)} is not a publish marker: {str(e)[:300]}") from None
    if not isinstance(doc, dict):
        raise _refuse(f"{out.uri(SUCCESS)} is not a publish marker")
    named = doc.get("checksums")
    checksums: dict[str, Any] = named if isinstance(named, dict) else {}
    fields = ("spec_hash", "config_hash", "rows", "ok_rows", "error_rows")
    differ = [f for f in fields if doc.get(f) != getattr(merged, f)]
    differ += sorted(rel for rel, sha in merged.checksums.items() if checksums.get(rel) != sha)
    if differ:
        raise _refuse(f"{out.uri(SUCCESS)} is the publish of another merge than {out.uri(MERGED)} (differs: {differ})")


def _not_made_from_published(out: Storage, merged: MergeSummary, plan: Plan, commit: CacheCommit) -> str | None:
    """Why the entry of ``commit`` may hold other answers than the ones published (None: it holds them; module
    docstring, check 5). The results manifest is read only as the sealed merge summary names it."""
    try:
        manifest = verified_manifest(out, RESULTS, merged)
    except (ValueError, CommitError) as e:
        raise _refuse(f"{out.uri(manifest_rel(RESULTS))}: {str(e)[:300]}") from None
    origin = commit.source_output_uri
    if commit.entry_id == entry_id(plan, origin, made_from(manifest.parts)):
        return None
    if commit.entry_id == run_entry_id(plan, origin):
        if merged.cache is not None and merged.cache.committed_by == "this_merge":
            return None
        return (
            f"its entry {commit.entry_id} was filed by a version whose entry id came from the run alone, and the "
            f"published merge found it committed by an earlier merge of the run ({MERGED} says "
            f"committed_by={merged.cache.committed_by if merged.cache else None!r}): it may hold the answers of that "
            "earlier merge, which a merge over other parts replaced and no publish approved; its rows are inferred once"
        )
    return (
        f"its entry {commit.entry_id} is not the one a merge of the published results files (its id covers neither "
        "their parts nor the run alone): nothing says it holds the published answers; its rows are inferred once"
    )


def _plan(out: Storage, keyring: Keyring, merged: MergeSummary) -> Plan:
    """The sealed plan the run was merged under, with its cache (folder, key config)."""
    where = out.uri(PLAN_FILE)
    try:
        plan = parse_plan(out.read_bytes(PLAN_FILE), where)
        plan.verify(keyring, out.uri())
    except FileNotFoundError:
        raise _refuse(f"no {where}: the cache's key config is not known") from None
    except (ValidationError, ValueError, CommitError) as e:
        raise _refuse(f"{where}: {str(e)[:300]}") from None
    if merged.plan_mac is None or plan.seal is None or plan.seal.mac != merged.plan_mac:
        raise _refuse(f"{where} is not the plan the sealed {MERGED} names")
    if plan.cache is None:
        raise _refuse(f"{where} has no result cache, yet the merge filed an entry")
    return plan
