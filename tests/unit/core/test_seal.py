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
from tests.conftest import TEST_SIGNING_KEY, TEST_WORKER_KEY

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
        seals.verify_record(ring, seals.MERGED, "s3://b/run", d, "doc")  # a plan's seal is no merge summary's
    with pytest.raises(SealError):
        seals.verify_record(ring, seals.COMMIT, "s3://b/run", d, "doc")  # nor a marker's (the worker key's domain)
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
    assert ring.worker_text().split(",") == [seals.worker_key_of(k.encode()).decode() for k in (KEY, OLD)]
    with pytest.raises(SealError):  # once the old key is dropped, what it sealed is no longer trusted
        seals.verify_record(Keyring.from_text(KEY), seals.PLAN, "s3://b/run", old_record, "doc")


@pytest.mark.parametrize("text", [None, "", "  ,  ", "short", "k" * 31, f"{KEY},tooshort"])
def test_no_or_weak_key_fails_closed_naming_the_setting(text):
    with pytest.raises(SealError, match=r"signing_key|VLLM_BATCH_SIGNING_KEY") as e:
        Keyring.from_text(text)
    assert "secrets.token_urlsafe" in str(e.value)


def test_the_steps_outside_airflow_read_the_deployment_key_from_the_environment():
    assert Keyring.from_env({"VLLM_BATCH_SIGNING_KEY": KEY}).kid == seals.kid_of(KEY.encode())
    with pytest.raises(SealError, match="VLLM_BATCH_SIGNING_KEY"):
        Keyring.from_env({})


def test_the_worker_reads_only_a_worker_key_from_its_environment():
    wkey = seals.worker_key_of(KEY.encode()).decode()
    ring = Keyring.worker_from_env({"VLLM_BATCH_WORKER_KEY": wkey, "VLLM_BATCH_SIGNING_KEY": KEY})
    assert ring.worker and ring.kid == seals.kid_of(wkey.encode())
    with pytest.raises(SealError, match="VLLM_BATCH_WORKER_KEY.*cli.worker_key"):
        Keyring.worker_from_env({"VLLM_BATCH_SIGNING_KEY": KEY})
    # an old Secret: the deployment's own key where the worker key belongs
    with pytest.raises(SealError, match=r"not a worker key.*deployment's own signing key.*cli\.worker_key"):
        Keyring.worker_from_env({"VLLM_BATCH_WORKER_KEY": KEY})
    with pytest.raises(SealError, match="key #2 is not a worker key"):  # every key of the list
        Keyring.worker_from_env({"VLLM_BATCH_WORKER_KEY": f"{wkey},{OLD}"})


@given(st.dictionaries(st.text(max_size=5), st.one_of(st.integers(), st.text(max_size=5), st.none()), max_size=4))
def test_equal_docs_seal_equally_and_any_difference_changes_the_mac(doc):
    ring = Keyring.from_text(KEY)
    mac = ring.seal(seals.PLAN, "s", doc).mac
    assert ring.seal(seals.PLAN, "s", dict(reversed(list(doc.items())))).mac == mac  # key order does not matter
    assert ring.seal(seals.PLAN, "s", {**doc, "extra": 1}).mac != mac


WORKER_KEY = seals.worker_key_of(KEY.encode()).decode()
OTHER_DOMAINS = sorted(seals.DOMAINS - seals.WORKER_DOMAINS)


def test_the_worker_key_is_derived_deterministically_and_is_not_the_key():
    assert WORKER_KEY.startswith("vbw1.") and len(WORKER_KEY) >= seals.MIN_KEY_CHARS
    assert WORKER_KEY == seals.worker_key_of(KEY.encode()).decode()  # every Airflow task and the Secret agree
    assert seals.worker_key_of(TEST_SIGNING_KEY.encode()).decode() == TEST_WORKER_KEY  # the derivation, written out
    assert KEY not in WORKER_KEY and seals.worker_key_of(OLD.encode()).decode() != WORKER_KEY
    assert not any(c in WORKER_KEY for c in ", \t\n")  # one item of a key list
    assert seals.WORKER_DOMAINS == {seals.CHUNK, seals.COMMIT, seals.COMPILE_CACHE}


def test_the_deployment_refuses_a_worker_key_as_its_signing_key():
    with pytest.raises(SealError, match=r"signing_key.*key #2 is a worker key.*not a deployment signing key"):
        Keyring.from_text(f"{KEY},{WORKER_KEY}")


