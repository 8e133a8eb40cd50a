"""The URI allow-list (``core/allow_list.py``): malicious URIs, whole-segment prefixes and
symlinks that would lead out of an allowed folder are refused before any worker or pod spec exists.
"""

from __future__ import annotations

import pytest

from airflow_provider_vllm.core.allow_list import check_uri
from airflow_provider_vllm.core.errors import SpecError
from tests.support.data import write_parquet
from tests.support.ledger import record_malicious
from tests.support.security import A, base_doc, prefixes, refused, with_value

pytestmark = pytest.mark.reliability


MALICIOUS_URIS = {
    "dotdot": [
        f"{A}/in/../../etc",
        f"{A}/in/..",
        "s3://data/in/../secret",
        "s3://data/in/./x",
        f"file://{A}/in/../../root",
        "s3://data/in/sub/../../other",
    ],
    "encoded_dotdot": [
        "s3://data/in/%2e%2e/secret",
        "s3://data/in/%2E%2E%2Fsecret",
        "s3://data/in/%252e%252e/x",
        f"{A}/in/%2e%2e/x",
        "s3://data/in%2f..%2fother",
        "s3://data/in/..%5c..%5cx",
    ],
    "other_bucket": [
        "s3://data-other/in",
        "s3://dat/in",
        "gs://data/in",
        "s3://evil/in",
        "s3a://data/in-x/y",
        "s3://DATA/in",
    ],
    "file_trick": [
        "file:///etc/passwd",
        "file://attacker.example/share/in",
        "file:/etc/passwd",
        "/etc/passwd",
        f"file:{A}/in",
        "file://localhost/etc",
        f"{A}-sibling/in",
        "/",
    ],
    "unknown_scheme": [
        "http://169.254.169.254/latest/meta-data",
        "ftp://x/in",
        "hdfs://nn/in",
        "zip::s3://data/in/a.zip",
        "simplecache::s3://data/in",
        "sftp://host/in",
        "relative/in",
        "~/in",
        "C:\\data\\in",
        "data:text/plain,x",
        "in\x00/x",
        " /tmp/x",
    ],
}


# ---- paths ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(MALICIOUS_URIS))
def test_malicious_uris_are_refused(allowed, kind):
    tried = rejected = 0
    for raw in MALICIOUS_URIS[kind]:
        uri = raw.replace(A, str(allowed))
        for field in ("io.input_uri", "io.output_uri"):
            tried += 1
            msg = refused(with_value(base_doc(allowed), field, uri), prefixes(allowed))
            if msg is not None:
                rejected += 1
                assert field in msg or "uri" in msg, msg  # the message names the parameter
            else:
                print(f"ACCEPTED {field}={uri!r}")
    record_malicious(f"uri_{kind}", tried, rejected)
    assert rejected == tried


def test_allowed_uris_pass_and_prefixes_match_whole_segments(allowed):
    assert refused(base_doc(allowed), prefixes(allowed)) is None
    ok = with_value(
        with_value(base_doc(allowed), "io.input_uri", "s3://data/in/dt=2026-11-29/"),
        "io.output_uri",
        "s3://data/out/run-1",
    )
    assert refused(ok, prefixes(allowed)) is None
    assert check_uri("file://" + str(allowed / "in"), prefixes(allowed)) == str(allowed / "in")
    with pytest.raises(SpecError, match="outside the allowed prefixes"):
        check_uri("s3://data/input", ["s3://data/in"])  # 'in' is not a prefix of 'input'


def test_symlinks_cannot_lead_out_of_the_allowed_prefix(allowed, tmp_path):
    outside = tmp_path / "secret"
    write_parquet(outside / "x.parquet", ["s"], ["secret"])
    (allowed / "link").symlink_to(outside)
    (allowed / "in" / "leak.parquet").symlink_to(outside / "x.parquet")
    tried = 0
    for field, uri in (("io.input_uri", allowed / "link"), ("io.output_uri", allowed / "link" / "out")):
        tried += 1
        assert "outside the allowed prefixes" in refused(
            with_value(base_doc(allowed), field, str(uri)), prefixes(allowed)
        )
    tried += 1  # a symlinked file inside an allowed input folder
    assert "is a symlink to" in refused(base_doc(allowed), prefixes(allowed))
    record_malicious("uri_symlink_escape", tried, tried)


