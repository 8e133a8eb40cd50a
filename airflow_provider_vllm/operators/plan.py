"""The plan task: render the job spec, validate it, plan the shards."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_vllm.core import qa_gates
from airflow_provider_vllm.core.allow_list import canonical_uri, is_under
from airflow_provider_vllm.core.errors import SpecError
from airflow_provider_vllm.core.param_schemas import validate_params
from airflow_provider_vllm.core.plan import LastPublished
from airflow_provider_vllm.core.shard_names import with_display_names
from airflow_provider_vllm.core.spec import PARAM_ALIASES, JobSpec
from airflow_provider_vllm.core.spec_guard import DEPLOYMENT_OWNED, owned_paths_set
from airflow_provider_vllm.hooks.filesystems import ConnectionFileSystems, task_filesystems
from airflow_provider_vllm.hooks.iceberg import tables as iceberg_tables
from airflow_provider_vllm.operators.review import parse_flag
from airflow_provider_vllm.steps.lineage import plan_lineage
from airflow_provider_vllm.steps.plan.planner import plan_job
from airflow_provider_vllm.utils import provenance
from airflow_provider_vllm.utils.deployment import (
    DATE_COLUMN_READ,
    check_run_dates,
    check_run_may_write,
    check_runner_choice,
    check_spec_allowed,
    signing_keyring,
    variables_may_loosen_qa,
    variables_may_set_deployment_settings,
    warm_starts,
)
from airflow_provider_vllm.utils.engine_identity import shard_engine_identity
from airflow_provider_vllm.utils.job_spec import (
    PLAN_XCOM_KEY,
    SPEC_XCOM_KEY,
    check_local_model,
    check_runner,
    data_plane_errors,
    overrides_document,
    spec_document,
)
from airflow_provider_vllm.utils.published import last_published, newest_events


def _default_doc() -> dict[str, Any]:
    return JobSpec.load({"model": {"name": "m"}, "io": {"input_uri": "/i", "output_uri": "/o"}}).model_dump(mode="json")


def max_map_length() -> int:
    """Airflow's ``[core] max_map_length``: the most mapped shard tasks one expand() may create."""
    from airflow.sdk.configuration import conf

    return conf.getint("core", "max_map_length", fallback=1024)


