"""The golden set (``qa.reference.golden_uri``) pinned by the plan and read by QA exactly as pinned.

``pin_golden_set`` (the plan task): list the golden set's Parquet files, refuse more than ``MAX_FILES`` files or
``MAX_BYTES`` in all on the sizes the store states (nothing read yet: a planted file of a TB is not hashed),
refuse a symbolic link below a golden folder on local disk (a ``golden_uri`` naming one file may itself be one: the
user's), then read every byte once: each file is copied into a private folder while it is hashed. The read itself
refuses a link below a golden folder (``golden_reader``: each path component opened with O_NOFOLLOW), so a file
swapped for a link after that check is not followed either. The result, ``GoldenSetPin``, goes into the sealed
``_plan.json`` (``reference.with_golden_set``, which also checks those copies as QA will read the pinned bytes:
columns, null and repeated ids; the pin is of exactly the bytes checked).

``checked_golden_set`` (QA): the folder must list the same files (one added or removed since the plan is
refused), and each is copied while it is hashed (``CheckedCopies``, read as the plan read it: ``golden_reader``,
a link below a golden folder refused by the read, naming it): a file that is not the planned size and sha256 is
refused, naming it; QA reads the copies, never the location again. A writer of the golden location
between plan and QA (or during QA) therefore fails the run instead of changing what gates its publish.

A plan without the pin (written before 2026-12) and a golden set: QA refuses, failing closed (plan again).
"""

from __future__ import annotations

import os

from airflow_provider_vllm.core.errors import (
    CommitError,
    DatasetError,
    InputChangedError,
    LinkRefused,
    SpecError,
    TransientError,
)
from airflow_provider_vllm.core.formats.files import Input, find_input
from airflow_provider_vllm.core.plan import GoldenSetPin, Plan
from airflow_provider_vllm.core.records import SHA256_HEX, PinnedFile
from airflow_provider_vllm.core.spec import JobSpec
from airflow_provider_vllm.core.storage import CheckedCopies, FileSystems, Storage

MAX_FILES = 1000
"""Files a golden set may have: an id -> label table is a handful of files; more is a folder of something else."""
MAX_BYTES = 8 * 1024**3
"""Bytes a golden set may have in all (the plan hashes every byte and QA copies them): ~10^8 labelled ids."""
REPLAN = (
    "the plan pinned the golden set's files (names, sizes and sha256) and QA scores only those bytes: put the "
    "planned file back as it was, or plan the run again (into a new output prefix) to measure against the new "
    "golden set"
)


def _where(uri: str) -> str:
    return f"qa.reference.golden_uri {uri}"


def names_the_file(root: Storage, name: str, uri: str | None) -> bool:
    """Whether the spec's ``uri`` names the file ``name`` under ``root`` itself (not a folder holding it): such a
    file may be a link, the user's own (``labels/current.parquet -> v7.parquet``), followed as an input URI's are."""
    return uri is not None and root.uri(name).rstrip("/") == uri.rstrip("/")


def golden_reader(root: Storage, name: str, uri: str | None) -> Storage:
    """The Storage that reads the golden file ``name`` under ``root`` (the folder ``find_input`` listed, its links
    followed): ``root`` itself for the file a ``uri`` names (``names_the_file``: a link there is the user's); for a
    file inside a golden folder, the same folder without following links below it (``Storage.follow_links`` off:
    each path component opened with O_NOFOLLOW, a FIFO or device refused after the open), so the read itself
    refuses a link (``LinkRefused``), one swapped in after ``_check_not_a_link`` too. The folder itself may be a link
    (the user's, as may its parents): only links below it are refused. Remote stores read the same either way."""
    if names_the_file(root, name, uri):
        return root
    return Storage(root.root, root.options, root.filesystems, follow_links=False)


def link_error(root: Storage, name: str, where: str, param: str = "qa.reference.golden_uri") -> SpecError:
    """The SpecError for a symbolic link at or above the golden file ``name`` below the folder ``root`` that the
    spec's ``param`` names (``where``: the parameter and its value): the user's own folder, so the message says what
    the plan reads and what to do, not what the provider writes."""
    return SpecError(
        f"{where}: {root.uri(name)} is a symbolic link (or lies under one). The plan reads only the files of the "
        f"folder {param} names, never through a link below it (whoever can write that folder could point one at "
        f"any file the plan can read). Replace the link with a copy of the file it points to, or set {param} to "
        "one file (a link it names itself is followed)"
    )


def removed_error(root: Storage, name: str, where: str) -> TransientError:
    """The TransientError for the golden file ``name`` below ``root`` removed after the plan listed it (``where``:
    the spec's parameter and its value): its writer is at work; a retry of the plan lists the folder again."""
    return TransientError(
        f"{where}: {root.uri(name)} was removed after the plan listed it (its writer is at work?); a retry of the "
        "plan lists the folder again"
    )


def _check_not_a_link(
    root: Storage, name: str, where: str, param: str = "qa.reference.golden_uri", uri: str | None = None
) -> None:
    """SpecError when the local file ``name`` under ``root`` is a symbolic link or lies under one. A ``uri`` (the
    spec's) that names the file itself may be a link (``labels/current.parquet -> v7.parquet``): that link is the
    user's, as an input URI's are (the plan pins the bytes it reaches); only a link below a golden folder is refused.
    A check before any file is read (naming the file); the reads refuse a link themselves (``golden_reader``)."""
    if not root.is_local or names_the_file(root, name, uri):
        return
    expected = os.path.join(os.path.realpath(root.base), name)
    if os.path.realpath(root.path(name)) != expected:
        raise link_error(root, name, where, param)


