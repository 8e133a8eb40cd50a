"""Seals (core/seal.py): what another writer of a bucket can and cannot do to a sealed record."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from airflow_provider_vllm.core import seal as seals
from airflow_provider_vllm.core.errors import SealError
from airflow_provider_vllm.core.records import Record
from airflow_provider_vllm.core.seal import Keyring, Seal

KEY, OLD = "k" * 40, "o" * 40


class Doc(Record):
    a: int
    b: str | None = None
    c: float = 0.0
    seal: Seal | None = None


def sealed(doc: Doc, key: str = KEY, domain: str = seals.PLAN, scope: str = "s3://b/run") -> Doc:
    return seals.seal_record(Keyring.from_text(key), domain, scope, doc)


def test_a_sealed_record_survives_its_file_and_verifies():
    d = sealed(Doc(a=1, c=0.1))
    back = Doc.model_validate_json(seals.record_bytes(d))
    seals.verify_record(Keyring.from_text(KEY), seals.PLAN, "s3://b/run", back, "doc")
    assert json.loads(seals.record_bytes(d)).keys() == {"a", "c", "seal"}  # fields never set stay out


@pytest.mark.parametrize(
    ("change", "what"),
    [
        (lambda d: d.model_copy(update={"a": 2}), "content"),
        (lambda d: d.model_copy(update={"b": "x"}), "a field added"),
        (lambda d: d.model_copy(update={"seal": None}), "no seal"),
    ],
)
def test_any_change_breaks_the_seal(change, what):
    d = change(sealed(Doc(a=1)))
    back = Doc.model_validate_json(seals.record_bytes(d))
    with pytest.raises(SealError):
        seals.verify_record(Keyring.from_text(KEY), seals.PLAN, "s3://b/run", back, what)


def test_a_seal_binds_domain_scope_and_key():
    d = sealed(Doc(a=1))
    ring = Keyring.from_text(KEY)
    with pytest.raises(SealError, match="moved from another run or folder"):
        seals.verify_record(ring, seals.PLAN, "s3://b/other-run", d, "doc")
    with pytest.raises(SealError, match="moved from another run or folder"):
        seals.verify_record(ring, seals.COMMIT, "s3://b/run", d, "doc")  # a plan's seal is no marker's
    with pytest.raises(SealError, match="key this deployment does not hold"):
        seals.verify_record(Keyring.from_text("z" * 40), seals.PLAN, "s3://b/run", d, "doc")
    forged = d.model_copy(update={"seal": Seal(kid=d.seal.kid, mac="0" * 64)})
    with pytest.raises(SealError):
        seals.verify_record(ring, seals.PLAN, "s3://b/run", forged, "doc")
    with pytest.raises(ValueError, match="unknown seal domain"):
        ring.seal("anything", "s", {})


def test_rotation_new_key_seals_old_key_still_verifies():
    old_record = sealed(Doc(a=1), key=OLD)
    ring = Keyring.from_text(f"{KEY}, {OLD}")
    seals.verify_record(ring, seals.PLAN, "s3://b/run", old_record, "doc")
    assert seals.seal_record(ring, seals.PLAN, "s", Doc(a=1)).seal.kid == seals.kid_of(KEY.encode())
    assert ring.text().split(",") == [KEY, OLD]
    with pytest.raises(SealError):  # once the old key is dropped, what it sealed is no longer trusted
        seals.verify_record(Keyring.from_text(KEY), seals.PLAN, "s3://b/run", old_record, "doc")


@pytest.mark.parametrize("text", [None, "", "  ,  ", "short", "k" * 31, f"{KEY},tooshort"])
def test_no_or_weak_key_fails_closed_naming_the_setting(text):
    with pytest.raises(SealError, match=r"signing_key|VLLM_BATCH_SIGNING_KEY") as e:
        Keyring.from_text(text)
    assert "secrets.token_urlsafe" in str(e.value)


def test_the_worker_reads_its_key_from_its_environment():
    assert Keyring.from_env({"VLLM_BATCH_SIGNING_KEY": KEY}).kid == seals.kid_of(KEY.encode())
    with pytest.raises(SealError, match="VLLM_BATCH_SIGNING_KEY"):
        Keyring.from_env({})


@given(st.dictionaries(st.text(max_size=5), st.one_of(st.integers(), st.text(max_size=5), st.none()), max_size=4))
def test_equal_docs_seal_equally_and_any_difference_changes_the_mac(doc):
    ring = Keyring.from_text(KEY)
    mac = ring.seal(seals.PLAN, "s", doc).mac
    assert ring.seal(seals.PLAN, "s", dict(reversed(list(doc.items())))).mac == mac  # key order does not matter
    assert ring.seal(seals.PLAN, "s", {**doc, "extra": 1}).mac != mac
