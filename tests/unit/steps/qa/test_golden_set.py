"""The golden set (``qa.reference.golden_uri``) is pinned by the plan and QA scores exactly those bytes: a golden
file swapped (same size and mtime), added, removed or linked since the plan is refused, naming it; a planted huge
file is refused before a byte is read; the report names the files and their sha256."""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_vllm.core.errors import CommitError, DatasetError, InputChangedError, SpecError
from airflow_provider_vllm.core.storage import Storage
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.steps.qa.stage import qa_run
from airflow_provider_vllm.worker.shard import run_shard
from tests.support.data import LABELS, make_spec, merge, shard_task, write_parquet
from tests.support.fakes import FakeEngine

N = 60
IDS = [f"t{i:03d}" for i in range(N)]


def _golden_bytes(labels: list[str]) -> bytes:
    buf = io.BytesIO()
    # plain encoding: a file of the same labels in another order has the same size
    pq.write_table(pa.table({"id": IDS, "label": labels}), buf, compression="none", use_dictionary=False)
    return buf.getvalue()


def _planned_run(tmp_path: Path, golden_uri: str, **io_over):
    """Plan, shards (fake engine) and merge of a run scored against ``golden_uri``; QA is left to the test."""
    write_parquet(tmp_path / "in" / "a.parquet", IDS, [f"{LABELS[i % 5]} ticket {i}" for i in range(N)])
    spec = make_spec(tmp_path / "in", tmp_path / "out", qa={"reference": {"golden_uri": golden_uri}}, **io_over)
    plan = plan_job(spec)
    for shard in plan.shards:
        run_shard(
            shard_task(spec=spec, shard_id=shard.shard_id), engine_factory=lambda s: FakeEngine(s, real_vllm=False)
        )
    merge(spec)
    return spec, plan


def _truth() -> list[str]:
    return [LABELS[i % 5] for i in range(N)]


def _wrong() -> list[str]:
    return [LABELS[(i + 1) % 5] for i in range(N)]  # the same labels in another order: a file of the same size


def _accuracy(tmp_path: Path, labels: list[str]) -> float:
    """Accuracy of the published answers against ``labels`` (every id labelled; an error row is wrong)."""
    res = pq.read_table(tmp_path / "out" / "results", columns=["id", "label"]).to_pylist()
    truth = dict(zip(IDS, labels))
    return sum(r["label"] == truth[r["id"]] for r in res) / N


def test_the_plan_pins_the_golden_set_and_the_report_names_it(tmp_path):
    golden = tmp_path / "golden" / "g.parquet"
    golden.parent.mkdir()
    golden.write_bytes(_golden_bytes(_truth()))
    spec, plan = _planned_run(tmp_path, str(golden.parent))
    digest = hashlib.sha256(golden.read_bytes()).hexdigest()
    assert plan.golden_set is not None and plan.golden_set.uri == str(golden.parent)
    assert [f.model_dump() for f in plan.golden_set.files] == [
        {"path": "g.parquet", "bytes": golden.stat().st_size, "sha256": digest}
    ]
    report, paths = qa_run(spec)
    assert report.metrics["quality"]["accuracy"]["value"] == pytest.approx(_accuracy(tmp_path, _truth()))
    stored = json.loads((tmp_path / "out" / paths["report_json"]).read_text())
    assert stored["run"]["golden_set"] == {
        "uri": str(golden.parent),
        "files": [{"path": "g.parquet", "bytes": golden.stat().st_size, "sha256": digest}],
    }
    assert digest in (tmp_path / "out" / paths["report_html"]).read_text()