class VllmPlanOperator(BaseOperator):
    """Validate the job spec and the input dataset, write ``_plan.json``, return the shards.

    The spec is rendered at run time (``spec`` and ``overrides`` are templated; a YAML/JSON
    spec kept beside the DAG can be passed as ``"{% include 'job.yaml' %}"``), then layered: ``spec`` <- ``overrides``
    <- the DAG params named in ``param_overrides`` (typed values, already validated by
    Airflow's Param schemas; ``None`` keeps the spec's value). Keys of ``overrides`` are
    dotted paths (``sampling.max_tokens``) or ``JobSpec`` param aliases (``labels``, ``model``).

    Pushes the validated spec (a JSON-able dict) under the XCom key ``spec``; downstream
    tasks take it from there, as data, never re-templated; and the sealed plan's identity under the XCom key
    ``plan`` (``PlanRef.dump()``: ``plan_mac``, ``plan_sha256``), for merge. Returns one ``ShardSummary`` per shard,
    named (``core/shard_names.py``), as JSON data (``.dump()``) for ``.expand(shard=...)``.

    Fails without retry on an invalid spec, a key of the run's conf (``dag_run.conf``) or a ``param_overrides`` name
    with a value that the DAG declares no ``Param`` for, a run Airflow did not schedule whose output its own dates
    name while one of them has not ended (``check_run_dates``), an unknown or unavailable ``runner``, a runner
    chosen at run time (a template) that ``[vllm_batch] allowed_runners`` does not allow, a missing local model
    folder, a bad dataset (missing id column, duplicate or blank ids, ...), an
    output store that does not honour create-only writes, or a plan with more shards than
    Airflow's ``[core] max_map_length`` (the message names the sharding setting to raise).

    ``dry_run=True`` (or a run param ``dry_run`` set to true, on a DAG that declares that param) validates
    the spec and the input, logs the dry-run report (rows, tokens, shards, GPU-hours, memory plan; see
    ``airflow_provider_vllm.cli.dry_run``), pushes it under the XCom key ``dry_run``, writes
    nothing and skips the rest of the run: no shard is launched.

    What decides whether the run is published (``core/qa_gates.py``: QA thresholds, the baselines and known labels
    QA compares with) may come from a Variable or the trigger only as strict as, or stricter than, the DAG file's
    own value (the spec default where it sets none); looser fails without retry, naming the setting, both values
    and who set it (a Variable may loosen with ``[vllm_batch] qa_settings_from_variables``). ``review_ask``: the
    review task's ``ask`` (``vllm_batch_job``'s ``human_review``, templated), checked here by the same rule so that
    a Variable or trigger turning the review off fails before any shard runs (the review task checks it again when
    it decides).

    ``aws_conn_id`` / ``gcp_conn_id``: the Airflow Connections through which this task reaches
    ``s3://`` / ``gs://`` locations (DAG-file settings, never templated; None: ``[vllm_batch]
    aws_conn_id`` / ``gcp_conn_id``, else ``aws_default`` / ``google_cloud_default``). See
    ``airflow_provider_vllm.hooks.filesystems``.
    """

    template_fields: Sequence[str] = (
        "spec",
        "overrides",
        "runner",
        "kubernetes",
        "shard_env",
        "review_ask",
        "output_under",
    )
    # No template_ext: it would turn any spec string ending in .json (a URI) into a file name.
    template_fields_renderers = {"spec": "json", "overrides": "json"}
    ui_color = "#e8f0fe"

    def __init__(
        self,
        *,
        spec: dict[str, Any] | str | JobSpec,
        overrides: dict[str, Any] | str | None = None,
        param_overrides: Sequence[str] = (),
        runner: str = "local",
        kubernetes: Mapping[str, Any] | str | None = None,
        shard_env: Mapping[str, str] | None = None,
        dry_run: bool = False,
        aws_conn_id: str | None = None,
        gcp_conn_id: str | None = None,
        published_asset: Any = None,
        publish_task_id: str | None = None,
        review_ask: bool | str | None = None,
        output_under: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        # changes.previous_published: the job's Asset (an inlet of this task) and the task that publishes it
        self.published_asset = published_asset
        self.publish_task_id = publish_task_id
        self.aws_conn_id = aws_conn_id
        self.gcp_conn_id = gcp_conn_id
        self.dry_run = dry_run
        self.spec = spec.model_dump(mode="json") if isinstance(spec, JobSpec) else spec
        self.overrides = overrides
        self.param_overrides = list(param_overrides)
        self.runner = runner
        self.kubernetes = kubernetes
        self.shard_env = shard_env
        self.review_ask = review_ask
        # the DAG file's values before rendering: provenance of the rendered spec (utils/provenance.py), and
        # whether the runner is the DAG file's literal or chosen at run time ([vllm_batch] allowed_runners)
        self._raw_spec, self._raw_overrides, self._raw_runner = self.spec, overrides, runner
        self._raw_review_ask = review_ask
        # where this DAG's runs may write (a form that may set the output: the re-run template); the DAG file's
        self.output_under, self._raw_output_under = output_under, output_under
        owned = [
            k
            for k in self.param_overrides
            if any(provenance.touches(PARAM_ALIASES.get(k, k) or "", p) for p in DEPLOYMENT_OWNED)
        ]
        if owned:
            raise ValueError(
                f"param_overrides {owned}: deployment-owned settings cannot come from trigger params (docs/security.md)"
            )

    def filesystems(self) -> ConnectionFileSystems:
        """How this task reaches object stores: the deployment's Connections (never the spec's credentials)."""
        return task_filesystems(self.aws_conn_id, self.gcp_conn_id)

    def check_declared(self, params: Mapping[str, Any], context: Any, conf: Mapping[str, Any] | None = None) -> None:
        """Fail without retry when the run's conf (``conf``, else ``dag_run.conf``) holds a key that neither the DAG
        nor one of its tasks declares a ``Param`` for, or a ``param_overrides`` name without one has a value.

        Airflow merges every ``dag_run.conf`` key into the params, declared or not: a value there came from whoever
        triggered the run, past any form and its JSON schema, and a key that matches no Param (a typo,
        ``Output_uri``) would run with the defaults. Airflow's own paths put no other key there (a scheduled,
        asset-triggered or cleared run has no conf, a backfill and ``TriggerDagRunOperator`` the conf they are
        given, the trigger form the DAG's params). Only the params the DAG declares reach the spec."""
        dag = context.get("dag") or (self.dag if self.has_dag() else None)
        if dag is None:  # a bare operator: no DAG declares params
            return
        # a task's own Param (another task's too: the conf reaches every task's params) is declared as well
        declared = set(getattr(dag, "params", None) or {}) | set(self.params or {})
        declared = declared.union(*(set(getattr(t, "params", None) or {}) for t in getattr(dag, "tasks", ())))
        if conf is None:
            conf = getattr(context.get("dag_run"), "conf", None) or {}
        unknown = sorted(str(k) for k in conf if k not in declared)
        if unknown:
            shown = [k[:80] for k in unknown[:20]]  # a conf of any size: the message stays one readable line
            more = f" and {len(unknown) - 20} more" if len(unknown) > 20 else ""
            raise AirflowFailException(
                f"plan: the run's conf (dag_run.conf) names {shown}{more}, which DAG {getattr(dag, 'dag_id', None)} "
                f"declares no Param for (it declares {sorted(declared)}): such a key would change nothing, or "
                "reach the job past any form; trigger again with the declared names only"
            )
        given = [k for k in self.param_overrides if params.get(k) is not None]
        undeclared = [k for k in given if k not in declared]
        if undeclared:
            raise AirflowFailException(
                f"plan: param_overrides {undeclared} have a value in the run's params, but DAG "
                f"{getattr(dag, 'dag_id', None)} declares no such Param: a value there comes from the run's conf "
                "(dag_run.conf), unchecked by any form; declare each as a Param with its JSON schema in the DAG's "
                "params, or drop it from param_overrides"
            )

    def check_run_dates(self, spec: JobSpec, params: Mapping[str, Any], context: Any) -> None:
        """Fail without retry when a run Airflow did not schedule writes where its own dates say (``io.output_uri``'s
        or ``io.output_table``'s template reads ``ds``, the logical date, data interval, partition or ``dag_run``; an
        Iceberg output's ``date_column`` takes the logical date) and a date of the run has not ended
        (utils/deployment.py ``check_run_dates``). An output the trigger named itself (a param) reads no date."""
        layers = self._layers(params, provenance.run_dates_read, set())  # an output a param set reads no date
        reads: set[str] = set()
        for path in ("io.output_uri", "io.output_table"):  # a folder, or a table (one per day), named by a date
            reads |= next((r for r in (layer(path) for layer in layers) if r is not None), set())
        if spec.io.output_table is not None and spec.io.output_table.date_column is not None:
            reads = reads | {DATE_COLUMN_READ + spec.io.output_table.date_column}
        check_run_dates(reads, context.get("dag_run"), "plan")

    def check_output_under(self, spec: JobSpec) -> None:
        """Fail without retry when ``io.output_uri`` does not lie inside ``output_under`` (the DAG file's folder for
        this DAG's runs), or when that folder itself was chosen by the trigger: a run whose form or conf may set the
        output could otherwise write where another job writes (a nightly's next date, its cache)."""
        if self._raw_output_under is None:
            return
        chose = sorted(
            s
            for s in provenance.template_sources(self._raw_output_under, provenance.template_env(self))
            if s != provenance.VARIABLES
        )
        if chose:
            raise AirflowFailException(
                f"plan: output_under came from {', '.join(chose)}; it bounds where a trigger may write, so only the "
                "DAG file (or a Variable) may set it"
            )
        try:
            under = canonical_uri(str(self.output_under), "output_under").rstrip("/")
            out = canonical_uri(spec.io.output_uri, "io.output_uri")
            named = canonical_uri(str(self.output_under), "output_under", resolve=False)
        except SpecError as e:
            raise AirflowFailException(f"plan: {e}") from None
        if named.startswith("/") and os.path.islink(named):
            # the folder itself a link (planted by whoever may write its parent): both sides would resolve into the
            # link's target, a nightly's root included, and every output "inside" it would be inside that
            raise AirflowFailException(
                f"plan: output_under={self.output_under} is a symbolic link (to {under}): it bounds nothing; set "
                "output_under to the folder itself"
            )
        if out == under or not is_under(out, under):
            raise AirflowFailException(
                f"plan: io.output_uri={spec.io.output_uri} is not a folder inside {self.output_under}, where this "
                "DAG's runs write (output_under, set in the DAG file): a run may not write where another job does. "
                "Leave the output empty for the default, or pick a folder inside it"
            )

    def build_spec(self, params: dict[str, Any]) -> JobSpec:
        """The validated spec from the rendered fields and the run's params."""
        try:
            layered = overrides_document(self.overrides)
            validate_params(params, self.param_overrides)  # again: runs made via the API skip no rule
            # a null in the overrides sets the field to null ({"cache.uri": null} turns the cache
            # off); an empty form field (a None param) keeps what the overrides or the spec say
            given = {k: params[k] for k in self.param_overrides if params.get(k) is not None}
            nulls = {k for k, v in layered.items() if v is None} - set(given)
            layered.update(given)
            return JobSpec.from_params(layered, base=spec_document(self.spec), keep_null=nulls)
        except SpecError as e:
            raise AirflowFailException(f"plan: {e}") from None

    def _layers(
        self, params: Mapping[str, Any], read: Callable[[Any, Any], set[str]], from_params: set[str]
    ) -> list[Callable[[str], set[str] | None]]:
        """What each layer of the spec says of a dotted path, the latest (winning) first: a ``param_overrides`` param
        with a value (``from_params``), the DAG file's overrides, its spec; each ``read`` (``provenance``'s
        ``template_sources`` or ``run_dates_read``) of the DAG file's value, or None when that layer does not set it."""
        env = provenance.template_env(self)
        rendered_spec = spec_document(self.spec) if isinstance(self._raw_spec, str) else {}
        rendered_over = overrides_document(self.overrides)
        given = [PARAM_ALIASES.get(k, k) for k in self.param_overrides if params.get(k) is not None]
        return [
            lambda p: set(from_params) if any(t and provenance.touches(t, p) for t in given) else None,
            lambda p: provenance.overrides_layer_sources(
                self._raw_overrides, rendered_over, p, env, PARAM_ALIASES, read
            ),
            lambda p: provenance.spec_layer_sources(self._raw_spec, rendered_spec, p, env, read),
        ]

    def check_provenance(self, spec: JobSpec, params: dict[str, Any]) -> None:
        """Deployment-owned settings came from the DAG file (or, with the opt-in, a Variable); else fail."""
        layers = self._layers(params, provenance.template_sources, {provenance.PARAMS})
        owned = owned_paths_set(spec, _default_doc())
        problems = provenance.violations(owned, layers, variables_may_set_deployment_settings())
        if problems:
            raise AirflowFailException("plan: " + "; ".join(problems))

    def check_gates(self, spec: JobSpec, params: dict[str, Any]) -> None:
        """What decides publication is as strict as the DAG file says, or stricter (``core/qa_gates.py``); else fail."""
        env = provenance.template_env(self)
        raw_over = self._raw_overrides
        rendered_spec = spec_document(self.spec)
        spec_layer = functools.partial(self._spec_layer, env, rendered_spec)
        layered = overrides_document(self.overrides)
        given = {k: params[k] for k in self.param_overrides if params.get(k) is not None}
        entries = []
        for key in [*layered, *(k for k in given if k not in layered)]:  # JobSpec.from_params's order
            target = PARAM_ALIASES.get(key, key)
            if target is None:
                continue
            if key in given:
                entries.append(provenance.Entry(target, given[key], frozenset({provenance.PARAMS})))
                continue
            if isinstance(raw_over, Mapping) and key not in raw_over:  # not a key the DAG file wrote: fail closed
                sources = frozenset({"the trigger (an override key the DAG file does not write)"})
            else:
                raw = raw_over.get(key) if isinstance(raw_over, Mapping) else raw_over
                sources = frozenset(provenance.template_sources(raw, env))
            entries.append(provenance.Entry(target, layered[key], sources))
        loose = variables_may_loosen_qa()
        problems = provenance.gate_violations(spec_layer, entries, spec.model_dump(mode="json"), loose)
        if self.review_ask is not None:
            why = provenance.review_ask_violation(
                self._raw_review_ask, parse_flag(self.review_ask, "human_review"), env, loose
            )
            problems += [why] if why else []
        if problems:
            raise AirflowFailException("plan: " + "; ".join(problems))

    def _spec_layer(self, env: Any, rendered: dict[str, Any], path: str) -> tuple[frozenset[str], Any] | None:
        sources = provenance.spec_layer_sources(self._raw_spec, rendered, path, env)
        if sources is None:
            return None
        return frozenset(sources), qa_gates.value_at(rendered, path)

    def execute(self, context: Any) -> list[dict[str, Any]]:
        runner = check_runner(self.runner)
        check_runner_choice(self._raw_runner, runner, "plan", provenance.template_env(self))
        params = dict(context.get("params") or {})
        self.check_declared(params, context)
        spec = self.build_spec(params)
        self.check_provenance(spec, params)  # before any location or model is looked at
        self.check_gates(spec, params)
        prefixes = check_spec_allowed(spec, "plan")
        self.check_output_under(spec)
        self.check_run_dates(spec, params, context)
        # a triggered run may not claim a prefix a scheduled run writes later ([vllm_batch] scheduled_output_prefixes)
        check_run_may_write(spec.io.output_uri, getattr(context.get("dag_run"), "run_type", None), "plan")
        if runner == "local":
            check_local_model(spec)
        self.log.info(
            "job %s: task=%s model=%s input=%s output=%s spec_hash=%s",
            spec.name,
            spec.task,
            spec.model.name,
            spec.io.input_name,
            spec.io.output_uri,
            spec.content_hash()[:12],
        )
        if self.dry_run or self._dry_run_param(context):
            self._dry_run(spec, context)
        keyring = signing_keyring()
        identity = self.engine_identity(spec, runner) if spec.cache.uri else None
        tables = None
        if spec.io.input_table is not None or spec.io.output_table is not None:
            tables = iceberg_tables(prefixes)
            if spec.io.output_table is not None:  # refused now rather than after the GPUs ran
                with data_plane_errors("plan"):
                    tables.check(spec.io.output_table.identifier, "io.output_table.identifier")
        with data_plane_errors("plan"):
            plan = plan_job(
                spec,
                filesystems=self.filesystems(),
                max_shards=max_map_length(),
                engine_identity=identity,
                keyring=keyring,
                warm_starts=warm_starts(spec, runner),
                tables=tables,
                allowed_prefixes=prefixes,
                # read only for a new plan: a retried task keeps the pin its plan wrote, whatever the events say now
                last_published=(
                    functools.partial(self.last_published, context, spec) if spec.changes.previous_published else None
                ),
            )
        if plan.changes_from is not None:  # the plan's pin, which a plan already written keeps (a retried task)
            self.log.info(
                "%s: the change set compares with %s",
                plan.changes_from.describe(),
                plan.changes_from.previous_uri or "nothing (no earlier run)",
            )
        self.log.info(
            "planned %d rows (%d invalid lines) into %d shard(s), ~%d prompt tokens; plan at %s/_plan.json",
            plan.total_rows,
            plan.invalid_lines,
            len(plan.shards),
            plan.est_tokens,
            spec.io.output_uri.rstrip("/"),
        )
        if plan.cache is not None:
            self.log.info(
                "result cache %s: %d of %d rows answered from %d committed entries; shards hold the %d misses",
                plan.cache.uri,
                plan.cache.hits,
                plan.cache.rows,
                len(plan.cache.commits_read),
                plan.cache.misses,
            )
        if plan.dedupe is not None:
            self.log.info(
                "each distinct prompt once: %d of %d rows repeat an earlier row's prompt and take its answer at "
                "merge; shards infer %d",
                plan.dedupe.followers,
                plan.dedupe.rows,
                plan.dedupe.leaders,
            )
        context["ti"].xcom_push(key=SPEC_XCOM_KEY, value=spec.model_dump(mode="json"))
        # the sealed plan merge runs under (a zero-shard run has no shard value to name it)
        context["ti"].xcom_push(key=PLAN_XCOM_KEY, value=plan.ref().dump())
        if plan.table is not None:
            self.log.info(
                "input: table %s snapshot %d (%s, %d data file(s))",
                plan.table.identifier,
                plan.table.snapshot_id,
                plan.table.read,
                plan.table.data_files,
            )
        self._lineage = plan_lineage(spec, rows=plan.total_rows, files=len(plan.files), table=plan.table)
        if plan.golden is not None:
            self.log.info(
                "golden rows that ride along: %d from %s in %d shard(s) of their own (kept apart, under golden/)",
                plan.golden.rows,
                plan.golden.uri,
                len(plan.golden.shards),
            )
        return [s.dump() for s in with_display_names(plan.mapped_shards())]

    def last_published(self, context: Any, spec: JobSpec) -> LastPublished:
        """``changes.previous_published``: the event of the job's Asset that its publish task emitted for the run of
        the latest logical date before this run's (``utils/published.py``), read from Airflow's metadata database
        (the Asset is this task's inlet: ``vllm_batch_job`` declares it)."""
        asset = self.published_asset
        if asset is None or self.publish_task_id is None or asset not in (self.inlets or []):
            raise AirflowFailException(
                "plan: changes.previous_published compares with the run this job's Asset last published, whose events "
                "the plan task reads as its inlet: vllm_batch_job declares it when the DAG file gives it the spec as a "
                "dict with changes.previous_published true. Set there, not in YAML/JSON text or a template, the "
                "overrides, a Variable or a trigger (read only at run time)"
            )
        events = newest_events(context["inlet_events"][asset])  # page by page: others' events hide nothing
        last = last_published(
            events,
            asset.uri,
            context["dag"].dag_id,
            self.publish_task_id,
            spec.io.output_uri,
            context.get("logical_date"),
        )
        self.log.info(
            "changes.previous_published: of the events of %s from %s, the one to compare with names %s (event %s, "
            "%s, logical date %s)",
            asset.uri,
            self.publish_task_id,
            last.output_uri or "no run (nothing published before)",
            last.event_id,
            last.timestamp,
            last.logical_date,
        )
        return last

    def engine_identity(self, spec: JobSpec, runner: str) -> str:
        """The engine the shard tasks will start, resolved from the same settings they use (the cache key's)."""
        return shard_engine_identity(spec, runner, self.kubernetes, self.shard_env)

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """OpenLineage: the input location (rows, files) in, ``_plan.json`` out (recorded by ``execute``)."""
        from airflow_provider_vllm.utils.openlineage_facets import operator_lineage

        return operator_lineage(getattr(self, "_lineage", None))

    def _dry_run_param(self, context: Any) -> bool:
        """The run param ``dry_run`` is true and the DAG declares it. Airflow merges any ``conf`` key into the
        params; ``check_declared`` fails a run whose conf names an undeclared one, and a ``dry_run`` that still
        reaches the params of a DAG without the param is ignored (with a warning): a nightly run is never skipped
        by a stray key while showing success."""
        if (context.get("params") or {}).get("dry_run") is not True:
            return False
        dag = context.get("dag") or (self.dag if self.has_dag() else None)
        if dag is not None and "dry_run" in (dag.params or {}):
            return True
        self.log.warning(
            "ignoring dry_run=true from the run's conf: DAG %s declares no dry_run param; planning as usual",
            getattr(dag, "dag_id", None),
        )
        return False

    def _dry_run(self, spec: JobSpec, context: Any) -> None:
        from airflow.sdk.exceptions import AirflowSkipException

        from airflow_provider_vllm.steps.plan.dry_run import dry_run_report, format_report

        with data_plane_errors("plan"):
            report = dry_run_report(
                spec,
                filesystems=self.filesystems(),
                engine_identity=self.engine_identity(spec, check_runner(self.runner)),
                # only what this deployment's merge sealed counts: cache hits, throughput history
                keyring=signing_keyring() if spec.cache.uri or spec.sharding.history_uri else None,
                warm_starts=warm_starts(spec, check_runner(self.runner)),
            )
        for line in format_report(report).splitlines():
            self.log.info("%s", line)
        context["ti"].xcom_push(key="dry_run", value=report.dump())
        raise AirflowSkipException("dry run: the report is in the log and the 'dry_run' XCom; nothing was launched")
