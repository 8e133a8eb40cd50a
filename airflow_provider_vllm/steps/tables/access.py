"""Which Iceberg tables a deployment allows, and loading one through its catalog (pure; pyiceberg lazily).

The catalog is built by the Airflow side from the Connection the deployment names (``hooks/iceberg.py``);
the steps only receive it. ``allowed_tables`` is ``[vllm_batch] allowed_tables``: identifiers
(``namespace.table``) or whole namespaces (``namespace.*``). Empty refuses every table: fail closed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from airflow_provider_vllm.core.allow_list import parse_list_setting
from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.core.spec import TABLE_IDENTIFIER

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog
    from pyiceberg.table import Table

_PATTERN = re.compile(TABLE_IDENTIFIER)
_NAMESPACE = re.compile(TABLE_IDENTIFIER.replace("{1,3}", "{0,2}").removesuffix("$") + r"\.\*$")


def parse_allowed_tables(raw: str | Sequence[str] | None, setting: str = "allowed_tables") -> list[str]:
    """The allowed identifiers and ``namespace.*`` patterns; SpecError naming ``setting`` for a malformed entry."""
    out = parse_list_setting(raw, setting)
    for item in out:
        if not (_PATTERN.match(item) or _NAMESPACE.match(item)):
            raise SpecError(f"{setting}: {item!r} is neither namespace.table nor namespace.*")
    return out


def table_allowed(identifier: str, allowed: Sequence[str]) -> bool:
    """True when ``identifier`` is listed, or lies in a listed ``namespace.*`` (whole segments)."""
    for a in allowed:
        if a.endswith(".*"):
            if identifier.startswith(a[:-1]) and identifier.count(".") == a.count("."):
                return True
        elif a == identifier:
            return True
    return False


@dataclass(frozen=True)
class Tables:
    """What the steps need to reach tables: the deployment's catalog and its rules.

    ``catalog``: a pyiceberg ``Catalog`` (the deployment's Connection); ``allowed``: ``[vllm_batch]
    allowed_tables``; ``setting``: how a person sets it (for messages); ``conn_id``: the Connection's id;
    ``uri_prefixes``: ``[vllm_batch] allowed_uri_prefixes`` (canonical), which every data file a job reads must
    lie under (empty: syntax checks only, as with ``allow_any_location``).
    """

    catalog: Catalog | None
    allowed: list[str] = field(default_factory=list)
    uri_prefixes: list[str] = field(default_factory=list)
    setting: str = "[vllm_batch] allowed_tables"
    conn_id: str = ""

    def check(self, identifier: str, what: str) -> None:
        """SpecError unless the deployment allows ``identifier`` (``what``: the job field naming it)."""
        if not self.allowed:
            raise SpecError(
                f"{what}={identifier!r}: no tables are allowed: set {self.setting} to the tables (namespace.table) "
                "or namespaces (namespace.*) jobs may read and publish to"
            )
        if not table_allowed(identifier, self.allowed):
            raise SpecError(f"{what}={identifier!r} is not among the tables {self.setting} allows ({self.allowed})")

    def load(self, identifier: str, what: str) -> Table:
        """The table, after ``check``; SpecError when the catalog has no such table."""
        from pyiceberg.exceptions import NoSuchTableError

        self.check(identifier, what)
        if self.catalog is None:
            raise SpecError(f"{what}={identifier!r}: no Iceberg catalog is configured")
        try:
            return self.catalog.load_table(identifier)
        except NoSuchTableError:
            raise SpecError(f"{what}={identifier!r}: no such table in the catalog of {self.describe()}") from None

    def describe(self) -> str:
        return f"Connection {self.conn_id!r}" if self.conn_id else f"catalog {getattr(self.catalog, 'name', None)!r}"


def summary_of(snapshot: Any) -> dict[str, str]:
    """A snapshot's summary properties as a plain dict (empty when it has none)."""
    summary = getattr(snapshot, "summary", None)
    if summary is None:
        return {}
    return {str(k): str(v) for k, v in summary.additional_properties.items()} | {"operation": summary.operation.value}


def in_history(table: Table, snapshot_id: int, head: Any = None) -> tuple[bool, Any]:
    """Whether ``snapshot_id`` is ``head`` (default: the current snapshot of ``main``) or one of its ancestors, and,
    when it was not found, the snapshot where the walk back stopped short because its parent was expired (None:
    the walk reached the first snapshot of that line, so the answer is sure)."""
    found, cut = walk_back(table, head, lambda snap: snap.snapshot_id == snapshot_id)
    target = table.snapshot_by_id(snapshot_id)
    if cut is not None and target is not None and (target.sequence_number or 0) >= (cut.sequence_number or 0) > 0:
        return False, None  # sequence numbers grow along a line: a snapshot not older than the cut is not beyond it
    return found is not None, cut


def history_cut_since(table: Table, since_ms: int) -> Any:
    """The snapshot of ``main``'s history committed at or after ``since_ms`` (ms since the epoch) whose parent was
    expired, or None when main's history back to that time is whole."""
    return walk_back(table, None, lambda snap: snap.timestamp_ms < since_ms)[1]


def walk_back(table: Table, head: Any, stop: Callable[[Any], bool]) -> tuple[Any, Any]:
    """Walk back from ``head`` (default: ``main``'s current snapshot): (the first snapshot ``stop`` accepts, None),
    or (None, the snapshot where the walk stopped short because its parent was expired, or None at a first one).

    pyiceberg's ``ancestors_of`` ends at an expired parent as at a first snapshot. An expiry leaves the child's
    parent id dangling (Java catalogs) or clears it (pyiceberg's own metadata update). A snapshot without a parent
    had one all the same when it still lists manifests other snapshots added, or when its sequence number is above
    1 (format 2 on: the table's first commit has 1), so snapshots came before it: counted as cut, since whether
    they were its ancestors cannot be told. A format 1 table has no sequence numbers, and a snapshot that rewrote
    every data file (compaction) lists only manifests of its own: there, every snapshot without a parent counts
    as cut (fail closed), the table's first included. A parent id that repeats one walked (a cycle another writer
    committed) is a cut too."""
    snap = table.current_snapshot() if head is None else head
    walked: set[int] = set()
    while snap is not None:
        if stop(snap):
            return snap, None
        walked.add(snap.snapshot_id)
        if snap.parent_snapshot_id is None:
            later = (snap.sequence_number or 0) > 1 or table.metadata.format_version < 2
            inherited = later or bool({m.added_snapshot_id for m in snap.manifests(table.io)} - walked - {None})
            return None, (snap if inherited else None)
        # a catalog checks no parent id: one a writer made repeat (a cycle) is a history that cannot be told
        parent = None if snap.parent_snapshot_id in walked else table.snapshot_by_id(snap.parent_snapshot_id)
        if parent is None:
            return None, snap
        snap = parent
    return None, None


def expired_parent(cut: Any) -> str:
    """``cut`` (from ``in_history``) and its expired parent, for messages."""
    if cut.parent_snapshot_id is None and not cut.sequence_number:
        return (
            f"snapshot {cut.snapshot_id}, which has no parent: in a table of format 1 (no sequence numbers) that "
            "cannot be told from a snapshot whose parent was expired"
        )
    parent = f" {cut.parent_snapshot_id}" if cut.parent_snapshot_id is not None else " (its id cleared by the expiry)"
    return f"snapshot {cut.snapshot_id}, whose parent{parent} was expired"