@pytest.mark.parametrize("domain", OTHER_DOMAINS)
def test_a_worker_keyring_can_seal_and_check_nothing_but_the_workers_records(domain):
    worker = Keyring.from_text(WORKER_KEY, worker=True)
    with pytest.raises(SealError, match=f"cannot seal or check '{domain}' records"):
        seals.seal_record(worker, domain, "s3://b/run", Doc(a=1))
    with pytest.raises(SealError, match=f"cannot seal or check '{domain}' records"):
        seals.verify_record(worker, domain, "s3://b/run", sealed(Doc(a=1), domain=domain), "doc")


@pytest.mark.parametrize("domain", OTHER_DOMAINS)
def test_a_record_sealed_by_hand_with_the_worker_key_is_refused_by_the_deployment(domain):
    """What code in a worker could compute with the worker key it holds, for a record only the Airflow side seals
    (a cache entry, a QA verdict, _SUCCESS.json, a plan ...): the deployment's keyring refuses it."""
    import hashlib
    import hmac

    doc = Doc(a=1)
    msg = b"\x00".join([seals.FORMAT, domain.encode(), b"s3://b/run", seals.canonical(seals.sealed_doc(doc))])
    mac = hmac.new(WORKER_KEY.encode(), msg, hashlib.sha256).hexdigest()
    forged = doc.model_copy(update={"seal": Seal(kid=seals.kid_of(WORKER_KEY.encode()), mac=mac)})
    with pytest.raises(SealError, match="does not hold"):
        seals.verify_record(Keyring.from_text(KEY), domain, "s3://b/run", forged, "doc")


@pytest.mark.parametrize("domain", sorted(seals.WORKER_DOMAINS))
def test_the_workers_records_verify_across_roles_and_only_with_the_worker_key(domain):
    deployment, worker = Keyring.from_text(KEY), Keyring.from_text(WORKER_KEY, worker=True)
    by_worker = seals.seal_record(worker, domain, "s3://b/run", Doc(a=1))
    assert by_worker.seal.kid == seals.kid_of(WORKER_KEY.encode())
    seals.verify_record(deployment, domain, "s3://b/run", by_worker, "doc")  # merge reads what the worker sealed
    by_airflow = seals.seal_record(deployment, domain, "s3://b/run", Doc(a=1))
    assert by_airflow == by_worker  # the deployment seals a worker's record with the worker key too
    seals.verify_record(deployment.worker_keyring(), domain, "s3://b/run", by_airflow, "doc")
    # a seal made with the deployment's own key on a worker domain (a record from before per-role keys) never verifies
    import hashlib
    import hmac

    msg = b"\x00".join([seals.FORMAT, domain.encode(), b"s3://b/run", seals.canonical({"a": 1})])
    old = Doc(
        a=1, seal=Seal(kid=seals.kid_of(KEY.encode()), mac=hmac.new(KEY.encode(), msg, hashlib.sha256).hexdigest())
    )
    for ring in (deployment, worker):
        with pytest.raises(SealError, match="does not hold"):
            seals.verify_record(ring, domain, "s3://b/run", old, "doc")


def test_rotation_works_for_both_roles():
    new_ring, old_ring = Keyring.from_text(f"{KEY},{OLD}"), Keyring.from_text(OLD)
    old_chunk = seals.seal_record(old_ring, seals.CHUNK, "s", Doc(a=1))
    old_plan = seals.seal_record(old_ring, seals.PLAN, "s", Doc(a=1))
    worker = Keyring.worker_from_env({"VLLM_BATCH_WORKER_KEY": new_ring.worker_text()})
    for ring in (new_ring, worker):  # the new worker key seals, the old one still verifies
        seals.verify_record(ring, seals.CHUNK, "s", old_chunk, "chunk")
        assert seals.seal_record(ring, seals.CHUNK, "s", Doc(a=2)).seal.kid == seals.kid_of(WORKER_KEY.encode())
    seals.verify_record(new_ring, seals.PLAN, "s", old_plan, "plan")
    assert seals.seal_record(new_ring, seals.PLAN, "s", Doc(a=2)).seal.kid == seals.kid_of(KEY.encode())
    assert new_ring.worker_keyring().worker_text() == new_ring.worker_text()