def test_a_golden_file_swapped_after_the_plan_same_size_and_mtime_is_refused(tmp_path):
    golden = tmp_path / "golden.parquet"
    golden.write_bytes(_golden_bytes(_truth()))
    spec, _ = _planned_run(tmp_path, str(golden))
    st = golden.stat()
    swapped = _golden_bytes(_wrong())
    assert len(swapped) == st.st_size  # a swap the store's size (and, below, mtime) cannot tell
    golden.write_bytes(swapped)
    os.utime(golden, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(InputChangedError, match=r"golden\.parquet changed since the plan.*plan the run again") as e:
        qa_run(spec)
    assert str(golden) in str(e.value)
    assert not (tmp_path / "out" / "qa" / "_QA.json").exists()


@pytest.mark.parametrize("change", ["added", "removed"])
def test_a_golden_folder_that_gained_or_lost_a_file_since_the_plan_is_refused(tmp_path, change):
    folder = tmp_path / "golden"
    folder.mkdir()
    (folder / "a.parquet").write_bytes(_golden_bytes(_truth()))
    pq.write_table(pa.table({"id": ["x1"], "label": ["bug"]}), folder / "b.parquet")
    spec, _ = _planned_run(tmp_path, str(folder))
    if change == "added":
        pq.write_table(pa.table({"id": ["x2"], "label": ["bug"]}), folder / "c.parquet")
    else:
        (folder / "b.parquet").unlink()
    said = "added since the plan: c.parquet" if change == "added" else "gone since the plan: b.parquet"
    with pytest.raises(InputChangedError, match=rf"{said}.*plan the run again"):
        qa_run(spec)


def test_qa_scores_the_checked_copy_when_the_file_is_swapped_right_after_its_check(tmp_path, monkeypatch):
    golden = tmp_path / "golden.parquet"
    golden.write_bytes(_golden_bytes(_truth()))
    spec, _ = _planned_run(tmp_path, str(golden))
    from airflow_provider_vllm.steps.qa import stage

    attach = stage.attach_references

    def swap_then_attach(con, found):  # after QA found (and checked) the golden set, before it reads the labels
        golden.write_bytes(_golden_bytes(_wrong()))
        return attach(con, found)

    monkeypatch.setattr(stage, "attach_references", swap_then_attach)
    report, _ = qa_run(spec)
    expected = _accuracy(tmp_path, _truth())  # the labels the plan pinned, not the swapped ones
    assert expected != _accuracy(tmp_path, _wrong())
    assert report.metrics["quality"]["accuracy"]["value"] == pytest.approx(expected)


def test_a_planted_huge_golden_file_is_refused_by_the_plan_before_it_reads_a_byte(tmp_path, monkeypatch):
    folder = tmp_path / "golden"
    folder.mkdir()
    (folder / "a.parquet").write_bytes(_golden_bytes(_truth()))
    with open(folder / "huge.parquet", "wb") as f:  # sparse: no disk used
        f.truncate(8 * 1024**3)  # golden_set.MAX_BYTES

    def never(*a, **k):
        raise AssertionError("a byte was read")

    real_open_read = Storage._open_read

    def not_huge(self, rel):
        assert not rel.endswith("huge.parquet"), "a byte was read"
        return real_open_read(self, rel)

    monkeypatch.setattr(Storage, "sha256", never)
    monkeypatch.setattr(Storage, "_open_read", not_huge)  # the plan's copy of each golden file opens through it
    with pytest.raises(SpecError, match=r"huge\.parquet \(\d+ bytes\) takes the golden set over .* refused unread"):
        _planned_run(tmp_path, str(folder))
    assert not (tmp_path / "out" / "_plan.json").exists()


def test_a_symbolic_link_in_the_golden_folder_is_refused_by_the_plan(tmp_path):
    folder = tmp_path / "golden"
    folder.mkdir()
    (tmp_path / "elsewhere.parquet").write_bytes(_golden_bytes(_truth()))
    (folder / "g.parquet").symlink_to(tmp_path / "elsewhere.parquet")
    with pytest.raises(SpecError, match=r"g\.parquet is a symbolic link"):
        _planned_run(tmp_path, str(folder))


def _swap_for_a_link_before_its_read(monkeypatch, file: Path, target: Path) -> list[str]:
    """Replace ``file`` (atomically) with a symbolic link to ``target`` right before the first read of it opens it:
    after any check of the listed file, as another writer of the golden folder would. The paths swapped."""
    real_open_read = Storage._open_read
    swapped: list[str] = []

    def swap_then_open(self, rel):
        if rel == file.name and not swapped:
            link = file.with_name(".swap")
            link.symlink_to(target)
            os.replace(link, file)
            swapped.append(self.uri(rel))
        return real_open_read(self, rel)

    monkeypatch.setattr(Storage, "_open_read", swap_then_open)
    return swapped


def test_a_golden_file_swapped_for_a_link_after_its_check_is_refused_by_the_plan(tmp_path, monkeypatch):
    """The link check and the read were two steps: a file of a golden folder swapped for a link in between was
    followed (to any file the plan's process can read) and its bytes pinned. The read itself refuses it now."""
    folder = tmp_path / "golden"
    folder.mkdir()
    (folder / "g.parquet").write_bytes(_golden_bytes(_truth()))
    elsewhere = tmp_path / "elsewhere.parquet"  # a valid golden file of other labels, outside the folder
    elsewhere.write_bytes(_golden_bytes(_wrong()))
    swapped = _swap_for_a_link_before_its_read(monkeypatch, folder / "g.parquet", elsewhere)
    with pytest.raises(SpecError, match=r"golden/g\.parquet is a symbolic link") as e:
        _planned_run(tmp_path, str(folder))
    assert swapped == [str(folder / "g.parquet")]  # the race happened: swapped after the check, before the read
    assert str(folder / "g.parquet") in str(e.value)
    assert not (tmp_path / "out" / "_plan.json").exists()


def test_a_golden_file_removed_after_the_plan_listed_it_is_a_transient_error_naming_the_field_and_file(
    tmp_path, monkeypatch
):
    """A file of the golden folder removed between the plan's listing and its read (its writer at work) failed the
    plan with a bare FileNotFoundError that named neither ``qa.reference.golden_uri`` nor the file. It is a
    TransientError naming both: a retry of the plan lists the folder again."""
    from airflow_provider_vllm.core.errors import TransientError

    folder = tmp_path / "golden"
    folder.mkdir()
    (folder / "a.parquet").write_bytes(_golden_bytes(_truth()))
    (folder / "g.parquet").write_bytes(_golden_bytes(_truth()))
    real_open_read = Storage._open_read

    def removed_then_open(self, rel):
        if rel == "g.parquet":
            (folder / "g.parquet").unlink(missing_ok=True)
        return real_open_read(self, rel)

    monkeypatch.setattr(Storage, "_open_read", removed_then_open)
    with pytest.raises(TransientError, match=r"qa\.reference\.golden_uri .*golden/g\.parquet was removed after") as e:
        _planned_run(tmp_path, str(folder))
    assert "a retry of the plan lists the folder again" in str(e.value)
    assert not (tmp_path / "out" / "_plan.json").exists()


def test_a_golden_file_that_grows_after_the_plan_listed_it_is_a_transient_error_naming_the_field_and_file(
    tmp_path, monkeypatch
):
    """A file of the golden folder written to between the plan's listing and its read (its writer at work) is read no
    further than the size listed, and fails the plan with a TransientError naming ``qa.reference.golden_uri`` and the
    file, as a removed one does: a retry of the plan lists the folder again (it was a DatasetError, never retried)."""
    from airflow_provider_vllm.core.errors import TransientError

    folder = tmp_path / "golden"
    folder.mkdir()
    (folder / "g.parquet").write_bytes(_golden_bytes(_truth()))
    real_open_read = Storage._open_read

    def grown_then_open(self, rel):
        if rel == "g.parquet":
            with open(folder / "g.parquet", "ab") as f:
                f.write(b"\0" * 4096)
        return real_open_read(self, rel)

    monkeypatch.setattr(Storage, "_open_read", grown_then_open)
    with pytest.raises(TransientError, match=r"qa\.reference\.golden_uri .*golden/g\.parquet changed while") as e:
        _planned_run(tmp_path, str(folder))
    assert "a retry of the plan lists the folder again" in str(e.value)
    assert not (tmp_path / "out" / "_plan.json").exists()


def test_a_golden_file_swapped_for_a_link_after_its_check_is_refused_by_qa(tmp_path, monkeypatch):
    """QA's read refuses the link too, even to a copy of the very bytes the plan pinned (it is not read at all)."""
    folder = tmp_path / "golden"
    folder.mkdir()
    (folder / "g.parquet").write_bytes(_golden_bytes(_truth()))
    spec, plan = _planned_run(tmp_path, str(folder))
    assert plan.golden_set is not None
    same = tmp_path / "same.parquet"  # the pinned bytes: only the link tells it apart
    same.write_bytes((folder / "g.parquet").read_bytes())
    swapped = _swap_for_a_link_before_its_read(monkeypatch, folder / "g.parquet", same)
    with pytest.raises(SpecError, match=r"golden/g\.parquet is a symbolic link"):
        qa_run(spec)
    assert swapped == [str(folder / "g.parquet")]
    assert not (tmp_path / "out" / "qa" / "_QA.json").exists()


def test_a_golden_folder_that_is_itself_a_link_is_the_users_and_is_read(tmp_path):
    """The golden folder itself may be a link (``labels/current -> v7``, the user's): only links below it are
    refused, by the plan's read and QA's."""
    v7 = tmp_path / "labels" / "v7"
    v7.mkdir(parents=True)
    (v7 / "g.parquet").write_bytes(_golden_bytes(_truth()))
    (tmp_path / "labels" / "current").symlink_to(v7)
    spec, plan = _planned_run(tmp_path, str(tmp_path / "labels" / "current"))
    digest = hashlib.sha256((v7 / "g.parquet").read_bytes()).hexdigest()
    assert plan.golden_set is not None and [(f.path, f.sha256) for f in plan.golden_set.files] == [
        ("g.parquet", digest)
    ]
    report, _ = qa_run(spec)
    assert report.metrics["quality"]["accuracy"]["value"] == pytest.approx(_accuracy(tmp_path, _truth()))


def test_a_fifo_in_the_golden_folder_fails_the_plan_unopened(tmp_path):
    folder = tmp_path / "golden"
    folder.mkdir()
    (folder / "a.parquet").write_bytes(_golden_bytes(_truth()))
    os.mkfifo(folder / "b.parquet")  # an open for reading would block the plan forever
    with pytest.raises(CommitError, match=r"b\.parquet is not a regular file"):
        _planned_run(tmp_path, str(folder))
    assert not (tmp_path / "out" / "_plan.json").exists()


def test_a_plan_without_the_pin_is_refused_by_qa(tmp_path, monkeypatch):
    """Fail closed: a plan sealed before the pin (2026-12) gets no score from labels nothing pinned."""
    from airflow_provider_vllm.steps.plan import planner

    monkeypatch.setattr(planner, "with_golden_set", lambda plan, *a, **k: plan, raising=False)  # an older planner
    golden = tmp_path / "golden.parquet"
    golden.write_bytes(_golden_bytes(_truth()))
    spec, plan = _planned_run(tmp_path, str(golden))
    assert plan.golden_set is None
    with pytest.raises(SpecError, match=r"pinned no golden set .* plan the run again"):
        qa_run(spec)
    assert not (tmp_path / "out" / "qa" / "_QA.json").exists()


def test_a_golden_set_that_is_not_parquet_is_refused_by_the_plan(tmp_path):
    (tmp_path / "golden.jsonl").write_text('{"id": "t000", "label": "bug"}\n')
    with pytest.raises(DatasetError, match=r"qa.reference.golden_uri .*golden\.jsonl.*jsonl"):
        _planned_run(tmp_path, str(tmp_path / "golden.jsonl"))
    assert not (tmp_path / "out" / "_plan.json").exists()


@pytest.mark.parametrize(
    "table,match",
    [
        ({"id": ["t001", "t001"], "label": ["bug", "bug"]}, r"1 repeated id\(s\) in 'id', e.g. \['t001'\]"),
        ({"id": ["t001", None], "label": ["bug", "bug"]}, r"1 row\(s\) with a null 'id'"),
        ({"id": ["t001"], "answer": ["bug"]}, r"no column 'label' \(the label column\)"),
    ],
)
def test_a_golden_set_that_cannot_grade_the_run_fails_the_plan_before_any_shard(tmp_path, table, match):
    golden = tmp_path / "golden.parquet"
    pq.write_table(pa.table(table), golden)
    with pytest.raises(SpecError, match=match) as e:
        _planned_run(tmp_path, str(golden))
    assert str(golden) in str(e.value)
    assert not (tmp_path / "out" / "_plan.json").exists()


@pytest.mark.parametrize(
    "bad", [{"path": "../x.parquet"}, {"path": "/etc/x"}, {"sha256": "0" * 63}, {"bytes": -1}, {"bytes": "many"}]
)
def test_a_pinned_golden_file_of_the_wrong_shape_is_refused(bad):
    from airflow_provider_vllm.core.records import PinnedFile

    good = {"path": "g.parquet", "bytes": 10, "sha256": "0" * 64}
    with pytest.raises(ValueError):
        PinnedFile.model_validate(good | bad)


def test_the_golden_set_on_s3_is_pinned_and_a_swap_is_refused(tmp_path, monkeypatch):
    """On a local S3 server (moto): the plan hashes the object, QA copies and checks it, and a rewritten object
    of the same size is refused."""
    import boto3

    from tests.support.s3server import MotoServer

    with MotoServer() as s3:
        s3.make_bucket("gold")
        for k, v in s3.deployment_env.items():
            monkeypatch.setenv(k, v)
        client = boto3.client("s3", endpoint_url=s3.endpoint, region_name="us-east-1")
        client.put_object(Bucket="gold", Key="set/g.parquet", Body=_golden_bytes(_truth()))
        spec, plan = _planned_run(tmp_path, "s3://gold/set")
        assert plan.golden_set is not None
        assert [f.sha256 for f in plan.golden_set.files] == [hashlib.sha256(_golden_bytes(_truth())).hexdigest()]
        report, _ = qa_run(spec)
        assert report.metrics["quality"]["accuracy"]["value"] == pytest.approx(_accuracy(tmp_path, _truth()))
        client.put_object(Bucket="gold", Key="set/g.parquet", Body=_golden_bytes(_wrong()))
        with pytest.raises(InputChangedError, match=r"s3://gold/set/g\.parquet changed since the plan"):
            qa_run(spec)


def test_the_plan_reads_each_golden_file_once_and_checks_the_very_bytes_it_pins(tmp_path, monkeypatch):
    """The plan hashed each golden file, then copied it again to check it as QA reads it: two reads (up to 2 x 8 GiB
    on an object store), and a file rewritten in between failed the plan. Each file is now copied once while it is
    hashed, and the copy is what is checked: the pin is the sha256 of the bytes checked, whatever the folder holds
    by then (QA compares the folder with the pin)."""
    from airflow_provider_vllm.steps.qa import reference

    golden = tmp_path / "golden" / "g.parquet"
    golden.parent.mkdir()
    golden.write_bytes(_golden_bytes(_truth()))
    opens: list[str] = []
    real_open_read = Storage._open_read

    def counted(self, rel):
        if rel == "g.parquet":
            opens.append(self.uri(rel))
        return real_open_read(self, rel)

    real_pin, real_attach = reference.pin_golden_set, reference.attach_references

    def pin_then_rewrite(*a, **k):  # a writer of the golden folder, right after the plan read it
        pinned = real_pin(*a, **k)
        golden.write_bytes(_golden_bytes(_wrong()))
        return pinned

    checked: list[str] = []

    def attach(con, found):  # the bytes the plan checks as QA will read them
        checked.extend(hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in found.local)
        return real_attach(con, found)

    monkeypatch.setattr(Storage, "_open_read", counted)
    monkeypatch.setattr(reference, "pin_golden_set", pin_then_rewrite)
    monkeypatch.setattr(reference, "attach_references", attach)
    spec = make_spec(tmp_path / "in", tmp_path / "out", qa={"reference": {"golden_uri": str(golden.parent)}})
    write_parquet(tmp_path / "in" / "a.parquet", IDS, [f"{LABELS[i % 5]} ticket {i}" for i in range(N)])
    plan = plan_job(spec)
    assert opens == [str(golden)]  # one read of the golden file
    assert [f.sha256 for f in plan.golden_set.files] == checked == [hashlib.sha256(_golden_bytes(_truth())).hexdigest()]


def test_the_plan_fetches_each_golden_object_once_on_s3(tmp_path, monkeypatch):
    """GetObject bytes of the golden object during the plan, on a local S3 server (moto): its size, once."""
    import boto3
    import s3fs

    from tests.support.s3server import MotoServer

    body = _golden_bytes(_truth())
    got: list[int] = []
    real = s3fs.S3FileSystem._call_s3

    async def counted(self, method, *a, **kw):
        out = await real(self, method, *a, **kw)
        if method == "get_object" and kw.get("Key") == "set/g.parquet":
            got.append(int(out["ContentLength"]))
        return out

    with MotoServer() as s3:
        s3.make_bucket("gold")
        for k, v in s3.deployment_env.items():
            monkeypatch.setenv(k, v)
        boto3.client("s3", endpoint_url=s3.endpoint, region_name="us-east-1").put_object(
            Bucket="gold", Key="set/g.parquet", Body=body
        )
        write_parquet(tmp_path / "in" / "a.parquet", IDS, [f"{LABELS[i % 5]} ticket {i}" for i in range(N)])
        spec = make_spec(tmp_path / "in", tmp_path / "out", qa={"reference": {"golden_uri": "s3://gold/set"}})
        monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counted)
        plan = plan_job(spec)
    assert [f.sha256 for f in plan.golden_set.files] == [hashlib.sha256(body).hexdigest()]
    assert sum(got) == len(body)  # every byte fetched once


