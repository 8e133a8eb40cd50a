"""QA of a run's merged output (pure step logic; no Airflow). Modules, low to high:

* ``report``: ``QAReport`` (the outcome, and its JSON form) and ``QAFailed``.
* ``metrics``: input conformance, rates, label distribution and drift, token / latency
  statistics and histograms, throughput, duplicate counts (the metric definitions).
* ``metrics_stream``: the same metrics from DuckDB aggregates over the files (outputs too large to load).
* ``accuracy``: classification quality from (known, predicted) counts: accuracy with its Wilson
  interval, per-class figures, macro-F1, the confusion cells, the change against an earlier run.
* ``yardstick``: what each source of known labels scored against (the pinned golden files, the scored ids and
  labels, each id's result), and whether two reports' accuracies compare like with like (or paired on shared ids).
* ``labelled``: the view of every scored row (known label, answer, confidence) and, from it in
  DuckDB, the quality metrics, the reliability table and the confident halves.
* ``confidence``: the engine's confidence over all answers (low-confidence rate, least confident
  rows) and the consistency of identical prompts, in DuckDB.
* ``checks``: each metric against its warn / fail thresholds, and the overall verdict.
* ``sample``: the deterministic, stratified sample of rows for review.
* ``html_quality``: the page's quality sections (accuracy, confusion matrix, reliability diagram,
  consistency, least confident rows).
* ``html``: renders a report dict and sample rows as one self-contained page.
* ``store``: writes report.json / report.html / sample.parquet and, last, the sealed _QA.json; reads it back; writes
  and reads the review's sealed decision (_REVIEW.json); loads a previous report only when its run's sealed _QA.json
  vouches for it.
* ``golden_set``: the golden set (``qa.reference.golden_uri``) pinned by the plan (files, sizes, sha256) and
  read by QA from copies checked against that pin.
* ``reference``: the known labels (``qa.reference``) as DuckDB relations.
* ``evaluate``: ``evaluate(results, errors, ...)`` measures a result set into a ``QAReport``;
  ``evaluate_stream`` does the same over DuckDB views of the files, in bounded memory.
* ``stage``: the QA step, ``qa_run(spec)``: reads the merged output (streamed above
  ``STREAM_ABOVE_ROWS`` rows), evaluates, writes the report.
"""