def test_a_list_setting_is_read_strictly_naming_the_setting():
    """The allow-lists and the allowed tables share one reader: JSON lists of strings, or comma/newline text."""
    from airflow_provider_vllm.core.allow_list import parse_list_setting, parse_prefixes

    assert parse_list_setting(" s3://a , /data\n gs://b ,", "[x] y") == ["s3://a", "/data", "gs://b"]
    assert parse_list_setting('["s3://a", " "]', "[x] y") == ["s3://a"]
    assert parse_list_setting(["/a", ""], "[x] y") == ["/a"]
    assert parse_list_setting(None, "[x] y") == parse_list_setting("  ", "[x] y") == []
    for bad in ("[null]", '["/a", 1]', "[[]]", '[{"a": 1}]', "[nope", "[1,"):
        with pytest.raises(SpecError, match=r"^\[x\] y "):
            parse_list_setting(bad, "[x] y")
    with pytest.raises(SpecError, match="must be a list of strings"):
        parse_prefixes(["/a", None])  # type: ignore[list-item]


@pytest.mark.parametrize(
    "uri",
    [
        "s3://AKIAKEY:s3cr3tValue@data/in/x",
        "s3://s3cr3tValue@data/in/x",
        "memory://AKIAKEY:s3cr3tValue@data/in",
        "gs://AKIAKEY:s3cr3tValue@data/in/%2e%2e/x",
        "simplecache::s3://AKIAKEY:s3cr3tValue@data/in",
    ],
)
def test_credentials_in_a_uri_are_refused_without_showing_them(allowed, uri):
    for field in ("io.input_uri", "io.output_uri", "sharding.history_uri"):
        msg = refused(with_value(base_doc(allowed), field, uri), prefixes(allowed))
        assert msg is not None and "credentials in URIs are not allowed; use an Airflow Connection" in msg, msg
        assert "s3cr3tValue" not in msg and "AKIAKEY" not in msg and "***@" in msg, msg


@pytest.mark.parametrize(
    "uri",
    [
        "s3://AKIAKEY:s3cr3tValue/w+slash@data/in/x",  # a secret key holding '/', as half of AWS secret keys do
        "s3://minio:s3cr3t/Value@data/in/x",  # a lower-case access key passed the trigger form's pattern too
        "s3://data/in/x?X-Amz-Credential=AKIAKEY&X-Amz-Signature=s3cr3tValue",  # a presigned URL pasted whole
        "gs://data/in/x?X-Goog-Signature=s3cr3tValue",
        "s3://data/in/x?sig=s3cr3tValue",
        "s3://data/in/x;access_token=s3cr3tValue",
        "s3://data/in/x#Token=s3cr3tValue",
    ],
)
def test_credentials_hidden_in_a_uri_are_refused_without_showing_them(allowed, uri):
    """Until 2026-12 a userinfo whose secret held a '/' passed as a bucket name and was echoed whole by the
    bucket-name refusal (and a lower-case one by the trigger form's), and a query string's signature or token
    was taken into the spec, its XCom and ``_plan.json``."""
    from airflow_provider_vllm.core.param_schemas import validate_params

    for field in ("io.input_uri", "io.output_uri", "sharding.history_uri"):
        msg = refused(with_value(base_doc(allowed), field, uri), prefixes(allowed))
        assert msg is not None and "credentials in URIs are not allowed; use an Airflow Connection" in msg, msg
        assert "s3cr3t" not in msg and "AKIAKEY" not in msg and "***" in msg, msg
    with pytest.raises(SpecError) as e:  # the trigger form's pattern
        validate_params({"input_uri": uri})
    assert "s3cr3t" not in str(e.value) and "AKIAKEY" not in str(e.value), e.value
    record_malicious("credentials_hidden_in_uri", 1, 1)


