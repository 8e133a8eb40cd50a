"""Who set a value of the rendered job spec: the DAG file, a Variable, or whoever triggered the run.

The spec is rendered from templates at run time, so its final values do not say where they
came from. This module reads the *unrendered* values the DAG file handed to the operator and
asks Jinja's own parser which context names each template reads (``jinja2.meta``, static
analysis: nothing is rendered here). A literal is the DAG file's; a template that reads only
dates, macros the DAG defines, ``conn`` or ``conf`` is too; one that reads ``var`` came from
a Variable; ``params``, ``dag_run`` (its ``conf``), ``ti``/``task_instance`` (XCom),
``run_id``, asset events or anything unknown came from the trigger, and an include that
cannot be read, or whose name is itself computed, counts as the trigger's too (fail closed).

``violations`` applies the trust model (docs/security.md) to the layers
the plan operator stacks (spec <- overrides <- params): deployment-owned settings
(``spec_guard.DEPLOYMENT_OWNED`` plus whatever ``code_loading_options`` finds) may come
from the DAG file (or the deployment config); from Variables only when
``[vllm_batch] deployment_settings_from_variables = True``; from the trigger never.

``gate_violations`` applies it to the settings that decide whether a run is published (``core/qa_gates.py``:
QA thresholds, the baselines and known labels QA compares with): a Variable or the trigger may only make them
stricter than the DAG file's own value (the *floor*: what the layers the DAG file chose give, else the spec
default); looser from a Variable only when ``[vllm_batch] qa_settings_from_variables = True``, from the trigger
never. ``review_ask_violation`` does the same for the review's ``ask`` (whether a QA 'warn' waits for a person).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import meta  # static analysis of templates only (see the module docstring)

from airflow_provider_vllm.core import qa_gates
from airflow_provider_vllm.core.spec_guard import JINJA
from airflow_provider_vllm.provider import QA_SETTINGS_FROM_VARIABLES

PARAMS = "trigger params"
VARIABLES = "Variables"
_SOURCE_OF = {"params": PARAMS, "var": VARIABLES}
# The names of the run's own dates in the template context (a date of the run, whichever run it is)
_RUN_DATE_NAMES = (
    "ds",
    "ds_nodash",
    "ts",
    "ts_nodash",
    "ts_nodash_with_tz",
    "logical_date",
    "data_interval_start",
    "data_interval_end",
)
# Context names whose values neither a trigger nor a Variable chooses (the logical date is a
# date; ``conf`` is the Airflow configuration; ``conn`` the deployment's Connections).
_TRUSTED = frozenset(
    {
        *_RUN_DATE_NAMES,
        "prev_data_interval_start_success",
        "prev_data_interval_end_success",
        "prev_start_date_success",
        "prev_end_date_success",
        "start_date",
        "macros",
        "dag",
        "task",
        "conn",
        "conf",
        "map_index_template",
        "test_mode",
        "expanded_ti_count",
        "try_number",
        "inlets",
        "outlets",
    }
)
# Context names that carry the run's own dates (or the run, whose dates its attributes give): the scheduler sets
# them for the runs it makes; for a manual run, whoever triggers it (the REST API's logical_date, data interval
# and partition key, airflow dags trigger -l). _TRUSTED counts the dates as the DAG file's: whatever the date, the
# folder is the one the DAG file names for it; which date a manual run may name is utils/deployment.check_run_dates'.
# The task instance carries them too (``ti.get_template_context()``, its run), and ``task_instance_key_str`` the
# logical date (``dag__task__<ds_nodash>``).
RUN_DATES = frozenset(
    {*_RUN_DATE_NAMES, "partition_key", "partition_date", "dag_run", "ti", "task_instance", "task_instance_key_str"}
)


def template_env(operator: Any) -> Any:
    """The Jinja environment ``operator``'s templates render in (its DAG's: user macros, filters); None for a bare
    operator without a DAG (``template_sources`` then parses without the DAG's globals)."""
    try:
        return operator.get_template_env()
    except Exception:  # noqa: BLE001 - a bare operator without a DAG
        return None


def _reads(value: Any, env: Any, _depth: int = 0) -> set[str]:
    """The context names the templates inside ``value`` read (includes followed), and, for a template that cannot
    be analysed, why, as a source of the trigger's (``the trigger (...)``, fail closed)."""
    if isinstance(value, Mapping):
        return set().union(set(), *(_reads(v, env, _depth) for v in value.values()))
    if isinstance(value, (list, tuple, set)):
        return set().union(set(), *(_reads(v, env, _depth) for v in value))
    if not isinstance(value, str) or not JINJA.search(value):
        return set()
    if env is None or _depth > 8:
        return {"the trigger (a template that could not be analysed)"}
    try:
        tree = env.parse(value)
    except Exception:  # noqa: BLE001 - a template Jinja cannot parse would not render either
        return {"the trigger (a template that could not be parsed)"}
    names = set(meta.find_undeclared_variables(tree))
    for ref in meta.find_referenced_templates(tree):
        if ref is None:
            names.add("the trigger (an include whose name is computed)")
            continue
        try:
            text = env.loader.get_source(env, ref)[0]
        except Exception:  # noqa: BLE001 - no loader, missing file
            names.add(f"the trigger (an include that could not be read: {ref})")
            continue
        names |= _reads(text, env, _depth + 1)
    return names


def _unanalysed(name: str) -> bool:
    return name.startswith("the trigger (")


def template_sources(value: Any, env: Any) -> set[str]:
    """Who chose the strings inside ``value`` (a DAG-file value: a string, list or dict of them).

    Empty set: the DAG file (a literal, or a template over trusted names only).
    """
    trusted = _TRUSTED | set(getattr(env, "globals", {}) or {})
    sources = set()
    for name in _reads(value, env):
        if _unanalysed(name):
            sources.add(name)
        elif name in _SOURCE_OF:
            sources.add(_SOURCE_OF[name])
        elif name not in trusted:
            sources.add(f"the trigger ({name})")
    return sources


def run_dates_read(value: Any, env: Any) -> set[str]:
    """The names of the run's dates (``RUN_DATES``) that the templates inside ``value`` read; a template that cannot
    be analysed reads them too (fail closed). Empty set: none."""
    return {n for n in _reads(value, env) if n in RUN_DATES or _unanalysed(n)}


def touches(key: str, path: str) -> bool:
    return key == path or path.startswith(key + ".") or key.startswith(path + ".")


def _at(node: Any, parts: list[str]) -> tuple[bool, Any]:
    """(found, value) at ``parts`` of a raw DAG-file value; a string met on the way covers the rest."""
    for part in parts:
        if isinstance(node, str):
            return True, node
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def spec_layer_sources(
    raw_spec: Any, rendered_doc: Mapping[str, Any], path: str, env: Any, read: Any = template_sources
) -> set[str] | None:
    """Sources of ``path`` in the spec layer; None when that layer does not set it. ``read``: what to ask of the
    DAG file's value (``template_sources``, or ``run_dates_read``)."""
    if isinstance(raw_spec, str):  # one template for the whole spec: its sources cover every value
        found, _ = _at(rendered_doc, path.split("."))
        return read(raw_spec, env) if found else None
    found, node = _at(raw_spec, path.split("."))
    return read(node, env) if found else None


def overrides_layer_sources(
    raw_overrides: Any,
    rendered: Mapping[str, Any],
    path: str,
    env: Any,
    aliases: Mapping[str, str | None],
    read: Any = template_sources,
) -> set[str] | None:
    """Sources of ``path`` in the overrides layer (flat dotted keys / aliases); None when it is not set there.
    ``read`` as for ``spec_layer_sources``."""
    hit = None
    for key in rendered:
        target = aliases.get(key, key)
        if target is None or not touches(target, path):
            continue
        got = read(raw_overrides.get(key) if isinstance(raw_overrides, Mapping) else raw_overrides, env)
        hit = (hit or set()) | got
    return hit


def violations(owned: Iterable[str], layers: list[Any], variables_allowed: bool) -> list[str]:
    """Messages for deployment-owned ``owned`` paths set by a source that may not set them.

    ``layers``: functions ``path -> set | None``, latest (winning) layer first.
    """
    problems = []
    for path in owned:
        sources = None
        for layer in layers:
            sources = layer(path)
            if sources is not None:
                break
        if not sources:
            continue  # the DAG file (or nothing)
        bad = sorted(s for s in sources if s != VARIABLES)
        if bad:
            problems.append(
                f"{path} is deployment-owned and came from {', '.join(bad)}; set it in the DAG file or "
                "the deployment config ([vllm_batch]), never from a trigger"
            )
        elif not variables_allowed:
            problems.append(
                f"{path} is deployment-owned and came from a Variable; Variables may set it only with "
                "[vllm_batch] deployment_settings_from_variables = True "
                "(AIRFLOW__VLLM_BATCH__DEPLOYMENT_SETTINGS_FROM_VARIABLES)"
            )
    return problems


# ---- the settings that decide publication: only stricter from a Variable or the trigger ----------------------
@dataclass(frozen=True)
class Entry:
    """One key of the flat layering (the overrides, then the params), in the order ``JobSpec.from_params`` applies
    them: it replaces the node at ``target`` (a dotted path) with ``value``; ``sources`` as ``template_sources``."""

    target: str
    value: Any
    sources: frozenset[str]


def _flat_value(target: str, value: Any, path: str, default: Any) -> Any:
    """What setting ``target`` to ``value`` makes ``path``: a section replaced whole leaves a key it lacks at
    ``default`` (the spec default); ``UNREADABLE`` when a step is not a mapping (the spec will not validate)."""
    if target == path:
        return value
    if not path.startswith(target + "."):
        return qa_gates.UNREADABLE  # a key below a leaf: "not a section"
    node = value
    for part in path[len(target) + 1 :].split("."):
        if not isinstance(node, Mapping):
            return qa_gates.UNREADABLE
        if part not in node:
            return default
        node = node[part]
    return node


def _who(sources: Iterable[str]) -> tuple[str, bool]:
    """(who, from the trigger): the sources a message names; a Variable only when nothing else chose."""
    bad = sorted(s for s in sources if s != VARIABLES)
    return (", ".join(bad), True) if bad else (VARIABLES, False)


QA_OPT_IN = (
    f"[vllm_batch] {QA_SETTINGS_FROM_VARIABLES} = True (AIRFLOW__VLLM_BATCH__{QA_SETTINGS_FROM_VARIABLES.upper()})"
)


def _remedy(trigger: bool) -> str:
    if trigger:
        return "a trigger may only make what decides publication stricter than the DAG file does"
    return (
        "a Variable may only make what decides publication stricter than the DAG file does, unless the deployment "
        f"sets {QA_OPT_IN}"
    )


def gate_violations(
    spec_layer: Any,
    entries: Sequence[Entry],
    effective: Mapping[str, Any],
    variables_allowed: bool,
) -> list[str]:
    """Messages for the gate settings (``qa_gates.GATE_SETTINGS``) that a Variable or the trigger set looser than
    the DAG file does.

    ``spec_layer``: ``path -> (sources, rendered value) | None`` of the spec the DAG file gave; ``entries``: the flat
    layering over it, in order (the last touching entry wins, as in ``JobSpec.from_params``); ``effective``: the
    validated spec's dump. The floor of a setting is what the entries and spec chosen by the DAG file alone give
    (``sources`` empty), else the spec default.
    """
    defaults = qa_gates.default_values()
    value = {p: qa_gates.value_at(effective, p) for p in qa_gates.GATE_SETTINGS}
    floor, origin, defaulted = dict(value), {}, set()
    for path in qa_gates.GATE_SETTINGS:
        candidates = []
        if (found := spec_layer(path)) is not None:
            candidates.append(found)
        candidates += [
            (e.sources, _flat_value(e.target, e.value, path, defaults[path]))
            for e in entries
            if touches(e.target, path)
        ]
        if not candidates or not candidates[-1][0]:
            continue  # the DAG file's (or the default): the floor itself
        origin[path] = candidates[-1][0]
        trusted = [v for sources, v in candidates if not sources]
        if trusted:
            floor[path] = qa_gates.coerce(path, trusted[-1])
        else:
            floor[path] = defaults[path]
            defaulted.add(path)
    problems, remedies = [], []
    for path, why in qa_gates.loosenings(origin, floor, value).items():
        who, trigger = _who(origin[path])
        if not trigger and variables_allowed:
            continue
        dag = f"the DAG file's {qa_gates.shown(floor[path])}"
        if path in defaulted:
            dag = f"the spec default {qa_gates.shown(floor[path])} (the DAG file sets none)"
        problems.append(f"{path}={qa_gates.shown(value[path])} from {who} loosens {dag}: {why}")
        if _remedy(trigger) not in remedies:
            remedies.append(_remedy(trigger))
    return problems + remedies


def review_ask_violation(raw_ask: Any, asks: bool, env: Any, variables_allowed: bool) -> str | None:
    """Why the review's ``ask`` (rendered to ``asks``) may not be false, or None.

    Off is looser than on (a QA 'warn' is then published without a person). The DAG file's own value (a literal, or
    a template over trusted names such as the deployment's ``conf``) may say off; a template that reads a Variable
    only with ``[vllm_batch] qa_settings_from_variables``, one the trigger chooses never (its floor is the review's
    default: ask)."""
    if asks:
        return None
    sources = template_sources(raw_ask, env)
    if not sources:
        return None
    who, trigger = _who(sources)
    if not trigger and variables_allowed:
        return None
    return (
        f"the review's ask (vllm_batch_job human_review={qa_gates.shown(raw_ask)}) is false from {who}, which "
        "publishes a QA 'warn' without asking a person, where the DAG file's default asks; "
        f"{_remedy(trigger)} (human_review=False in the DAG file leaves the review task out)"
    )