def check_golden_files(
    found: Input, where: str, what: str = "golden set", uri: str | None = None, param: str = "qa.reference.golden_uri"
) -> None:
    """SpecError, naming ``where`` and the file, when the golden files ``found`` are more than ``MAX_FILES``, or
    more than ``MAX_BYTES`` in all on the sizes the store states (nothing read yet: a planted file of a TB is refused
    unread), or (local) one is a symbolic link or lies under one (``link_error``, naming ``param``). The golden
    set's bounds, also the ride-along golden rows' (``steps/golden.py``)."""
    if len(found.files) > MAX_FILES:
        raise SpecError(f"{where}: {len(found.files)} files, more than {MAX_FILES}; point it at the {what}")
    total = 0
    for f in found.files:  # as the store states the sizes: nothing read yet
        total += f.size
        if total > MAX_BYTES:
            raise SpecError(
                f"{where}: {found.root.uri(f.path)} ({f.size} bytes) takes the {what} over {MAX_BYTES} "
                "bytes; refused unread (a golden set is an id -> label table)"
            )
    for f in found.files:
        _check_not_a_link(found.root, f.path, where, param, uri)


def pin_golden_set(
    spec: JobSpec, tmp: str, filesystems: FileSystems | None = None
) -> tuple[GoldenSetPin, list[str]] | None:
    """The golden set's files with their sizes and sha256, and the local paths of their copies in ``tmp`` (a private
    folder), each copied while it was hashed (``CheckedCopies.pin``): one read of each file, and the pin is of
    exactly the bytes the copies hold, which the plan then checks as QA will read them. None without
    ``qa.reference.golden_uri``.

    SpecError / DatasetError naming the file: too many files, too many bytes (before any is read), a link;
    TransientError naming it: a file that changed while it was read, or was removed after it was listed (its writer
    at work: a retry of the plan lists the folder again)."""
    uri = spec.qa.reference.golden_uri
    if uri is None:
        return None
    try:
        found = find_input(uri, spec.io.storage_options, "parquet", filesystems)
    except DatasetError as e:
        raise DatasetError(f"{_where(uri)}: {e}") from None
    check_golden_files(found, _where(uri), uri=uri)
    files, paths = [], []
    for f in found.files:
        try:  # a file inside a golden folder read without following links: a link swapped in since is refused
            local, digest = CheckedCopies(golden_reader(found.root, f.path, uri), tmp).pin(f.path, f.size)
        except LinkRefused:
            raise link_error(found.root, f.path, _where(uri)) from None
        except FileNotFoundError:  # listed, then removed before it was read
            raise removed_error(found.root, f.path, _where(uri)) from None
        if not SHA256_HEX.fullmatch(digest):  # another size than listed: written while the plan read it
            raise TransientError(
                f"{_where(uri)}: {found.root.uri(f.path)} changed while the plan read it ({digest}): its writer is at "
                "work; a retry of the plan lists the folder again"
            )
        files.append(PinnedFile(path=f.path, bytes=f.size, sha256=digest))
        paths.append(local)
    return GoldenSetPin(uri=uri, root=found.root.uri(""), files=files), paths


def checked_golden_set(
    spec: JobSpec, plan: Plan, tmp: str, filesystems: FileSystems | None = None
) -> tuple[GoldenSetPin, list[str]]:
    """The golden set the plan pinned and the local paths of its files, each copied and checked (size and sha256)
    into ``tmp`` (a private folder). InputChangedError naming the file when one changed, was added or is gone since
    the plan; SpecError when the plan pinned none (a plan from before the pin) or another location."""
    uri = spec.qa.reference.golden_uri
    assert uri is not None
    pin = plan.golden_set
    if pin is None:
        raise SpecError(
            f"{_where(uri)}: the run's plan pinned no golden set (a plan written before QA pinned it, 2026-12): QA "
            "does not score against labels nothing pinned; plan the run again (into a new output prefix)"
        )
    if pin.uri != uri:
        raise SpecError(f"{_where(uri)}: the plan pinned the golden set {pin.uri}; plan the run again")
    try:
        found = find_input(uri, spec.io.storage_options, "parquet", filesystems)
    except DatasetError as e:
        raise InputChangedError(f"{_where(uri)}: {e}; {REPLAN}") from None
    root = found.root
    planned = {f.path for f in pin.files}
    now = set(found.names)
    if root.uri("") != pin.root or now != planned:
        added, gone = sorted(now - planned), sorted(planned - now)
        what = "; ".join(
            x
            for x in (
                f"added since the plan: {', '.join(added[:5])}" if added else "",
                f"gone since the plan: {', '.join(gone[:5])}" if gone else "",
                f"its folder is {root.uri('')}, the plan's {pin.root}" if root.uri("") != pin.root else "",
            )
            if x
        )
        raise InputChangedError(f"{_where(uri)}: its files are not the ones the plan pinned ({what}); {REPLAN}")
    paths = []
    for f in pin.files:
        try:  # a file inside a golden folder read without following links (``golden_reader``)
            paths.append(CheckedCopies(golden_reader(root, f.path, uri), tmp).get(f.path, f.bytes, f.sha256))
        except LinkRefused:
            raise link_error(root, f.path, _where(uri)) from None
        except (CommitError, FileNotFoundError) as e:
            raise InputChangedError(
                f"{_where(uri)}: {root.uri(f.path)} changed since the plan (it is not the {f.bytes} bytes of sha256 "
                f"{f.sha256[:16]}... the plan pinned: {type(e).__name__}); {REPLAN}"
            ) from None
    return pin, paths


def golden_set_info(pin: GoldenSetPin) -> dict[str, object]:
    """What the QA report names of the golden set it measured against (``report.json``'s ``run.golden_set``)."""
    return {"uri": pin.uri, "files": [f.model_dump() for f in pin.files]}
