"""The result cache's folder: sealed entries only, read from verified local copies, compacted.

Layout under ``cache.uri``::

    entries/<entry_id>/part-00000.parquet              key (32 bytes), source_id, the answer columns, cached_from,
                                                       computed_at; rows sorted by key
    commits/<key_hash[:32]>/<entry_id>.json            CacheCommit, create-only, sealed, written last

Whoever can write the cache folder can write any bytes there, so nothing is read on the word of a
file in it: a commit counts only when it carries the seal of this deployment's merge
(``core/seal.py``, domain ``cache-entry``, scope the cache folder) for its own key config and entry
id, and its parts are read only from local copies whose size and sha256 are the sealed ones
(``Storage.fetch_verified``). An entry that fails any check is skipped whole, with a warning: its
rows are inferred again. Which answer wins a key held by several entries is decided by the rows'
own ``computed_at`` (inside the sealed bytes), never by a file's name or time.

An entry serves later runs only once the run that made it was published: the merge files it before QA, and
publish (after QA, the human review and its own checks) writes ``published/<key_hash[:32]>/<entry_id>.json``
(``records.CacheVouch``, sealed with the deployment's key, domain ``cache-published``, scope the cache folder),
which names the entry's commit by its seal. Readers (the plan, the dry run, compaction) take only entries with
such a record for exactly that commit; an entry never vouched for is removed by a later merge that files an entry
of its key config once its sealed ``created`` is older than ``UNPUBLISHED_KEEP``.

Compaction keeps a plan's cost flat in the number of past runs: once a key config has more than
``COMPACT_AFTER`` live vouched entries, the merge that appended the last one writes one entry holding the
newest answer per key of all of them (``supersedes`` names them; readers skip them) and vouches for it (it holds
only answers of published runs), then removes the superseded commits, entries and records. No Airflow.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import stat
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import ValidationError

from airflow_provider_vllm import __version__
from airflow_provider_vllm.core import duck, faults
from airflow_provider_vllm.core import seal as seals
from airflow_provider_vllm.core.errors import CommitError, ListingTooLarge, TransientError
from airflow_provider_vllm.core.part_names import check_inside
from airflow_provider_vllm.core.records import CacheCommit, CacheFileEntry, CacheVouch
from airflow_provider_vllm.core.seal import Keyring
from airflow_provider_vllm.core.storage import FileSystems, Storage, is_temp_name

log = logging.getLogger(__name__)

ENTRIES, COMMITS, PUBLISHED = "entries", "commits", "published"
COMPUTED_AT = "computed_at"  # per row: when the answer was computed (UTC, ISO 8601); the newest wins a key
COMPACT_AFTER = 16  # live entries of one key config before a merge compacts them into one
COMMIT_MAX_BYTES = 1 << 20
"""The most read of a cache commit file. A commit this provider writes names one part (about 2 KB sealed, with
its output URI); a compaction adds the ids it supersedes (about 40 bytes each; ``COMPACT_AFTER`` + 1 when it runs
on time), so 1 MiB holds some 25,000 of them. A larger file is refused unread and its entry skipped: a planted
one is parsed before its seal is checked, and one of 64 MiB took some 370 MiB of the plan's memory."""
MAX_COMMITS = 1024
"""The most commit files of one key config that ``committed`` reads: a compaction keeps them at about
``COMPACT_AFTER``. A folder holding more is not read at all (a warning names it; every row is inferred again):
another writer of the cache folder cannot make each plan read millions of them."""
COMMITS_LISTED = 4 * MAX_COMMITS
"""The most entries of one key config's commit folder listed (commits, and the temp files of killed writers):
the listing stops there, and the folder is skipped as one of more than ``MAX_COMMITS`` commits."""
UNPUBLISHED_KEEP = timedelta(days=30)
"""How long an entry no publish vouched for is kept (by its commit's sealed ``created``): its run may still be in QA
or waiting for a reviewer, and publish vouches for it then. After that a merge of its key config removes it (a run
that failed QA or was rejected is never published); a publish later than that vouches for nothing."""
TEMP_KEEP = timedelta(hours=1)
"""How long a temp file of a vouch record or a commit (``<entry>.json.tmp-<32 hex>``, local cache folders:
``write_atomic``, ``create_only``) is kept: a publish or merge writes and renames or links it within a second; one
older was left by a task killed while writing it, and the sweep removes it (it counts toward ``COMMITS_LISTED`` of
its folder)."""
VOUCH_MAX_BYTES = 64 << 10  # a vouch record is about 600 bytes; a larger file is refused unread
_ENTRY_ID = re.compile(r"^[0-9a-f]{32}$")
_PART = re.compile(r"^part-\d{5}\.parquet$")


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