def test_a_golden_uri_that_is_itself_a_link_is_the_users_and_is_followed(tmp_path):
    """``golden_uri`` naming a link (``labels/current.parquet -> v7.parquet``) is the user's own choice, as an input
    URI's links are: the plan pins the bytes it points to and QA scores them. Only a link *below* a golden folder is
    refused (the test above); so is a folder reached through a linked parent (its links are above the root)."""
    versions = tmp_path / "labels"
    versions.mkdir()
    (versions / "v7.parquet").write_bytes(_golden_bytes(_truth()))
    (versions / "current.parquet").symlink_to(versions / "v7.parquet")
    spec, plan = _planned_run(tmp_path, str(versions / "current.parquet"))
    digest = hashlib.sha256((versions / "v7.parquet").read_bytes()).hexdigest()
    assert plan.golden_set is not None and [f.sha256 for f in plan.golden_set.files] == [digest]
    report, _ = qa_run(spec)
    assert report.metrics["quality"]["accuracy"]["value"] == pytest.approx(_accuracy(tmp_path, _truth()))


def test_a_golden_folder_under_a_linked_parent_is_pinned(tmp_path):
    real = tmp_path / "real" / "golden"
    real.mkdir(parents=True)
    (real / "g.parquet").write_bytes(_golden_bytes(_truth()))
    (tmp_path / "mnt").symlink_to(tmp_path / "real")  # a prefix on a linked volume: above the golden folder
    spec, plan = _planned_run(tmp_path, str(tmp_path / "mnt" / "golden"))
    assert plan.golden_set is not None and [f.path for f in plan.golden_set.files] == ["g.parquet"]
    report, _ = qa_run(spec)
    assert report.metrics["quality"]["accuracy"]["value"] == pytest.approx(_accuracy(tmp_path, _truth()))
