"""A generated corpus of bad inputs, with the outcome each one must have.

Row faults (``*_row_corpus``) go into one input file each; every planted row has an expected
outcome: ``"ok"`` (odd but valid: RTL, emoji, BOM, CRLF, extra columns, integer ids) or the
reason code of its error row (``rows.py``). Rows that cannot name their id (a line that is
not JSON) are expected under their synthetic id ``__line__:<file>:<line>``.

Dataset faults (``dataset_fault_cases``) each make an input folder that the plan must refuse
with one message naming the file and the row or column.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from airflow_provider_vllm.core.rows import (
    EMPTY_INPUT,
    INVALID_JSON,
    INVALID_REQUEST,
    INVALID_ROW,
    PROMPT_TOO_LONG,
    TEMPLATE_ERROR,
    UNSUPPORTED_PARAMETER,
)

BIG = 10 * 1024 * 1024  # a 10 MB field
ODD_BUT_VALID = {
    "rtl-arabic": "مرحبا، لم يصلني المبلغ المسترد",
    "rtl-hebrew-mixed": "שלום, the invoice #42 is wrong ‏(נא לבדוק)",
    "emoji": "I was charged twice 😡💳🙏🏽 👨‍👩‍👧",
    "bom-inside": "\ufeffticket starting with a BOM",
    "crlf-inside": "line one\r\nline two\r\n",
    "combining": "Zalgo t̷̢̛e̵x̸t with combining marks",
    "zero-width": "zero\u200bwidth\u200djoiner",
    "cjk": "我的账户被锁定了，请帮忙",
    "quotes-backslashes": "say \"hi\" \\ and 'bye' \t tab",
    "shell-text": "; rm -rf / $(id) `id` | sh",
    "jinja-text": "{{ 7*7 }} {% if x %}",  # data, not a param: reaches the engine verbatim
}


def parquet_row_corpus(folder: Path) -> dict[str, str]:
    """input.parquet with planted row faults; returns id -> expected outcome."""
    rows: list[tuple[str, object, str]] = [
        ("null-text", None, EMPTY_INPUT),
        ("empty-text", "", EMPTY_INPUT),
        ("blank-text", " \t\r\n ", EMPTY_INPUT),
        ("nul-char", "before\x00after", INVALID_ROW),
        ("ten-mb", "x" * BIG, PROMPT_TOO_LONG),
        ("lone-surrogate-escape", "bad \\ud800 escaped (text, valid)", "ok"),
    ]
    rows += [(k, v, "ok") for k, v in ODD_BUT_VALID.items()]
    rows += [(f"plain-{i}", f"ordinary ticket {i}", "ok") for i in range(6)]
    folder.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            "id": [r[0] for r in rows],
            "text": pa.array([r[1] for r in rows], pa.large_string()),
            "extra_col": [1.5] * len(rows),  # extra columns are ignored
            "nested_extra": [{"a": 1}] * len(rows),
        }
    )
    pq.write_table(table, folder / "input.parquet", row_group_size=4)
    return {r[0]: r[2] for r in rows}


def jsonl_row_corpus(folder: Path) -> dict[str, str]:
    """input.jsonl (BOM, CRLF line ends) with planted row faults; returns id -> expected outcome."""
    name = "input.jsonl"
    lines: list[tuple[bytes, str | None, str]] = []  # raw line, id (None: synthetic), expected

    def obj(rid, expected, **fields):
        lines.append((json.dumps({"id": rid, **fields}, ensure_ascii=False).encode(), str(rid), expected))

    obj("first-after-bom", "ok", text="the file starts with a BOM")
    obj("int-text", INVALID_ROW, text=12345)
    obj("float-text", INVALID_ROW, text=1.5)
    obj("bool-text", INVALID_ROW, text=True)
    obj("dict-text", INVALID_ROW, text={"nested": "object"})
    obj("list-text", INVALID_ROW, text=["a", "b"])
    obj("null-text", EMPTY_INPUT, text=None)
    obj("missing-text", EMPTY_INPUT)
    obj("empty-text", EMPTY_INPUT, text="")
    obj("nul-char", INVALID_ROW, text="a\u0000b")
    obj("ten-mb", PROMPT_TOO_LONG, text="y" * BIG)
    obj("extra-columns", "ok", text="has extra columns", lang="en", score=3, tags=["x"])
    obj(4242, "ok", text="an integer id")
    lines.append((b'{"id": "lone-surrogate", "text": "bad \\ud800 half pair"}', "lone-surrogate", INVALID_ROW))
    for k, v in ODD_BUT_VALID.items():
        obj(k, "ok", text=v)
    lines.append((b'{"id": "broken", "text": "no closing brace"', None, INVALID_JSON))
    lines.append((b'\xff\xfe{"id": "latin1", "text": "caf\xe9"}', None, INVALID_JSON))
    lines.append((b"[1, 2, 3]", None, INVALID_JSON))
    lines.append((b'"just a string"', None, INVALID_JSON))
    lines.append((b'{"id": "deep", "text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, INVALID_JSON))
    # valid JSON one level past lines.JSON_MAX_DEPTH (256): refused alike at any stack depth; at the limit: a row
    lines.append((b'{"id": "deep-257", "text": "t", "x": ' + b"[" * 256 + b"]" * 256 + b"}", None, INVALID_JSON))
    lines.append((b'{"id": "deep-256", "text": "t", "x": ' + b"[" * 255 + b"]" * 255 + b"}", "deep-256", "ok"))
    # in a string: no nesting (260 openers, past the quick count; short enough for the real-vLLM test's 512 tokens)
    obj("brackets-in-text", "ok", text='a \\" [' + "[{" * 130)
    # valid JSON over lines.JSONL_LINE_MAX_BYTES (64 MiB): skipped in blocks, never parsed
    lines.append((json.dumps({"id": "over-64-mib", "text": "z" * (64 << 20)}).encode(), None, INVALID_JSON))
    lines.append((b"", None, "skip"))  # blank lines are not rows
    lines.append((b"   ", None, "skip"))
    obj("last-line-no-newline", "ok", text="final line without a line end")
    folder.mkdir(parents=True, exist_ok=True)
    body = b"\xef\xbb\xbf" + b"\r\n".join(raw for raw, _, _ in lines)  # BOM + CRLF, no trailing newline
    (folder / name).write_bytes(body)
    expected: dict[str, str] = {}
    for line_no, (_, rid, outcome) in enumerate(lines, start=1):
        if outcome == "skip":
            continue
        expected[rid if rid is not None else f"__line__:{name}:{line_no}"] = outcome
    return expected


MB = 1024 * 1024


def hostile_chat_requests() -> list[tuple[str, dict, str]]:
    """(custom_id, body, expected code) for chat completion bodies that must not run, each a
    different way in which one row's own content can fail (sampling values out of vLLM's ranges,
    refused OpenAI fields, unknown fields, messages a strict chat template refuses, a 1 MB
    message). Shared by the fake-engine corpus and the real-vLLM acceptance test."""
    user = [{"role": "user", "content": "My invoice shows the wrong VAT number."}]

    def body(**kw):
        return {"model": "m", "messages": user, **kw}

    return [
        ("temperature-3", body(temperature=3), INVALID_REQUEST),
        ("temperature-nan", body(temperature=float("nan")), INVALID_REQUEST),
        ("temperature-string", body(temperature="0.5"), INVALID_REQUEST),
        ("top-p-0", body(top_p=0), INVALID_REQUEST),
        ("max-tokens-negative", body(max_tokens=-5), INVALID_REQUEST),
        ("max-tokens-huge", body(max_tokens=10**9), INVALID_REQUEST),  # past the job spec's bound (10,000,000)
        ("max-tokens-over-context", body(max_tokens=50_000), INVALID_REQUEST),  # within it, past max_model_len
        ("max-tokens-bool", body(max_tokens=True), INVALID_REQUEST),
        ("min-tokens-over-max", body(max_tokens=4, min_tokens=50), INVALID_REQUEST),
        ("stop-object", body(stop={"when": "done"}), INVALID_REQUEST),
        ("stop-empty-string", body(stop=["", "x"]), INVALID_REQUEST),
        # the job spec's own stop rule (at most 16, each 1-256 characters, no control characters)
        ("stop-ten-thousand", body(stop=[f"s{i}" for i in range(10_000)]), INVALID_REQUEST),
        ("stop-seventeen", body(stop=[f"s{i}" for i in range(17)]), INVALID_REQUEST),
        ("stop-too-long", body(stop="x" * 257), INVALID_REQUEST),
        ("stop-control-char", body(stop=["\x00"]), INVALID_REQUEST),
        ("max-completion-tokens-0", body(max_completion_tokens=0), INVALID_REQUEST),
        ("logit-bias-ten-thousand", body(logit_bias={str(i): 100 for i in range(10_000)}), UNSUPPORTED_PARAMETER),
        ("presence-penalty-5", body(presence_penalty=5), INVALID_REQUEST),
        ("seed-beyond-int64", body(seed=2**70), INVALID_REQUEST),
        ("n-3", body(n=3), UNSUPPORTED_PARAMETER),
        ("n-0", body(n=0), INVALID_REQUEST),
        ("unknown-fields", body(temprature=0.5, foo={"bar": 1}), UNSUPPORTED_PARAMETER),
        ("top-logprobs-without-logprobs", body(top_logprobs=5), INVALID_REQUEST),
        ("top-logprobs-21", body(logprobs=True, top_logprobs=21), INVALID_REQUEST),
        ("top-logprobs-minus-1", body(logprobs=True, top_logprobs=-1), INVALID_REQUEST),
        ("top-logprobs-50", body(logprobs=False, top_logprobs=50), INVALID_REQUEST),
        ("logprobs-int", body(logprobs=5), INVALID_REQUEST),
        ("stream", body(stream=True), UNSUPPORTED_PARAMETER),
        (
            "tools",
            body(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]),
            UNSUPPORTED_PARAMETER,
        ),
        ("response-format-json", body(response_format={"type": "json_object"}), UNSUPPORTED_PARAMETER),
        (
            "roles-not-alternating",
            body(messages=[{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]),
            TEMPLATE_ERROR,
        ),
        (
            "assistant-first",
            body(messages=[{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"}]),
            TEMPLATE_ERROR,
        ),
        ("unknown-role", body(messages=[{"role": "wizard", "content": "abracadabra"}]), INVALID_REQUEST),
        # a question asked of another model (vLLM's run-batch test input): answering it with this one is wrong
        ("another-model", body(model="NonExistModel"), INVALID_REQUEST),
        ("empty-messages", body(messages=[]), EMPTY_INPUT),
        (
            "tool-message",
            body(
                messages=[
                    *user,
                    {"role": "assistant", "content": "calling"},
                    {"role": "tool", "tool_call_id": "c1", "content": "42"},
                ]
            ),
            UNSUPPORTED_PARAMETER,
        ),
        (
            "assistant-tool-calls",
            body(
                messages=[
                    *user,
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                    },
                ]
            ),
            UNSUPPORTED_PARAMETER,
        ),
        (
            "image-part",
            body(
                messages=[
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}
                ]
            ),
            UNSUPPORTED_PARAMETER,
        ),
        (
            "one-mb-message",
            body(messages=[{"role": "user", "content": "refund please " * (MB // 14)}]),
            PROMPT_TOO_LONG,
        ),
    ]


def good_chat_requests() -> list[tuple[str, dict]]:
    """(custom_id, body) of valid chat requests that use the per-row settings the worker supports."""

    def user(text):
        return [{"role": "user", "content": text}]

    return [
        ("good-plain", {"model": "m", "messages": user("I was charged twice this month.")}),
        (
            "good-system",
            {
                "messages": [
                    {"role": "system", "content": "Answer in one word."},
                    {"role": "user", "content": "The app crashes on start."},
                ],
                "max_tokens": 6,
            },
        ),
        (
            "good-overrides",
            {
                "model": "m",
                "messages": user("Where is your office?"),
                "temperature": 0,
                "top_p": 1,
                "max_tokens": 7,
                "stop": ["\n\n"],
                "seed": 7,
                "presence_penalty": 0,
                "frequency_penalty": 0,
                "n": 1,
                "stream": False,
                "logprobs": False,
                "user": "u-1",
                "metadata": {"batch": "nightly"},
            },
        ),
        (
            "good-max-completion-tokens",
            {"messages": user("Do you have a student discount?"), "max_completion_tokens": 5},
        ),
        (
            "good-text-parts",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "Login fails"},
                            {"type": "text", "text": "with error 500."},
                        ],
                    }
                ]
            },
        ),
        (
            "good-multi-turn",
            {
                "messages": [
                    {"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello."},
                    {"role": "user", "content": "My refund has not arrived."},
                ],
                "max_tokens": 8,
            },
        ),
        ("good-stop-string", {"messages": user("Count: one, two, three"), "stop": ".", "max_tokens": 8}),
        (
            "good-seeded-sampling",
            {
                "messages": user("Suggest a name for a cat."),
                "temperature": 0.7,
                "top_p": 0.9,
                "top_k": 20,
                "seed": 1234,
                "max_tokens": 8,
            },
        ),
        (
            "good-vllm-extras",
            {
                "messages": user("Say hello."),
                "min_p": 0.05,
                "repetition_penalty": 1.1,
                "min_tokens": 1,
                "max_tokens": 6,
            },
        ),
    ]


def openai_row_corpus(folder: Path) -> dict[str, str]:
    """batch.jsonl in the OpenAI batch format with bad requests; returns custom_id -> expected."""

    def req(cid, body, url="/v1/chat/completions", method="POST"):
        return {"custom_id": cid, "method": method, "url": url, "body": body}

    good = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    reqs = [
        (req("ok-1", good), "ok"),
        (req("get-method", good, method="GET"), INVALID_ROW),
        (req("bad-url", good, url="/v1/completions/../../admin"), INVALID_ROW),
        (req("embeddings-in-chat-job", {"input": "hello"}, url="/v1/embeddings"), INVALID_ROW),
        (req("body-string", "not an object"), INVALID_ROW),
        (req("no-messages", {"model": "m"}), INVALID_REQUEST),
        (req("bad-role", {"messages": [{"role": "root", "content": "x"}]}), INVALID_REQUEST),
        (req("content-int", {"messages": [{"role": "user", "content": 5}]}), INVALID_REQUEST),
        (req("neg-max-tokens", {**good, "max_tokens": -1}), INVALID_REQUEST),
        (req("str-max-tokens", {**good, "max_tokens": "10"}), INVALID_REQUEST),
        (req("lone-surrogate", {"messages": [{"role": "user", "content": "half \ud800 pair"}]}), INVALID_REQUEST),
        (req("emoji-ok", {"messages": [{"role": "user", "content": "💳 charged twice"}]}), "ok"),
    ]
    reqs += [(req(cid, body), code) for cid, body, code in hostile_chat_requests()]
    reqs += [(req(cid, body), "ok") for cid, body in good_chat_requests()]
    # a request nested one level past lines.JSON_MAX_DEPTH (256), and one over lines.JSONL_LINE_MAX_BYTES (64 MiB):
    # neither is parsed, so neither names its custom_id; each is an INVALID_JSON row under its line's synthetic id
    deep = req("deep-257", {**good, "metadata": "NESTED"})
    long = req("over-64-mib", {"model": "m", "messages": [{"role": "user", "content": "z" * (64 << 20)}]})
    folder.mkdir(parents=True, exist_ok=True)
    text = "\n".join(json.dumps(r) for r, _ in reqs)
    text += "\n" + json.dumps(deep).replace('"NESTED"', "[" * 255 + "]" * 255) + "\n" + json.dumps(long) + "\n"
    (folder / "batch.jsonl").write_text(text)
    n = len(reqs)
    return {
        **{r["custom_id"]: e for r, e in reqs},
        f"__line__:batch.jsonl:{n + 1}": INVALID_JSON,
        f"__line__:batch.jsonl:{n + 2}": INVALID_JSON,
    }


def dataset_fault_cases(root: Path) -> dict[str, tuple[Path, list[str]]]:
    """name -> (input folder, fragments the plan's one error message must contain)."""
    cases: dict[str, tuple[Path, list[str]]] = {}

    def pq_file(folder: Path, name: str, **cols):
        folder.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table(cols), folder / name)

    f = root / "missing-id"
    pq_file(f, "a.parquet", key=["1", "2"], text=["x", "y"])
    cases["missing id column"] = (f, ["a.parquet", "'id'"])
    f = root / "dup-ids-parquet"
    pq_file(f, "a.parquet", id=["1", "2"], text=["x", "y"])
    pq_file(f, "b.parquet", id=["3", "1"], text=["z", "w"])
    cases["duplicate ids across files"] = (f, ["duplicate", "'1'", "a.parquet row 0", "b.parquet row 1"])
    f = root / "dup-ids-jsonl"
    f.mkdir(parents=True)
    (f / "a.jsonl").write_text('{"id": "k", "text": "x"}\n{"id": "j", "text": "y"}\n{"id": "k", "text": "z"}\n')
    cases["duplicate ids in jsonl"] = (f, ["duplicate", "'k'", "a.jsonl line 1", "a.jsonl line 3"])
    f = root / "null-id"
    pq_file(f, "a.parquet", id=pa.array(["1", None, "3"]), text=["x", "y", "z"])
    cases["null id"] = (f, ["null id", "a.parquet row 1"])
    f = root / "empty-id"
    pq_file(f, "a.parquet", id=["1", "2", ""], text=["x", "y", "z"])
    cases["empty id"] = (f, ["empty id", "a.parquet row 2"])
    f = root / "jsonl-missing-id"
    f.mkdir(parents=True)
    (f / "a.jsonl").write_text('{"id": "1", "text": "x"}\n{"text": "no id"}\n')
    cases["jsonl row without id"] = (f, ["a.jsonl line 2", "'id'"])
    f = root / "int-text-column"
    pq_file(f, "a.parquet", id=["1", "2"], text=[1, 2])
    cases["wrong column type"] = (f, ["a.parquet", "'text'", "int64"])
    f = root / "mixed-schemas"
    pq_file(f, "a.parquet", id=["1", "2"], text=["x", "y"])
    pq_file(f, "b.parquet", id=[3, 4], text=["z", "w"])
    cases["mixed id types across files"] = (f, ["b.parquet", "id column"])
    f = root / "mixed-missing-column"
    pq_file(f, "a.parquet", id=["1"], text=["x"])
    pq_file(f, "b.parquet", id=["2"], body=["x"])
    cases["second file lacks the text column"] = (f, ["b.parquet", "'text'"])
    f = root / "mixed-formats"
    pq_file(f, "a.parquet", id=["1"], text=["x"])
    (f / "b.jsonl").write_text('{"id": "2", "text": "y"}\n')
    cases["parquet and jsonl mixed"] = (f, ["mixes Parquet and JSONL", "a.parquet", "b.jsonl"])
    f = root / "parquet-and-a-schema-json"
    for i in range(6):
        pq_file(f, f"part-{i}.parquet", id=[str(i)], text=["x"])
    (f / "schema.json").write_text('{\n  "fields": ["id", "text"]\n}\n')
    cases["parquet files and a stray schema.json"] = (
        f,
        ["6 parquet file(s) (part-0.parquet, part-1.parquet, part-2.parquet, ...)", "1 jsonl file(s) (schema.json)"],
    )
    f = root / "jsonl-and-a-schema-json"
    f.mkdir(parents=True)
    (f / "a.jsonl").write_text('{"id": "1", "text": "x"}\n')
    (f / "schema.json").write_text('{\n  "fields": ["id", "text"]\n}\n')
    cases["jsonl files and a stray schema.json"] = (f, ["schema.json is one JSON document (an object), not JSON Lines"])
    f = root / "json-array-export"
    f.mkdir(parents=True)
    (f / "rows.json").write_text('[\n  {"id": "1", "text": "x"},\n  {"id": "2", "text": "y"}\n]\n')
    cases["a pretty-printed JSON array"] = (f, ["rows.json is one JSON document (an array), not JSON Lines"])
    f = root / "pretty-printed-json-stream"
    f.mkdir(parents=True)
    (f / "rows.jsonl").write_text("".join(json.dumps({"id": str(i), "text": "x"}, indent=2) + "\n" for i in range(3)))
    cases["JSON objects pretty-printed one after another (jq without -c)"] = (
        f,
        ["rows.jsonl", "none of its 12 line(s) is a JSON object", "pretty-printed"],
    )
    f = root / "cr-line-ends"
    f.mkdir(parents=True)
    (f / "rows.jsonl").write_bytes(b"".join(json.dumps({"id": str(i), "text": "x"}).encode() + b"\r" for i in range(3)))
    cases["JSON lines ended by a carriage return alone"] = (f, ["rows.jsonl", "carriage return alone"])
    f = root / "corrupt-parquet"
    f.mkdir(parents=True)
    (f / "a.parquet").write_bytes(b"PAR1 this is not really parquet PAR1")
    cases["corrupt parquet file"] = (f, ["a.parquet", "not a readable Parquet file"])
    f = root / "float-ids"
    pq_file(f, "a.parquet", id=[1.0, 2.0], text=["x", "y"])
    cases["float id column"] = (f, ["a.parquet", "'id'", "double"])
    f = root / "surrogate-id"
    f.mkdir(parents=True)
    (f / "a.jsonl").write_text('{"id": "ok", "text": "x"}\n{"id": "bad\\udc80", "text": "y"}\n')
    cases["jsonl id that is not valid Unicode"] = (f, ["a.jsonl line 2", "not valid Unicode"])
    f = root / "whitespace-id-parquet"
    pq_file(f, "a.parquet", id=["1", "\t \u00a0"], text=["x", "y"])
    cases["parquet id that is only whitespace"] = (f, ["empty id", "only whitespace", "a.parquet row 1"])
    f = root / "whitespace-id-jsonl"
    f.mkdir(parents=True)
    (f / "a.jsonl").write_text('{"id": "1", "text": "x"}\n{"id": " \\t ", "text": "y"}\n')
    cases["jsonl id that is only whitespace"] = (f, ["a.jsonl line 2", "'id'", "only whitespace"])
    f = root / "whitespace-custom-id"
    f.mkdir(parents=True)
    (f / "a.jsonl").write_text(
        "\n".join(
            json.dumps({"custom_id": c, "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}})
            for c in ("a", "\u3000")
        )
        + "\n"
    )
    cases["openai batch custom_id that is only whitespace"] = (f, ["a.jsonl line 2", "'custom_id'", "only whitespace"])
    return cases