def test_a_mistyped_scheme_with_credentials_is_refused_without_showing_them():
    """``s3:/key:secret@bucket`` (one slash) is no URI the credential check knows; the unknown-scheme refusal showed it
    whole until 2026-12."""
    from airflow_provider_vllm.core.allow_list import canonical_uri

    for uri in ("s3:/AKIAKEY:s3cr3t@data/in", "s3:AKIAKEY:s3cr3t/x@data/in"):
        with pytest.raises(SpecError, match="unknown scheme") as e:
            canonical_uri(uri, resolve=False)
        assert "s3cr3t" not in str(e.value) and "AKIAKEY" not in str(e.value) and "***@data/in" in str(e.value)
    with pytest.raises(SpecError, match=r"'s3:data/in': unknown scheme"):  # nothing to hide: shown as given
        canonical_uri("s3:data/in", resolve=False)


def test_locations_that_only_look_like_credentials_pass():
    """An '@' or ':' in the path, or a query parameter that carries none, is no credential."""
    from airflow_provider_vllm.core.allow_list import canonical_uri
    from airflow_provider_vllm.core.param_schemas import validate_params

    for uri in ("s3://data/in/model@v2/x", "gs://data/in/a:b@c", "s3://data/in/x?versionId=3"):
        assert canonical_uri(uri, resolve=False) == uri
        validate_params({"input_uri": uri})


@pytest.mark.parametrize(
    "uri",
    [
        f"{A}/out/reruns/x`<https:evil.example/approve-here>`",
        "s3://data/out/x<img src=x>",
        's3://data/out/a"b',
        "s3://data/out/a|b",
        f"file://{A}/out/x`y",
    ],
)
def test_markup_and_quoting_characters_in_a_location_are_refused_naming_the_parameter(allowed, uri):
    """A location reaches the approval request (Markdown), the QA report (HTML) and copied shell lines: a backtick
    closes a code span there, < > open an autolink or a tag. Refused by the spec, the trigger form's pattern and
    the allow-list, with the parameter's name; ordinary names (= - _ . @ + spaces-free) still pass."""
    import re

    from airflow_provider_vllm.core.param_schemas import URI_PATTERN

    uri = uri.replace(A, str(allowed))
    with pytest.raises(SpecError, match=r"io\.output_uri=.*the characters ` < > \" \| are not allowed"):
        check_uri(uri, prefixes(allowed), "io.output_uri")
    assert re.match(URI_PATTERN, uri) is None
    assert refused(with_value(base_doc(allowed), "io.output_uri", uri), prefixes(allowed))
    ok = "s3://data/out/dt=2026-12-05/it's_run_1.a+b@c"
    assert check_uri(ok, prefixes(allowed), "io.output_uri") == ok and re.match(URI_PATTERN, ok)
    record_malicious("markup_in_uri", 1, 1)


@pytest.mark.parametrize("uri", ["s3://data/out/reruns//", f"{A}/out/reruns//", "s3://data/out/reruns///"])
def test_an_empty_last_segment_is_refused_not_taken_for_the_parent(allowed, uri):
    """``.../reruns/{{ x }}/`` with ``x`` rendered empty is ``.../reruns//``: read as ``.../reruns`` it would be
    the folder that holds every other re-run. One trailing slash still marks a folder."""
    uri = uri.replace(A, str(allowed))
    with pytest.raises(SpecError, match=r"io\.output_uri=.*empty path segments"):
        check_uri(uri, prefixes(allowed), "io.output_uri")
    assert check_uri("s3://data/out/reruns/", prefixes(allowed), "io.output_uri") == "s3://data/out/reruns"
    record_malicious("empty_last_segment", 1, 1)


