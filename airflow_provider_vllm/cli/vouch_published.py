"""Let the cache entries of runs published before the upgrade serve again (run once, after the upgrade).

    python -m airflow_provider_vllm.cli.vouch_published RUN_URI [RUN_URI ...] [--dry-run]

Since the result cache serves only entries whose run publish vouched for (docs/adr/0012-cache-serves-published-runs.md),
entries filed before the upgrade serve nothing, and each key config's first run after it would infer every row
again. For each published run given (its output prefix: the ``output_uri`` of the run's Asset event), this writes
the vouch record publish writes now, once the run's sealed ``_SUCCESS.json``, ``_MERGED.json`` and ``_plan.json`` and
the entry's sealed commit in the cache folder check out with this deployment's key (``[vllm_batch] signing_key``, as
the provider's tasks read it). The deployment's location rules apply as publish applies them: a run outside
``[vllm_batch] allowed_uri_prefixes`` (unless ``allow_any_location``) or whose cache is outside
``cache_uri_prefixes``, or a URI with credentials, is refused; with neither setting it does not start. Object
stores through the deployment's Connections (``[vllm_batch] aws_conn_id`` / ``gcp_conn_id``, or the options below).
Run it on an Airflow machine before the first run after the upgrade: a merge removes entries no publish vouched for
once 30 days old.

One line per run on stdout (logs go to stderr): vouched (would vouch, with ``--dry-run``, which writes nothing),
already vouched, skipped (not published, cache off, no entry, its entry gone, an entry an earlier merge of the run
filed) or refused (a check failed). Exit status 0; 1 when a run was refused; 2 (one line on stderr) when no valid
key or no allowed location is set.
"""

from __future__ import annotations

import argparse
import os
import sys

from airflow_provider_vllm.core.errors import EXIT_TERMINAL, VllmBatchError

PROG = "python -m airflow_provider_vllm.cli.vouch_published"
EXIT_REFUSED = 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("run_uri", nargs="+", help="a published run's output prefix (io.output_uri)")
    p.add_argument("--dry-run", action="store_true", help="check and report; write nothing")
    p.add_argument("--aws-conn-id", default=None, help="Connection for s3:// (default: [vllm_batch] aws_conn_id)")
    p.add_argument("--gcp-conn-id", default=None, help="Connection for gs:// (default: [vllm_batch] gcp_conn_id)")
    args = p.parse_args(argv)

    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_vllm.core.allow_list import redact_userinfo
    from airflow_provider_vllm.hooks.filesystems import task_filesystems
    from airflow_provider_vllm.provider import CACHE_URI_PREFIXES, setting
    from airflow_provider_vllm.steps.cache.vouch_runs import Locations, vouch_run
    from airflow_provider_vllm.utils.deployment import (
        NO_ALLOW_LIST,
        allow_any_location,
        allowed_prefixes,
        cache_prefixes,
        signing_keyring,
    )

    try:
        keyring = signing_keyring()
        # where publish may write, as it checks a spec (check_spec_allowed): fail closed without an allow-list
        locations = Locations(allowed_prefixes(), cache_prefixes(), setting(CACHE_URI_PREFIXES))
        if not locations.allowed and not allow_any_location():
            raise AirflowFailException(NO_ALLOW_LIST)
    except AirflowFailException as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return EXIT_TERMINAL
    filesystems = task_filesystems(args.aws_conn_id, args.gcp_conn_id)
    refused = 0
    # Airflow and the steps log to stdout; stdout carries only the report lines, so everything else goes to stderr
    sys.stdout.flush()
    report = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    try:
        for uri in args.run_uri:
            try:
                result = vouch_run(uri, keyring, filesystems, dry_run=args.dry_run, locations=locations)
            except (VllmBatchError, OSError) as e:  # a store that did not answer: nothing vouched for this run
                print(redact_userinfo(f"{uri}: error: {str(e)[:500]}"), file=report, flush=True)
                refused += 1
                continue
            refused += result.outcome == "refused"
            print(result.line(), file=report, flush=True)
    finally:
        sys.stdout.flush()
        os.dup2(report.fileno(), 1)
        report.close()
    return EXIT_REFUSED if refused else 0


if __name__ == "__main__":
    sys.exit(main())
