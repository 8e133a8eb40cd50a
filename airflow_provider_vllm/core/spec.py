"""The job spec: one typed, JSON-serialisable description of a batch inference job.

Validated at the edge (DAG params -> plan) and again in the worker, which receives it as
one JSON argument. ``JobSpec.content_hash()`` is stable across processes and versions of
this package as long as the spec's values are equal.
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from collections.abc import Collection
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.core.pod_settings import KubernetesSettings
from airflow_provider_vllm.core.spec_guard import check_values

# Engine options a user may pass through to vllm.LLM(...) beyond the typed fields. Anything
# else is refused: options such as `worker_extension_cls` or `model_loader_extra_config`
# load code, and the spec may come from a trigger form.
ENGINE_KWARGS_ALLOWED = frozenset(
    {
        "block_size",
        "cpu_offload_gb",
        "disable_custom_all_reduce",
        "enable_chunked_prefill",
        "kv_cache_dtype",
        "max_logprobs",
        "max_seq_len_to_capture",
        "num_gpu_blocks_override",
        "pipeline_parallel_size",
        "swap_space",
        "tokenizer_mode",
        "limit_mm_per_prompt",
        "hf_overrides",
        "override_generation_config",
        "compilation_config",
        "async_scheduling",
        "load_format",  # values limited by LOAD_FORMATS_ALLOWED
    }
)
# "dummy" (random weights: benchmarks of a model shape without its checkpoint) and the safe
# tensor formats; formats that unpickle or stream from other services stay out.
LOAD_FORMATS_ALLOWED = frozenset({"auto", "safetensors", "dummy"})
# vLLM's LoRAConfig.max_lora_rank values (vllm/config/lora.py, MaxLoRARanks).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
MAX_ADAPTERS = 64
# Upper bounds of the numbers a trigger may reach through a DAG param (shard_rows, max_tokens, a declared dotted
# path): an unbounded one puts a whole dataset into one shard, or asks every row for more tokens than any context.
MAX_SHARD_ROWS = 10_000_000  # sharding.target_rows: 100M rows still fit in 10 shards
MAX_SHARD_TOKENS = 10_000_000_000  # sharding.target_tokens: 10M rows of 1,000 tokens
MAX_CHUNK_ROWS = 1_000_000  # sharding.chunk_rows: a chunk is the unit of resume, held in memory while written
MAX_CONTEXT_TOKENS = 10_000_000  # max_tokens, max_model_len, token budgets: the longest context windows (10M)
MAX_SAMPLE_ROWS = 100_000  # qa.sample_size: the sample is written whole and shown to the person who reviews it
ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
OBJECT_STORE_SCHEMES = ("s3://", "gs://", "gcs://")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AdapterSpec(_Model):
    """A LoRA adapter that rows of the job may run with."""

    name: str = Field(
        pattern=ADAPTER_NAME,
        description="The adapter's name in this job: model.default_adapter, a row's model.adapter_column value "
        "and an OpenAI batch request's body.model pick it by this name; each result row records it (adapter).",
    )
    source: str = Field(
        min_length=1,
        description="Where its files are (adapter_config.json and adapter_model.safetensors): a local folder "
        "(absolute path or file://), an object store folder (s3://, gs://) read with the deployment's "
        "credentials, or a hub repo id (org/name) with revision. Local and object store folders must lie under "
        "[vllm_batch] allowed_uri_prefixes; the plan reads and fingerprints every byte of them (the Kubernetes "
        "runner's pods read them at the same location: docs/kubernetes.md).",
    )
    revision: str | None = Field(
        None,
        description="Hub adapters: the full 40-hex commit sha (required; a branch or tag can move). Not "
        "allowed for local and object store sources, which the plan fingerprints byte by byte instead.",
    )

    @property
    def kind(self) -> Literal["local", "object_store", "hub"]:
        """Where the adapter comes from: a local folder, an object store folder, or a hub repo."""
        if self.source.startswith(OBJECT_STORE_SCHEMES):
            return "object_store"
        if self.source.startswith(("file://", "/")):
            return "local"
        return "hub"

    @model_validator(mode="after")
    def _revision_rules(self) -> AdapterSpec:
        where = f"model.adapters[{self.name}]"
        if self.kind == "hub":
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*", self.source):
                raise ValueError(
                    f"{where}: source {self.source!r} is neither a hub repo id (org/name), an absolute local "
                    "path (/adapters/x, file:///adapters/x) nor an object store folder (s3://, gs://)"
                )
            if self.revision is None or not re.fullmatch(r"[0-9a-f]{40}", self.revision):
                raise ValueError(
                    f"{where}: a hub adapter ({self.source!r}) needs revision: its full 40-hex commit sha "
                    f"(got {self.revision!r}); a branch or tag can move to other weights"
                )
        elif self.revision is not None:
            raise ValueError(
                f"{where}: revision applies to hub adapters only; a {self.kind.replace('_', ' ')} source is "
                "fingerprinted byte by byte by the plan"
            )
        return self


class ModelSpec(_Model):
    """Which weights to load."""

    name: str = Field(min_length=1, description="Model name on the hub, or a local/mounted path.")
    revision: str | None = Field(
        None,
        description="Hub revision (commit sha, tag or branch); recorded in outputs. With cache.uri: the full "
        "40-hex commit sha.",
    )
    tokenizer: str | None = Field(None, description="Tokenizer name or path when it differs from the model.")
    tokenizer_revision: str | None = Field(
        None,
        description="Hub revision of the tokenizer (vLLM's tokenizer_revision); unset: model.revision. With "
        "cache.uri and a hub model.tokenizer of another repo: required, the full 40-hex commit sha.",
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field("auto", description="Weight/activation dtype.")
    quantization: str | None = Field(None, description="vLLM quantization method (awq, gptq, fp8, ...).")
    max_model_len: int | None = Field(
        None, gt=0, le=MAX_CONTEXT_TOKENS, description="Context length; defaults to the model's. At most 10,000,000."
    )
    trust_remote_code: bool = Field(False, description="Allow model repos to run their own code. Off by default.")
    served_model_names: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list,
        max_length=16,
        description="OpenAI batch input: the names a request's body.model may give for this model (vLLM's "
        "served_model_name); a request naming another model is that row's error (INVALID_REQUEST), unless "
        "io.ignore_request_model. Empty: model.name.",
    )
    adapters: list[AdapterSpec] = Field(
        default_factory=list,
        max_length=MAX_ADAPTERS,
        description="LoRA adapters rows may run with (chat and generate tasks); vLLM serves them on the one base "
        "model (enable_lora). The plan records each adapter's identity (a sha256 of every byte, or the hub "
        "commit); the worker runs only those bytes, the result cache keys them, and an adapter whose files "
        "changed moves its rows' answers for the 'settings' in the change set.",
    )
    default_adapter: str | None = Field(
        None,
        description="The adapter (a name in model.adapters) rows run with unless they pick one; null: the base model.",
    )
    adapter_column: str | None = Field(
        None,
        description="Input column whose value names the row's adapter (one of model.adapters' names); null or "
        "empty: model.default_adapter. A name that is not the job's is that row's error (INVALID_ROW).",
    )

    @model_validator(mode="after")
    def _adapters(self) -> ModelSpec:
        names = [a.name for a in self.adapters]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"model.adapters: names must be unique, {dup} repeat")
        clash = sorted(set(names) & set(self.served_names))
        if clash:
            raise ValueError(
                f"model.adapters: {clash} is also a served model name; a request's body.model would be ambiguous"
            )
        if self.default_adapter is not None and self.default_adapter not in names:
            raise ValueError(f"model.default_adapter {self.default_adapter!r} is not one of model.adapters {names}")
        if self.adapter_column is not None and not names:
            raise ValueError("model.adapter_column is set but model.adapters is empty")
        return self

    @property
    def served_names(self) -> list[str]:
        """The names OpenAI batch requests may give in body.model for the base model."""
        return list(self.served_model_names) or [self.name]

    def adapter(self, name: str) -> AdapterSpec:
        return next(a for a in self.adapters if a.name == name)


class EngineSpec(_Model):
    """vLLM engine arguments. Typed fields for the common ones, a reviewed pass-through for the rest."""

    max_num_seqs: int | None = Field(None, gt=0, description="Max sequences scheduled at once.")
    max_num_batched_tokens: int | None = Field(None, gt=0, description="Max tokens per engine step.")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="Fraction of GPU memory for vLLM.")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per model replica.")
    enable_prefix_caching: bool | None = Field(None, description="Cache shared prompt prefixes (system prompt).")
    enforce_eager: bool = Field(False, description="Disable CUDA graphs / torch.compile (faster start, slower run).")
    seed: int = Field(0, description="Engine seed.")
    batch_invariant: bool = Field(
        False,
        description="Batch-invariant numerics (vLLM's VLLM_BATCH_INVARIANT=1): a prompt gets the same answer "
        "whatever else shares its batch, so identical prompts in a run (and reruns) agree, at a cost in speed. "
        "Where vLLM offers it (NVIDIA GPUs; vLLM's CPU build does not: the worker refuses it there).",
    )
    max_lora_rank: int | None = Field(
        None,
        description=f"With model.adapters: the largest adapter rank the engine reserves room for (vLLM's "
        f"max_lora_rank, one of {list(LORA_RANKS)}); default: the smallest of those >= the adapters' largest rank. "
        "Below an adapter's rank: refused. The dry run's memory plan counts max_loras slots of this rank.",
    )
    max_loras: int | None = Field(
        None,
        ge=1,
        le=MAX_ADAPTERS,
        description="With model.adapters: adapters in one engine batch (vLLM's max_loras); default: all of them "
        "(every adapter stays loaded in CPU memory either way). On vLLM's CPU build the worker adds one spare slot "
        "and refuses a value below the number of adapters.",
    )
    cpu_kvcache_space_gb: int | None = Field(
        None, gt=0, description="CPU build only: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE)."
    )
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description=f"Extra vllm.LLM kwargs; only these keys: {sorted(ENGINE_KWARGS_ALLOWED)}.",
    )

    @field_validator("max_lora_rank")
    @classmethod
    def _lora_rank(cls, v: int | None) -> int | None:
        if v is not None and v not in LORA_RANKS:
            raise ValueError(f"must be one of vLLM's ranks {list(LORA_RANKS)}, got {v}")
        return v

    @field_validator("engine_kwargs")
    @classmethod
    def _reviewed_keys(cls, v: dict[str, Any]) -> dict[str, Any]:
        bad = sorted(set(v) - ENGINE_KWARGS_ALLOWED)
        if bad:
            raise ValueError(f"engine_kwargs keys not allowed: {bad}; allowed: {sorted(ENGINE_KWARGS_ALLOWED)}")
        if "load_format" in v and v["load_format"] not in LOAD_FORMATS_ALLOWED:
            raise ValueError(
                f"engine_kwargs.load_format {v['load_format']!r} not allowed; allowed: {sorted(LOAD_FORMATS_ALLOWED)}"
            )
        return v


class WorkerSpec(_Model):
    """How the shard worker guards the engine. Does not change outputs: not in the config hash."""

    watchdog_s: float | None = Field(
        600.0,
        gt=0,
        description="No progress (the plan read, an input segment read, a chunk footer checked, an "
        "engine step returned, a chunk written) for this many seconds, in any phase up to the commit: the worker "
        "stops and exits 75 (retry); engine start is not counted. null: no watchdog.",
    )
    oom_min_num_seqs: int = Field(1, ge=1, description="Out of memory: max_num_seqs is halved down to this floor.")
    oom_min_batched_tokens: int = Field(
        256, ge=1, description="Out of memory: max_num_batched_tokens is halved down to this floor."
    )
    oom_max_rebuilds: int = Field(
        8, ge=0, description="Engine rebuilds after OOM per worker process; beyond, the worker exits 75 (retry)."
    )


class PromptSpec(_Model):
    """How a row becomes a prompt."""

    id_column: str = Field("id", min_length=1, description="Column with a unique row id.")
    template: str = Field(
        "{text}",
        min_length=1,
        description="User message / prompt, with {column} placeholders over the row's columns "
        "(plain names only: no attribute or index access). A value renders as text: numbers and booleans as "
        "Python's str (True), NULL as nothing; Parquet dates as 2024-03-01, times as 14:05:00[.ffffff], timestamps "
        "as 2024-03-01 14:05:00[.ffffff] (nanosecond units to the nanosecond; Parquet's INT96, as Spark and Hive "
        "write it, to the microsecond, as DuckDB reads it), a timestamp with a time zone as its "
        "instant in UTC (2024-03-01 13:05:00+00:00, never the file's zone), decimals in fixed point with the "
        "column's scale (12.50). The plan refuses a Parquet template column of another type (binary, list, struct, "
        "map, duration, ...), naming it: cast it in the input, or carry it with io.passthrough; and one whose "
        "files give it different types (bool and int, int and double, two decimal scales, a naive and an aware "
        "timestamp, ...: text of any width, integers of any width but uint64, a column all null in a file, and "
        "time zones of an aware timestamp agree) or a decimal of more than 38 digits, naming the files: cast the "
        "column to one type in every file (a decimal of more digits to a string).",
    )
    text_columns: list[str] | None = Field(
        None,
        description="Template columns that must be non-empty text and that truncation cuts "
        "(default: all template columns).",
    )
    system_prompt: str | None = Field(None, description="System message for chat; shared by all rows.")
    truncation: Literal["reject", "truncate"] = Field(
        "reject",
        description="Over-long prompts: reject as PROMPT_TOO_LONG, or cut the row's text to fit.",
    )
    max_prompt_tokens: int | None = Field(
        None,
        gt=0,
        le=MAX_CONTEXT_TOKENS,
        description="Prompt token budget; default max_model_len - sampling.max_tokens. At most 10,000,000.",
    )

    @field_validator("template")
    @classmethod
    def _plain_placeholders(cls, v: str) -> str:
        template_columns(v)
        return v

    @model_validator(mode="after")
    def _text_in_template(self) -> PromptSpec:
        extra = sorted(set(self.text_columns or []) - set(self.columns))
        if extra:
            raise ValueError(f"text_columns {extra} are not used by the template")
        return self

    @property
    def columns(self) -> list[str]:
        """Columns the template reads, in order of first use."""
        return template_columns(self.template)

    @property
    def texts(self) -> list[str]:
        """Columns that must hold non-empty text."""
        return list(self.text_columns) if self.text_columns else self.columns


def template_columns(template: str) -> list[str]:
    """Names used by a ``{column}`` template; refuses format specs, conversions and lookups."""
    cols: list[str] = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ValueError(f"template is not a valid {{column}} template: {e}") from None
    for _, field, spec, conv in parsed:
        if field is None:
            continue
        if not field.isidentifier() or spec or conv:
            raise ValueError(
                f"template placeholder {{{field}{'!' + conv if conv else ''}{':' + spec if spec else ''}}} "
                "must be a plain column name like {text}"
            )
        if field not in cols:
            cols.append(field)
    return cols


class StructuredOutput(_Model):
    """Constrain the output: exactly one of choice, json_schema, regex."""

    choice: list[str] | None = Field(None, min_length=1, max_length=1000, description="Output is one of these labels.")
    json_schema: dict[str, Any] | None = Field(None, description="Output is JSON valid against this schema.")
    regex: str | None = Field(None, min_length=1, description="Output matches this regular expression.")

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutput:
        n = sum(x is not None for x in (self.choice, self.json_schema, self.regex))
        if n != 1:
            raise ValueError("set exactly one of choice, json_schema, regex")
        if self.choice is not None:
            if len(set(self.choice)) != len(self.choice):
                raise ValueError("choice labels must be unique")
            if any(not c for c in self.choice):
                raise ValueError("choice labels must be non-empty")
            if "(none)" in self.choice:  # QA's report shows a missing answer or a null label so
                raise ValueError("choice label '(none)' is reserved: QA's report shows a missing answer so")
        return self

    def json_schema_text(self) -> str | None:
        """The JSON schema as its JSON text in the order it was written (None without one).

        vLLM's grammar generates an object's properties in the schema's order, so two orders are two answers;
        the hashes dump their documents with sorted keys, and carry this text (a string, which no sort
        reorders) beside it."""
        return None if self.json_schema is None else json.dumps(self.json_schema, separators=(",", ":"))


class SamplingSpec(_Model):
    """Decoding parameters (generate and chat tasks)."""

    temperature: float = Field(0.0, ge=0, le=2, description="0 = greedy (vLLM's range: [0, 2]).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling.")
    max_tokens: int = Field(
        256, gt=0, le=MAX_CONTEXT_TOKENS, description="Max output tokens per row (at most 10,000,000)."
    )
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1, description="Per-request seed (reproducible sampling).")
    stop: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list, description="Stop strings.")
    structured: StructuredOutput | None = Field(None, description="Structured output constraint.")


TABLE_SEGMENT = r"[A-Za-z0-9_][A-Za-z0-9_-]{0,127}"
TABLE_IDENTIFIER = rf"^{TABLE_SEGMENT}(\.{TABLE_SEGMENT}){{1,3}}$"
MAX_ROW_FILTER_CHARS = 4096


class TableInput(_Model):
    """An Iceberg table to read (``io.input_table``): which table, which snapshot, which rows and columns.

    The catalog is the deployment's (the Connection ``[vllm_batch] iceberg_conn_id`` names), never the job's:
    a catalog URI, property or credential here is refused as an unknown field.
    """

    identifier: str = Field(
        pattern=TABLE_IDENTIFIER,
        description="namespace.table (up to 4 dot-separated segments of letters, digits, _ and -); the table must "
        "be allowed by [vllm_batch] allowed_tables.",
    )
    snapshot_id: int | None = Field(
        None,
        ge=1,
        le=2**63 - 1,
        description="The snapshot to read (time travel, a backfill of an old run); null: the table's current "
        "snapshot when the plan runs. Either way the plan pins it and every shard and retry reads it.",
    )
    row_filter: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_ROW_FILTER_CHARS,
        description="An Iceberg row filter (pyiceberg's expression syntax, e.g. \"dt = '2026-12-01' AND lang = "
        "'en'\"), applied exactly: a filter on identity partition columns reads the data files by reference, any "
        "other is evaluated by the plan, which writes the matching rows once under the output prefix.",
    )
    columns: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list,
        description="The table columns the job may read (empty: all); the id, template, adapter and passthrough "
        "columns must be among them, and io.passthrough 'all' means these.",
    )


class TableOutput(_Model):
    """An Iceberg table that publish commits the merged results to (``io.output_table``), by reference."""

    identifier: str = Field(
        pattern=TABLE_IDENTIFIER,
        description="namespace.table; the table must be allowed by [vllm_batch] allowed_tables.",
    )
    mode: Literal["append", "overwrite"] = Field(
        "append",
        description="append: add the run's results; overwrite: replace the rows of the run date's partition "
        "(needs date_column) in the same snapshot.",
    )
    date_column: str | None = Field(
        None,
        description="A date column, identity-partitioned, that carries the run's date (the Airflow run's logical "
        "date, else its run_after). The parts do not store it: readers take it from the partition value "
        "(Iceberg's column projection). null: the table is not partitioned by run date.",
    )
    create: bool = Field(
        False,
        description="Create the table (results schema, plus date_column) in the catalog's warehouse on the first "
        "publish; off: a missing table fails publish.",
    )

    @model_validator(mode="after")
    def _mode(self) -> TableOutput:
        if self.mode == "overwrite" and self.date_column is None:
            raise ValueError("io.output_table.mode 'overwrite' replaces the run date's partition: set date_column")
        return self


class IOSpec(_Model):
    """Where data comes from and goes."""

    input_uri: str | None = Field(
        None,
        min_length=1,
        description="File or folder: local path, s3://, gs://, file://. Exactly one of input_uri and input_table.",
    )
    input_table: TableInput | None = Field(
        None, description="An Iceberg table to read instead of files (docs/tables.md). Exactly one of the two."
    )
    output_table: TableOutput | None = Field(
        None,
        description="An Iceberg table publish commits the merged results to, as one snapshot adding the parts by "
        "reference (docs/tables.md); the run's folder is written as without it.",
    )
    input_format: Literal["auto", "parquet", "jsonl", "openai_batch"] = Field(
        "auto",
        description="auto: by extension (.parquet; .jsonl whose first line is a request, a body and custom_id, "
        "url or method -> openai_batch).",
    )
    output_uri: str = Field(min_length=1, description="Run output prefix (folder).")
    output_format: Literal["parquet", "openai_batch"] = Field(
        "parquet",
        description="Merged results format; parquet is always written, openai_batch adds JSONL files (chat "
        "completion lines for task chat, text completion lines for generate, embedding lines for embed; classify "
        "has no such line).",
    )
    passthrough: list[Annotated[str, Field(min_length=1)]] | Literal["all"] = Field(
        default_factory=list,
        description="Parquet input: input columns copied into every row of results/ and errors/ with their "
        "own types (timestamps, decimals, nested lists ...), after the result columns; 'all': every input "
        "column but prompt.id_column (the row's id). The workers carry them from the rows they read (merge "
        "reads no input and still publishes by reference); the result cache never stores them (a hit gets this "
        "run's values); golden rows, OpenAI batch output lines and changes/ do not carry them.",
    )
    passthrough_prefix: str = Field(
        "",
        description="Prepended to each passthrough column's name in results/ and errors/ (e.g. 'input_'), so "
        "that input columns named like result columns (label, output, model ...) can be passed through.",
    )
    ignore_request_model: bool = Field(
        False,
        description="OpenAI batch input: answer every request with the job's model whatever its body.model "
        "names (off: a request naming a model the job does not serve, model.served_model_names or an adapter, "
        "is that row's error).",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Reviewed fsspec options only (cache and block sizes, retries and timeouts, region, "
        "server-side encryption); endpoints, credentials and access control are the deployment's "
        "(docs/security.md).",
    )

    @model_validator(mode="after")
    def _one_input(self) -> IOSpec:
        if (self.input_uri is None) == (self.input_table is None):
            raise ValueError("give exactly one of io.input_uri (files) and io.input_table (an Iceberg table)")
        if self.input_table is not None and self.input_format not in ("auto", "parquet"):
            raise ValueError(f"io.input_table reads Parquet data files; io.input_format is {self.input_format!r}")
        return self

    @property
    def input_name(self) -> str:
        """The input as messages name it: the URI, or ``iceberg table <identifier>``."""
        if self.input_table is not None:
            return f"iceberg table {self.input_table.identifier}"
        assert self.input_uri is not None
        return self.input_uri


class ShardingSpec(_Model):
    """How the planner splits rows into shards and the worker into chunks."""

    target_rows: int | None = Field(
        None,
        gt=0,
        le=MAX_SHARD_ROWS,
        description="Rows per shard (default: 10000 when no token target; at most 10,000,000).",
    )
    target_tokens: int | None = Field(
        None, gt=0, le=MAX_SHARD_TOKENS, description="Estimated prompt tokens per shard (at most 10,000,000,000)."
    )
    max_shards: int = Field(256, ge=1, le=100_000, description="Upper bound on shard count.")
    long_row_tokens: int | None = Field(
        None,
        gt=0,
        le=MAX_CONTEXT_TOKENS,
        description="Rows estimated above this many tokens go to separate 'long' shards (at most 10,000,000).",
    )
    chunk_rows: int = Field(
        512,
        ge=1,
        le=MAX_CHUNK_ROWS,
        description="Rows per committed chunk inside a shard (resume granularity; at most 1,000,000).",
    )
    chars_per_token: float = Field(4.0, gt=0, description="Token estimate used by the planner (no tokenizer).")
    history_uri: str | None = Field(
        None,
        description="Folder of throughput records (one small JSON-lines file per merged run, written by merge). "
        "When set and it holds records for this model (and hardware), the planner sizes shards by "
        "time instead of target_rows/target_tokens; see airflow_provider_vllm/steps/plan/sizing.py.",
    )
    target_minutes: float | None = Field(
        None,
        gt=0,
        le=24 * 60,
        description="Minutes per shard when sizing from history (engine start + inference); default: "
        "long enough that the expected engine start (warm when the pods share a compile cache, else cold; "
        "docs/sizing.md) is <= 10% of a shard's time (at least 5 minutes).",
    )
    hardware: str | None = Field(
        None,
        min_length=1,
        description="Hardware the shards run on, as the worker records it (e.g. '1x NVIDIA H200'); "
        "history records of other hardware are ignored. Default: the newest matching record's hardware.",
    )
    dedupe: bool = Field(
        True,
        description="Infer each distinct rendered prompt once per run and give its answer to every row of the same "
        "input (docs/cache.md): only with deterministic sampling (task embed or classify, sampling.temperature 0, "
        "or a sampling.seed) and Parquet input; otherwise every row is inferred. false: infer every row.",
    )


RESERVED_ID_PREFIX = "_vllm_golden:"
"""Ids of the golden rows that ride along (``qa.reference.ride_along_uri``): input ids may not start with it."""


class ReferenceSpec(_Model):
    """Known labels that QA scores the answers against (jobs with labels: structured choice, classify).

    Three sources; a run may use ``input_column`` or ``golden_uri`` (not both) and, besides either,
    ``ride_along_uri``. Rows are scored by their ``label`` (an error or an invalid answer is a wrong one).
    An empty string is no source (a DAG template over an unset Variable renders to '').
    """

    input_column: str | None = Field(
        None,
        min_length=1,
        description="Input column that holds a row's known label (Parquet input). Sparse is fine: rows whose "
        "value is null or blank are not scored. Not a column the prompt template or model.adapter_column reads "
        "(the model would be shown the label it is scored against).",
    )
    golden_uri: str | None = Field(
        None,
        description="Golden set: a Parquet file or folder with columns id_column and label_column. Its ids are "
        "joined to this run's ids; golden ids that are not in the run are counted and ignored. plan pins its "
        "files (names, sizes, sha256; at most 1000 files and 8 GiB, no symbolic links) in the sealed plan; QA "
        "scores only those bytes, refuses a golden set changed since the plan, and names the files in its report.",
    )
    ride_along_uri: str | None = Field(
        None,
        description="Golden rows that ride along with every run: a Parquet file or folder with id_column, the "
        "prompt template's columns (and model.adapter_column, when set) and label_column; io.passthrough columns "
        "are neither needed nor published for them. plan adds them under reserved ids "
        f"('{RESERVED_ID_PREFIX}<id>'); they are inferred with this run's settings in shards of their own and "
        "scored by QA, and never published among the results, errors, changes or the cache, nor counted as "
        "input rows. Lets a nightly over unlabelled data measure itself every night. Not for openai_batch input.",
    )
    id_column: str = Field("id", min_length=1, description="The id column of golden_uri and ride_along_uri.")
    label_column: str = Field(
        "label",
        min_length=1,
        description="The label column of golden_uri and ride_along_uri. With ride_along_uri, not a column the prompt "
        "template or model.adapter_column reads (the golden rows would show the model their label).",
    )

    @field_validator("input_column", "golden_uri", "ride_along_uri", mode="before")
    @classmethod
    def _empty_is_none(cls, v: Any) -> Any:
        # a template over an unset Variable renders to '': no source
        return None if isinstance(v, str) and not v.strip() else v

    @model_validator(mode="after")
    def _one_source_for_run_rows(self) -> ReferenceSpec:
        if self.input_column is not None and self.golden_uri is not None:
            raise ValueError("set one of input_column and golden_uri (ride_along_uri goes with either)")
        if self.ride_along_uri is not None and self.label_column == self.id_column:
            raise ValueError("label_column and id_column must differ")
        return self

    @property
    def configured(self) -> bool:
        """Whether any source of known labels is set."""
        return any(x is not None for x in (self.input_column, self.golden_uri, self.ride_along_uri))


# the QA checks that warn and fail *above* a pair of thresholds (``warn_<m>`` <= ``fail_<m>``)
QA_RATES = (
    "error_rate",
    "empty_rate",
    "invalid_rate",
    "truncation_rate",
    "label_drift",
    "churn_rate",
    "accuracy_drop",
    "low_confidence_rate",
    "inconsistency_rate",
)


class QASpec(_Model):
    """Sampling and publication thresholds. warn_* -> human review, fail_* -> the run fails."""

    sample_size: int = Field(200, ge=0, le=MAX_SAMPLE_ROWS, description="Rows in the QA sample (at most 100,000).")
    seed: int = Field(0, description="Sample seed.")
    warn_error_rate: float = Field(0.01, ge=0, le=1, description="Rows that failed: error rows / all rows.")
    fail_error_rate: float = Field(0.05, ge=0, le=1, description="As warn_error_rate, failing the run.")
    warn_empty_rate: float = Field(0.01, ge=0, le=1, description="Ok rows with a null or whitespace-only output.")
    fail_empty_rate: float = Field(0.05, ge=0, le=1, description="As warn_empty_rate, failing the run.")
    warn_invalid_rate: float = Field(0.01, ge=0, le=1, description="Structured outputs that do not parse/match.")
    fail_invalid_rate: float = Field(0.05, ge=0, le=1, description="As warn_invalid_rate, failing the run.")
    warn_truncation_rate: float = Field(
        0.05, ge=0, le=1, description="Ok rows whose prompt was cut to fit (prompt.truncation: truncate)."
    )
    fail_truncation_rate: float = Field(0.2, ge=0, le=1, description="As warn_truncation_rate, failing the run.")
    warn_label_drift: float = Field(0.1, ge=0, le=1, description="Total variation distance vs previous run.")
    fail_label_drift: float = Field(0.3, ge=0, le=1, description="As warn_label_drift, failing the run.")
    previous_report_uri: str | None = Field(
        None,
        description="The qa/report.json of the run to compare against (label drift, the change in accuracy). Used "
        "only when that run's sealed qa/_QA.json vouches for its bytes and it is a report of this job (name); "
        "otherwise those checks warn, with a note. No run there at all (a first run): not judged, with a note. "
        "Never inside io.output_uri: that is this run's own report.",
    )
    previous_published: bool = Field(
        False,
        description="Compare (label drift, the change in accuracy) against the report of the run that "
        "changes.previous_published or changes.previous_table pinned: the run this job published last before this "
        "one (to its Asset, or to io.output_table), so a run that failed QA or was never published is never the "
        "baseline. Its qa/report.json must have exactly the sha256 that run's sealed _SUCCESS.json "
        "(changes.previous_published) or _PUBLISHING.json (changes.previous_table) names (the plan pins it); "
        "otherwise QA fails. Nothing published before: not judged, with a note. Needs changes.previous_published or "
        "changes.previous_table; exclusive with previous_report_uri.",
    )
    warn_churn_rate: float = Field(
        1.0,
        ge=0,
        le=1,
        description="Share of the ids in both this run and changes.previous_uri whose answer "
        "changed (1.0: never warns).",
    )
    fail_churn_rate: float = Field(1.0, ge=0, le=1, description="As warn_churn_rate, failing the run.")
    reference: ReferenceSpec = Field(
        default_factory=ReferenceSpec,
        description="Known labels to score the answers against (accuracy, per-class figures, confusion matrix).",
    )
    confidence: bool | None = Field(
        None,
        description="Ask the engine for each answer's probability (the chosen tokens' logprobs: one log-softmax "
        "per generated token) and store it in the results' confidence column. null: on for structured choice "
        "(the chosen label's probability), off for other generations; true: also for other generations (the "
        "whole output's probability); false: off. Classify always has it (the top class's probability).",
    )
    low_confidence: float = Field(
        0.5,
        ge=0,
        le=1,
        description="An answer whose confidence (the engine's probability of it) is below this counts as low "
        "confidence (the low_confidence_rate).",
    )
    least_confident: int = Field(
        20, ge=0, le=10_000, description="The least confident answers added to the review sample (0: none)."
    )
    warn_accuracy_below: float = Field(
        0.8,
        ge=0,
        le=1,
        description="Accuracy on the labelled rows (qa.reference) below this: warn. Each source of known labels "
        "(the run's own rows, the ride-along golden rows) is judged on its own rows; the check is the worst. Known "
        "labels all of one class (of a job with several) do not pass: warn (a model answering it to every row would "
        "score as well), nor an accuracy whose 95% interval reaches down to the share of the most common known label "
        "(what answering it to every row scores): warn. Set "
        "(this or fail_accuracy_below) to other than the default and not 0 (0: the gate is off) with no known label "
        "reaching QA, or a previous report that had some: warn.",
    )
    fail_accuracy_below: float = Field(
        0.5, ge=0, le=1, description="Accuracy on the labelled rows below this: fail (the run is not published)."
    )
    min_labelled: int = Field(
        30,
        ge=1,
        description="Fewer scored rows than this (in a source of known labels): the accuracy check warns that there "
        "are too few to gate on (rather than passing or failing on noise), and fails when even the top of the 95% "
        "interval is below fail_accuracy_below; a reference that matches no row of the run warns.",
    )
    warn_accuracy_drop: float = Field(
        0.0,
        ge=0,
        le=1,
        description="A drop in accuracy since the previous report (previous_report_uri) that the 95% interval of "
        "the change calls real (the whole interval below 0) and larger than this: warn. 0: any real drop warns. Each "
        "source of known labels is compared with the same source of the previous report (and all of them pooled, when "
        "both reports have the same sources), only on the same yardstick: a golden set changed since is compared on "
        "the ids both sets share with the same label (paired), or, when none can be paired, not compared (a warning "
        "naming both); the check is the worst.",
    )
    fail_accuracy_drop: float = Field(
        0.05, ge=0, le=1, description="As warn_accuracy_drop, failing the run (a real drop of more than 5 points)."
    )
    warn_low_confidence_rate: float = Field(
        1.0,
        ge=0,
        le=1,
        description="Share of the answers with a confidence below low_confidence above this: warn (1.0: never; "
        "pick it from the report's reliability table). Set below 1 (this or fail_low_confidence_rate), answers "
        "without a confidence count as low, and a run whose answers have none warns.",
    )
    fail_low_confidence_rate: float = Field(1.0, ge=0, le=1, description="As warn_low_confidence_rate, failing.")
    warn_inconsistency_rate: float = Field(
        1.0,
        ge=0,
        le=1,
        description="Share of the prompts sent more than once in the run that got different answers, above "
        "this: warn (1.0: never). Only requests whose answer the request decides are compared (greedy, seeded, "
        "embed, classify); set below 1 (this or fail_inconsistency_rate), a run with none of them warns.",
    )
    fail_inconsistency_rate: float = Field(1.0, ge=0, le=1, description="As warn_inconsistency_rate, failing.")

    @model_validator(mode="after")
    def _warn_below_fail(self) -> QASpec:
        for m in QA_RATES:
            if getattr(self, f"warn_{m}") > getattr(self, f"fail_{m}"):
                raise ValueError(f"warn_{m} must be <= fail_{m}")
        if self.fail_accuracy_below > self.warn_accuracy_below:
            raise ValueError("fail_accuracy_below must be <= warn_accuracy_below")
        return self


class CacheSpec(_Model):
    """The result cache: rows whose answer is already known are not sent to the engine again."""

    uri: str | None = Field(
        None,
        description="Cache folder (local, s3://, gs://) shared by the runs of one job; null: no cache. "
        "Entries are keyed by everything that decides a row's answer (steps/cache/result_cache.py).",
    )
    allow_sampling: bool = Field(
        False, description="Cache answers made with sampling.temperature > 0 (not reproducible); refused otherwise."
    )


class ChangesSpec(_Model):
    """What moved since the previous run: ``changes/`` output and the QA churn matrix."""

    previous_uri: str | None = Field(
        None,
        description="Output prefix of the run to compare against (its merged results); null: no changes "
        "output. A missing previous run is not an error: every id is 'added'. Never io.output_uri, a folder "
        "inside it or one holding it: that is this run itself.",
    )
    previous_table: bool = Field(
        False,
        description="Compare against the run whose snapshot io.output_table holds last, as the plan finds it "
        "(the snapshot summary's vllm-batch.run-id: that run's sealed output prefix, which must be inside "
        "allowed_uri_prefixes); the plan pins it, and the merge of it the snapshot published (its "
        "vllm-batch.results-manifest-sha256): QA fails when that run's folder holds another merge or none. No "
        "earlier snapshot of a run: no changes output. Exclusive with previous_uri.",
    )
    previous_published: bool = Field(
        False,
        description="Compare against the run this job published last before this one: of the events of the job's "
        "Airflow Asset that this DAG's publish task emitted (Airflow's metadata database, not the bucket), the one of "
        "the latest logical date before this run's (no logical date: the newest), as the plan task reads it; the plan "
        "pins that run and the merge it published (the event's success_sha256 must be the sha256 of the run's "
        "sealed _SUCCESS.json). A run that failed QA or was never published is never the baseline. No such event: "
        "no changes output. Needs vllm_batch_job given it as true in the DAG file's dict spec (then the plan task "
        "reads the Asset's events); turned on anywhere else, the plan fails. Exclusive with previous_uri and "
        "previous_table.",
    )


# Fields of the hashed sections added after the first release: left out of ``output_hash`` while at their
# default (which changes no answer), so rows, chunks and cache entries of earlier runs keep matching.
_SORTED: dict[str, Any] = {"sort_keys": True, "separators": (",", ":")}
ADDED_LATER: tuple[tuple[str, str], ...] = (
    ("engine", "batch_invariant"),
    ("engine", "max_lora_rank"),
    ("engine", "max_loras"),
    ("model", "served_model_names"),
    ("model", "adapters"),
    ("model", "default_adapter"),
    ("model", "adapter_column"),
)


def _added_later_default(section: str, name: str) -> Any:
    models: dict[str, type[BaseModel]] = {"engine": EngineSpec, "model": ModelSpec}
    model = models[section]
    return model.model_fields[name].get_default(call_default_factory=True)


class JobSpec(_Model):
    """A whole batch inference job."""

    name: str = Field("job", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$", description="Job name (labels, paths).")
    task: Literal["generate", "chat", "embed", "classify"] = Field("chat", description="What vLLM does per row.")
    model: ModelSpec
    engine: EngineSpec = Field(default_factory=EngineSpec)
    worker: WorkerSpec = Field(default_factory=WorkerSpec)
    prompt: PromptSpec = Field(default_factory=PromptSpec)
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    io: IOSpec
    sharding: ShardingSpec = Field(default_factory=ShardingSpec)
    qa: QASpec = Field(default_factory=QASpec)
    cache: CacheSpec = Field(default_factory=CacheSpec)
    changes: ChangesSpec = Field(default_factory=ChangesSpec)
    kubernetes: KubernetesSettings = Field(
        default_factory=KubernetesSettings,
        description="Kubernetes runner: pod resources and placement (not part of content_hash).",
    )

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        if self.task in ("embed", "classify"):
            if self.sampling.structured is not None:
                raise ValueError(f"sampling.structured does not apply to task {self.task!r}")
            if self.prompt.system_prompt:
                raise ValueError(f"prompt.system_prompt does not apply to task {self.task!r}")
        if self.io.output_format == "openai_batch" and self.task == "classify":
            # the lines would be chat completions with no content: the label and class probabilities dropped
            raise ValueError(
                "io.output_format 'openai_batch' has no line for task 'classify' (the OpenAI Batch API and vLLM's "
                "run-batch have chat completion and embedding lines, not classifications): use 'parquet', whose "
                "results/ carry label, scores and confidence"
            )
        if self.io.input_format == "openai_batch" and self.task not in ("chat", "embed"):
            raise ValueError("openai_batch input supports task 'chat' (/v1/chat/completions) or 'embed'")
        ref = self.qa.reference
        if ref.configured:
            st = self.sampling.structured
            if not (self.task == "classify" or (st is not None and st.choice and self.task in ("chat", "generate"))):
                raise ValueError(
                    "qa.reference scores labels: it needs sampling.structured.choice (chat, generate) or task classify"
                )
            if ref.input_column is not None and ref.input_column == self.prompt.id_column:
                raise ValueError("qa.reference.input_column is prompt.id_column; name the column of known labels")
            # a known label the worker reads (into the prompt, or to pick the adapter) is shown to the model: its
            # accuracy would measure copying, and a run whose unlabelled rows are mostly wrong would pass
            shown = [*self.prompt.columns, *([self.model.adapter_column] if self.model.adapter_column else [])]
            for field, column in (("input_column", ref.input_column), ("label_column", ref.label_column)):
                if column is None or column not in shown or (field == "label_column" and ref.ride_along_uri is None):
                    continue
                raise ValueError(
                    f"qa.reference.{field} {column!r} is a column the worker reads (prompt.template or "
                    "model.adapter_column): the model would be shown the known label it is scored against; "
                    + (
                        "keep the known labels in a column of their own"
                        if field == "input_column"
                        else "give the golden file's label column another name"
                    )
                )
            if ref.ride_along_uri is not None and self.io.input_format == "openai_batch":
                raise ValueError("qa.reference.ride_along_uri needs template rows; openai_batch input carries requests")
        if self.model.adapters and self.task not in ("chat", "generate"):
            raise ValueError(f"model.adapters apply to tasks 'chat' and 'generate', not {self.task!r}")
        if self.prompt.system_prompt and self.io.input_format == "openai_batch":
            raise ValueError(
                "prompt.system_prompt does not apply to openai_batch input: each request line carries its own "
                "messages (put a system message in them)"
            )
        if self.model.adapter_column is not None and self.io.input_format == "openai_batch":
            raise ValueError("model.adapter_column does not apply to openai_batch input: a request's body.model picks")
        if self.changes.previous_table:
            if self.io.output_table is None:
                raise ValueError(
                    "changes.previous_table compares with io.output_table's last snapshot: set io.output_table"
                )
            if self.changes.previous_uri is not None:
                raise ValueError("changes.previous_table and changes.previous_uri are exclusive: give one")
        if self.changes.previous_published and (self.changes.previous_uri is not None or self.changes.previous_table):
            raise ValueError(
                "changes.previous_published, changes.previous_table and changes.previous_uri are exclusive: give one"
            )
        if self.qa.previous_published:
            if not (self.changes.previous_published or self.changes.previous_table):
                raise ValueError(
                    "qa.previous_published compares with the report of the run changes.previous_published or "
                    "changes.previous_table pins: set one of them too, or turn qa.previous_published off as well "
                    "(qa.previous_report_uri may name the report to compare with instead)"
                )
            if self.qa.previous_report_uri is not None:
                raise ValueError("qa.previous_published and qa.previous_report_uri are exclusive: give one")
        if self.io.passthrough and self.io.input_format in ("jsonl", "openai_batch"):
            raise ValueError(
                f"io.passthrough needs Parquet input (typed columns); io.input_format is {self.io.input_format!r}"
            )
        check_values(self.model_dump(mode="json"))  # patterns, sizes, no Jinja: spec_guard.py
        return self

    @property
    def confidence_from_logprobs(self) -> bool:
        """Whether the worker asks the engine for the chosen tokens' logprobs (``qa.confidence``)."""
        if self.task not in ("chat", "generate"):
            return False
        if self.qa.confidence is not None:
            return self.qa.confidence
        return self.confidence_by_default

    @property
    def confidence_by_default(self) -> bool:
        """What ``confidence_from_logprobs`` is with ``qa.confidence`` unset: on for structured choice."""
        st = self.sampling.structured
        return self.task in ("chat", "generate") and st is not None and st.choice is not None

    # ---- identity -------------------------------------------------------------------
    def canonical_json(self) -> str:
        # where the shards run does not change what they compute
        doc = self.model_dump(mode="json", exclude={"kubernetes"})
        if doc["sharding"]["dedupe"] is True:  # added later: at its default, specs keep the hash they had
            del doc["sharding"]["dedupe"]
        for section in ("changes", "qa"):  # likewise
            if doc[section]["previous_published"] is False:
                del doc[section]["previous_published"]
        # The dump sorts keys, but vLLM generates a JSON schema's properties in the order written: a schema
        # not written in sorted order adds its text (a string, which no sort reorders), so that a re-run with
        # its properties reordered is another spec. A schema written sorted keeps the hash it had.
        written = self.sampling.structured.json_schema_text() if self.sampling.structured else None
        if written is not None and written != json.dumps(doc["sampling"]["structured"]["json_schema"], **_SORTED):
            doc["json_schema_text"] = written
        return json.dumps(doc, **_SORTED)

    def content_hash(self) -> str:
        """sha256 of the canonical JSON; equal specs hash equal."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()

    def output_hash(self) -> str:
        """Hash of what decides a row's output (model, engine, task, prompt, sampling): the 'config hash'."""
        d = self.model_dump(mode="json", include={"task", "model", "engine", "prompt", "sampling"})
        for section, name in ADDED_LATER:  # at their neutral default, specs without them keep the hash they had
            if d[section][name] == _added_later_default(section, name):
                del d[section][name]
        st = self.sampling.structured
        if st is not None and st.json_schema is not None:  # only then: other specs keep the hash they had
            d["json_schema_text"] = st.json_schema_text()
        return hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    # ---- loading --------------------------------------------------------------------
    @classmethod
    def load(cls, data: Any) -> JobSpec:
        """From a dict, JSON string, or an existing spec; raises SpecError naming the fields."""
        if isinstance(data, JobSpec):
            return data
        try:
            if isinstance(data, (str, bytes)):
                return cls.model_validate_json(data)
            return cls.model_validate(data)
        except ValidationError as e:
            raise SpecError(format_validation_error(e)) from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> JobSpec:
        """From a YAML file (a ``job:`` key or the spec at top level)."""
        try:
            doc = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise SpecError(f"cannot read job spec {path}: {e}") from None
        if isinstance(doc, dict) and "job" in doc and "model" not in doc:
            doc = doc["job"]
        return cls.load(doc)

    @classmethod
    def from_params(
        cls, params: dict[str, Any], base: JobSpec | dict | None = None, keep_null: Collection[str] = ()
    ) -> JobSpec:
        """From flat DAG params layered over a base spec.

        Keys are dotted paths (``sampling.max_tokens``) or the short names listed in
        ``PARAM_ALIASES`` (``labels``, ``model``, ``input_uri`` ...). ``None`` values are
        ignored so that empty form fields keep the base's value, except for the keys in
        ``keep_null``, which are set to null (a deployment override such as ``{"cache.uri": null}``).
        """
        doc = base.model_dump(mode="json") if isinstance(base, JobSpec) else json.loads(json.dumps(base or {}))
        for key, value in params.items():
            if value is None and key not in keep_null:
                continue
            path = PARAM_ALIASES.get(key, key)
            if path is None:
                continue
            if path == "sampling.structured.choice":
                # list() would make a string its characters, a mapping its keys
                if value is not None and not (
                    isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
                ):
                    raise SpecError(f"param {key!r}: must be a list of label strings, got {type(value).__name__}")
                doc.setdefault("sampling", {})["structured"] = None if value is None else {"choice": list(value)}
                continue
            parts = path.split(".")
            node = doc
            for p in parts[:-1]:
                node = node.setdefault(p, {})
                if not isinstance(node, dict):
                    raise SpecError(f"param {key!r}: {p!r} is not a section")
            node[parts[-1]] = value
        return cls.load(doc)


# Short names used by DAG params / trigger forms.
PARAM_ALIASES: dict[str, str | None] = {
    "model": "model.name",
    "model_revision": "model.revision",
    "input_uri": "io.input_uri",
    "input_format": "io.input_format",
    "output_uri": "io.output_uri",
    "output_format": "io.output_format",
    "system_prompt": "prompt.system_prompt",
    "template": "prompt.template",
    "id_column": "prompt.id_column",
    "labels": "sampling.structured.choice",
    "temperature": "sampling.temperature",
    "max_tokens": "sampling.max_tokens",
    "shard_rows": "sharding.target_rows",
    "max_shards": "sharding.max_shards",
    "task": "task",
    "compare_with": "changes.previous_uri",
    "runner": None,  # read by the Airflow layer, not part of the job
}


def format_validation_error(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "<spec>"
        lines.append(f"{loc}: {err['msg']}")
    return "invalid job spec: " + "; ".join(lines)