HIDDEN = {
    "right-to-left override": "s3://data/out/reruns/\u202etxt.lanoitan-dt",
    "right-to-left isolate": "s3://data/out/a\u2067b\u2069c",
    "zero-width space": "s3://data/out/reclassi\u200bfication/dt=2099-01-01",
    "zero-width joiner": f"{A}/out/run\u200d1",
    "byte order mark": "s3://data/out/\ufeffrun",
    "soft hyphen": "s3://data/out/re\u00adrun",
    "C1 control": "s3://data/out/run\u009b31m",
    "line separator": "s3://data/out/run\u2028x",
    "private use": "s3://data/out/run\ue000",
    "lone surrogate": "s3://data/out/run\ud800",
}


@pytest.mark.parametrize("name", sorted(HIDDEN))
def test_invisible_and_text_reordering_characters_in_a_location_are_refused_shown_escaped(allowed, name):
    """A trigger's location reaches the approval request, the report, the task log and links: a bidi override shows
    ``.../reruns/<U+202E>txt.lanoitan-dt`` as ``.../reruns/td-national.txt``, a zero-width space makes a folder look
    like the nightly's. Refused by the spec, the allow-list and (but the lone surrogate, which no browser form
    sends) the trigger form's pattern, naming the parameter and the code point, and showing the value escaped; the
    other Unicode letters of folder names in any script still pass."""
    import re

    from airflow_provider_vllm.core.param_schemas import URI_PATTERN, validate_params

    uri = HIDDEN[name].replace(A, str(allowed))
    with pytest.raises(SpecError, match=r"io\.output_uri=.*: U\+[0-9A-F]{4} \(.*\) is invisible") as e:
        check_uri(uri, prefixes(allowed), "io.output_uri")
    assert str(e.value).isascii()
    assert refused(with_value(base_doc(allowed), "io.output_uri", uri), prefixes(allowed))
    if name != "lone surrogate":
        assert re.match(URI_PATTERN, uri) is None
        with pytest.raises(SpecError, match="param output_uri"):
            validate_params({"output_uri": uri})
    ok = "s3://data/out/реклассификация/dt=2026-12-05/données_é"
    assert check_uri(ok, prefixes(allowed), "io.output_uri") == ok and re.match(URI_PATTERN, ok)
    record_malicious("hidden_character_in_uri", 1, 1)


def test_rules_that_keep_locations_apart_read_a_stores_second_name_as_its_first():
    """``store_form``/``overlap``: ``s3a://`` is ``s3://`` and ``gcs://`` is ``gs://`` to fsspec, so a rule that keeps
    two locations apart compares them as one store; ``is_under`` (allow-lists) still compares the names as written,
    so a list naming one spelling does not let the other in (fail closed)."""
    from airflow_provider_vllm.core.allow_list import canonical_uri, is_under, overlap, store_form

    def canon(u):
        return canonical_uri(u, resolve=False)

    assert store_form(canon("s3a://bk/k/")) == "s3://bk/k" and store_form(canon("gcs://bk")) == "gs://bk"
    assert store_form(canon("/local/x")) == "/local/x" and store_form(canon("memory://m/x")) == "memory://m/x"
    for a, b in [
        ("s3a://bk/k/x", "s3://bk/k"),
        ("s3://bk", "s3a://bk/k"),
        ("gcs://bk/k", "gs://bk/k/"),
        ("GCS://bk", "gs://bk"),
    ]:
        assert overlap(canon(a), canon(b)) and overlap(canon(b), canon(a)), (a, b)
    assert not is_under(canon("s3a://bk/k/x"), canon("s3://bk/k")) and not is_under(
        canon("gcs://bk/k"), canon("gs://bk")
    )
    for a, b in [
        ("s3a://bk/k", "s3://bk/k2"),
        ("s3://bk", "gs://bk"),
        ("gcs://bk/k", "s3://bk/k"),
        ("s3a://bk2", "s3://bk"),
    ]:
        assert not overlap(canon(a), canon(b)), (a, b)
    with pytest.raises(SpecError, match="outside the allowed prefixes"):
        check_uri("s3a://data/out/x", ["s3://data/out"], "io.output_uri")