class CacheStore:
    """``cache.uri``: sealed, committed entries only (see the module docstring)."""

    def __init__(
        self, uri: str, options: dict[str, Any], keyring: Keyring, filesystems: FileSystems | None = None
    ) -> None:
        self.st = Storage(uri, options, filesystems)
        self.keyring = keyring
        self.scope = seals.scope_of(self.st.uri())

    @staticmethod
    def commit_dir(khash: str) -> str:
        return f"{COMMITS}/{khash[:32]}"

    @staticmethod
    def vouch_dir(khash: str) -> str:
        return f"{PUBLISHED}/{khash[:32]}"

    # ---- reading ----------------------------------------------------------------------
    def committed(self, khash: str, *, vouched: bool = True, at_most: bool = False) -> list[CacheCommit]:
        """The live, sealed commits of this key config, oldest first (entries a compaction superseded left out).

        ``vouched`` (every reader: the plan, the dry run, compaction): only entries whose run was published (a valid
        ``CacheVouch`` for exactly their commit); only their ``supersedes`` count. Only commits that have a vouch
        record are read, so ``MAX_COMMITS`` bounds those: entries of runs not published (yet), kept up to
        ``UNPUBLISHED_KEEP``, do not make the folder unread. False: every sealed commit, for the merge's own
        housekeeping (the entries of the run's earlier merges, the ones never published); ``at_most``: a folder of
        more than ``MAX_COMMITS`` commits gives the first ``MAX_COMMITS`` by name instead of none (the sweep)."""
        valid: list[CacheCommit] = []
        folder = self.commit_dir(khash)
        # others (e.g. a writer's temp file) are never a commit
        try:
            listed = self.st.listdir(folder, limit=COMMITS_LISTED)
            vouches = set(self.st.listdir(self.vouch_dir(khash), limit=COMMITS_LISTED)) if vouched else set()
        except ListingTooLarge as e:
            log.warning("cache: skipping every entry of %s: %s", self.st.uri(folder), e)
            return []
        names = [n for n in listed if n.endswith(".json") and _ENTRY_ID.match(n.removesuffix(".json"))]
        unpublished = 0
        if vouched:  # only commits with a vouch record are read: the bound counts those, never the pending ones
            unpublished = len(names)
            names = [n for n in names if n in vouches]
            unpublished -= len(names)
        elif len(names) > MAX_COMMITS and at_most:
            names = sorted(names)[:MAX_COMMITS]  # the sweep: a bounded share each merge, never none
        if len(names) > MAX_COMMITS:
            log.warning(
                "cache: skipping every entry of %s: it holds %d commits, more than the %d a compacted cache holds "
                "(another writer of the cache folder put them there?)",
                self.st.uri(folder),
                len(names),
                MAX_COMMITS,
            )
            return []
        for name in names:
            eid = name.removesuffix(".json")
            c = self._read(f"{folder}/{name}", khash, eid)
            if c is None:
                continue
            if vouched and not self.vouched(khash, c):
                unpublished += 1
                continue
            valid.append(c)
        if unpublished:
            log.info("cache %s: %d entries not read: no publish vouched for them", self.st.uri(folder), unpublished)
        gone = {e for c in valid for e in c.supersedes}
        return sorted((c for c in valid if c.entry_id not in gone), key=lambda c: (c.created, c.entry_id))

    def vouched(self, khash: str, c: CacheCommit) -> bool:
        """Whether ``published/<key>/<entry>.json`` is this deployment's sealed vouch for exactly this commit."""
        rel = f"{self.vouch_dir(khash)}/{c.entry_id}.json"
        where = self.st.uri(rel)
        try:
            v = CacheVouch.model_validate_json(self.st.read_bytes(rel, VOUCH_MAX_BYTES))
            seals.verify_record(self.keyring, seals.CACHE_PUBLISHED, self.scope, v, f"cache vouch {where}")
        except FileNotFoundError:
            return False
        except TransientError:
            raise
        except (ValidationError, ValueError, CommitError, OSError) as e:
            log.warning("cache: entry %s is not read: %s", c.entry_id, str(e)[:300])
            return False
        if v.entry_id != c.entry_id or v.key_hash != khash:
            log.warning("cache: entry %s is not read: %s vouches for another entry", c.entry_id, where)
            return False
        if c.seal is None or v.commit_mac != c.seal.mac:
            log.warning(
                "cache: entry %s is not read: %s vouches for another commit of that entry (one written again since "
                "its run was published)",
                c.entry_id,
                where,
            )
            return False
        return True

    def read_commit(self, khash: str, eid: str) -> CacheCommit | None:
        """This entry's commit when it exists and checks out, else None."""
        rel = f"{self.commit_dir(khash)}/{eid}.json"
        return self._read(rel, khash, eid) if self.st.exists(rel) else None

    def _read(self, rel: str, khash: str, eid: str) -> CacheCommit | None:
        where = self.st.uri(rel)
        try:
            c = CacheCommit.model_validate_json(self.st.read_bytes(rel, COMMIT_MAX_BYTES))
            seals.verify_record(self.keyring, seals.CACHE_ENTRY, self.scope, c, f"cache commit {where}")
        except FileNotFoundError:
            return None  # removed by a compaction since the listing
        except TransientError:
            raise  # the store did not answer: the plan's retry, not a silent miss of every entry
        except (ValidationError, ValueError, CommitError, OSError) as e:
            # anything else a writer of the cache folder can put there (a folder, an unreadable file) is that
            # entry's problem, never the plan's: it is skipped
            log.warning("cache: skipping %s: %s", where, str(e)[:300])
            return None
        problem = _check(c, khash, eid)
        if problem:
            log.warning("cache: skipping entry %s (%s): %s", eid, where, problem)
            return None
        return c

    def fetch(self, commits: Sequence[CacheCommit], dest: str) -> tuple[list[CacheCommit], list[str]]:
        """Verified local copies of the commits' parts under ``dest``: (the commits whose every part checked out,
        their local files). An entry with a missing or changed part is skipped whole, with a warning."""
        kept, files = [], []
        for c in commits:
            local = [os.path.join(dest, c.entry_id, f.path.rsplit("/", 1)[-1]) for f in c.files]
            try:
                for f, path in zip(c.files, local):
                    check_inside(self.st, f.path, self.st.uri(f"{self.commit_dir(c.key_hash)}/{c.entry_id}.json"))
                    self.st.fetch_verified(f.path, f.bytes, f.sha256, path)
            except TransientError:
                raise
            except (CommitError, OSError) as e:  # missing, changed, a folder, unreadable: that entry is skipped
                log.warning("cache: skipping entry %s: %s", c.entry_id, str(e)[:300])
                continue
            kept.append(c)
            files += local
        return kept, files

    # ---- writing ----------------------------------------------------------------------
    def write(self, khash: str, eid: str, local: str, rows: int, origin: dict[str, str], supersedes=()) -> bool:
        """Publish the local Parquet file ``local`` as entry ``eid``'s part, then its sealed commit (create-only,
        last); True when this call committed it, False when it was committed before."""
        rel = f"{ENTRIES}/{eid}/part-00000.parquet"
        self.st.publish(local, rel)
        faults.hit("cache.entry_data")
        size, digest = os.path.getsize(local), Storage(os.path.dirname(local)).sha256(os.path.basename(local))
        commit = CacheCommit(
            entry_id=eid,
            key_hash=khash,
            files=[CacheFileEntry(path=rel, bytes=size, sha256=digest, rows=rows)],
            rows=rows,
            source_output_uri=origin.get("output_uri", ""),
            source_config_hash=origin.get("config_hash", ""),
            source_spec_hash=origin.get("spec_hash", ""),
            versions={
                "airflow-provider-vllm": __version__,
                "duckdb": duckdb.__version__,
                "engine": origin.get("engine"),
            },
            created=now(),
            supersedes=sorted(supersedes),
        )
        body = seals.record_bytes(seals.seal_record(self.keyring, seals.CACHE_ENTRY, self.scope, commit))
        with faults.writing("cache.mid_commit"):
            made = self.st.create_only(f"{self.commit_dir(khash)}/{eid}.json", body)
        faults.hit("cache.after_commit")
        return made

    def compact(self, khash: str, workdir: str, memory_limit: str = "1GB") -> str | None:
        """When this key config has more than ``COMPACT_AFTER`` live entries: one entry with the newest answer per
        key of all of them, then the superseded commits and entries removed; the new entry's id, else None."""
        live = self.committed(khash)
        if len(live) <= COMPACT_AFTER:
            return None
        live, files = self.fetch(live, os.path.join(workdir, "compact-in"))
        if len(live) <= 1:
            return None
        eid = hashlib.sha256("\n".join(sorted(c.entry_id for c in live)).encode()).hexdigest()[:32]
        local = os.path.join(workdir, "compacted.parquet")
        con = duck.connect(memory_limit=memory_limit)
        try:
            # entries of the previous version hold the key as hex text: the same 32 bytes; columns an older
            # entry lacks are NULL (UNION ALL BY NAME)
            each = []
            for f in files:
                text = pa.types.is_string(pq.read_schema(f).field("key").type)
                key = "unhex(key)" if text else "key"
                each.append(f"SELECT {key} AS key, * EXCLUDE (key) FROM read_parquet({duck.local_list([f])})")
            con.execute(
                f"COPY (SELECT * FROM ({' UNION ALL BY NAME '.join(each)}) "
                f"QUALIFY row_number() OVER (PARTITION BY key ORDER BY {COMPUTED_AT} DESC, source_id) = 1 "
                f"ORDER BY key) TO '{local.replace(chr(39), chr(39) * 2)}' (FORMAT parquet, COMPRESSION zstd)"
            ).fetchall()
        finally:
            con.close()
        rows = pq.ParquetFile(local).metadata.num_rows
        self.write(khash, eid, local, rows, {"engine": "compaction"}, supersedes=[c.entry_id for c in live])
        made = self.read_commit(khash, eid)
        if made is None or made.seal is None:  # never remove what no verified commit supersedes
            return None
        # made from vouched entries only: vouched for by construction, before the entries it holds are removed
        if not self.vouch(khash, eid, made.seal.mac, "compaction", ""):
            return None  # its commit gone meanwhile: the entries it folded stay
        self.drop(khash, [c.entry_id for c in live])
        log.info("cache %s: compacted %d entries into %s (%d rows)", self.st.uri(), len(live), eid, rows)
        return eid

    def drop(self, khash: str, eids: Sequence[str]) -> None:
        """Remove entries a verified commit supersedes (or never published, ``sweep``): each commit first (the entry
        is then invisible at once), its part and its vouch record after."""
        for e in eids:
            self.st.remove(f"{self.commit_dir(khash)}/{e}.json")
            self.st.remove(f"{ENTRIES}/{e}", recursive=True)
            self.st.remove(f"{self.vouch_dir(khash)}/{e}.json")

    def vouch(
        self, khash: str, eid: str, commit_mac: str, by: Literal["publish", "compaction"], output_uri: str
    ) -> bool:
        """Write the sealed record that lets entry ``eid`` (exactly its commit sealed ``commit_mac``) serve later runs:
        atomically, replacing an earlier one (a publish run again; a commit written again since). Then the commit is
        read again: a merge's sweep (``drop``: the commit first, the record after) that removed it between the
        caller's read and this write left no record to remove, so this one is removed here (False): a record for no
        commit vouches for nothing and would stay in the folder for good. True: the record stands."""
        record = CacheVouch(
            entry_id=eid,
            key_hash=khash,
            commit_mac=commit_mac,
            vouched_by=by,
            source_output_uri=output_uri.rstrip("/"),
            created=now(),
        )
        body = seals.record_bytes(seals.seal_record(self.keyring, seals.CACHE_PUBLISHED, self.scope, record))
        faults.hit("cache.before_vouch")
        rel = f"{self.vouch_dir(khash)}/{eid}.json"
        with faults.writing("cache.mid_vouch"):
            self.st.write_atomic(rel, body)
        made = self.read_commit(khash, eid)
        if made is not None and made.seal is not None and made.seal.mac == commit_mac:
            return True
        self.st.remove(rel)
        log.warning(
            "cache %s: entry %s is not vouched for: its commit was %s while the record was written",
            self.st.uri(),
            eid,
            "removed (a merge's sweep, or a later merge of its output)" if made is None else "written again",
        )
        return False

    def sweep(self, khash: str, keep: str, at: datetime | None = None) -> list[str]:
        """Remove the sealed entries of this key config that no publish vouched for and whose sealed ``created`` is
        more than ``UNPUBLISHED_KEEP`` before ``at`` (their runs failed QA, were rejected or abandoned), ``keep``
        (this merge's own) aside; the ids removed. It reads at most ``MAX_COMMITS`` commits (the first by name) of a
        folder that holds more, so that each merge shrinks such a folder instead of reading none of it."""
        cutoff = (at or datetime.now(UTC)) - UNPUBLISHED_KEEP
        stale = []
        for c in self.committed(khash, vouched=False, at_most=True):
            try:
                made = datetime.fromisoformat(c.created)
            except ValueError:
                continue
            if c.entry_id != keep and made.tzinfo is not None and made < cutoff and not self.vouched(khash, c):
                stale.append(c.entry_id)
        if stale:
            self.drop(khash, stale)
            log.info("cache %s: removed %d entries no publish vouched for since %s", self.st.uri(), len(stale), cutoff)
        cutoff_temps = (at or datetime.now(UTC)) - TEMP_KEEP
        self._sweep_temps(self.vouch_dir(khash), cutoff_temps)
        self._sweep_temps(self.commit_dir(khash), cutoff_temps)  # a merge killed mid-commit (``create_only``)
        return stale

    def _sweep_temps(self, folder: str, cutoff: datetime) -> None:
        """Remove the temp files of killed writers (``is_temp_name``) in ``folder`` last modified before ``cutoff``.
        Local folders only (a write to an object store is one upload: no temp file); listed up to ``LISTING_MAX``
        (more than ``COMMITS_LISTED``, so that a folder its readers skip for them is cleaned), else a warning."""
        if not self.st.is_local:
            return
        try:
            names = [n for n in self.st.listdir(folder) if is_temp_name(n)]
        except FileNotFoundError:
            return
        except ListingTooLarge as e:
            log.warning("cache: temp files of %s not swept: %s", self.st.uri(folder), e)
            return
        removed = 0
        for n in names:
            rel = f"{folder}/{n}"
            try:
                st = self.st.lstat(rel)
                if st is None or not stat.S_ISREG(st.st_mode) or st.st_mtime >= cutoff.timestamp():
                    continue
                self.st.remove(rel)
                removed += 1
            except (OSError, CommitError) as e:  # another writer's link or folder there: left, named
                log.warning("cache: temp file %s not swept: %s", self.st.uri(rel), str(e)[:300])
        if removed:
            log.info(
                "cache %s: removed %d temp file(s) of killed writers before %s", self.st.uri(folder), removed, cutoff
            )


def _check(c: CacheCommit, khash: str, eid: str) -> str | None:
    """Why a sealed commit is still not one to read here (another config, another id, parts outside its entry)."""
    if c.key_hash != khash:
        return "it is a commit of another key config"
    if c.entry_id != eid:
        return f"the marker names entry {c.entry_id!r}"
    if sum(f.rows for f in c.files) != c.rows:
        return "its files' rows do not add up to its rows"
    for f in c.files:
        parts = f.path.split("/")
        if len(parts) != 3 or parts[0] != ENTRIES or parts[1] != eid or not _PART.match(parts[2]):
            return f"it names {f.path!r}, not a part of its own entry"
    return None
