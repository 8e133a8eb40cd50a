"""Fixtures for the browser tests: one real ``airflow standalone`` and headless Chromium.

Package-scoped: the standalone and Chromium stop once the last browser test is done. With two test processes the one
that ran them goes on with other tests, which must not share it with an idle Airflow, nor with Playwright's sync
API, whose event loop stays marked as running in the main thread (``asyncio.run`` in the amazon provider's
``get_fs`` failed there).

Chromium is Debian's (``make chromium`` installs it); a machine without it fails here with
that instruction instead of skipping. Screenshots go to pytest's tmp folder and, with
``VLLM_BATCH_UI_SCREENSHOTS=docs``, also to ``docs/img/`` (how the committed ones are made).
"""

from __future__ import annotations

import json
import os
import shutil
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from tests.conftest import TEST_SIGNING_KEY
from tests.support.data import write_parquet
from tests.ui.standalone import ROOT, Standalone

CHROMIUM = os.environ.get("VLLM_BATCH_CHROMIUM", "/usr/bin/chromium")
QA_OVERRIDES = {
    # Room for the longest label in any tokenisation the structured-output grammar allows.
    "sampling.max_tokens": 32,
    # 'warn' from 1% errors, 'fail' only from 50%: a run with one empty ticket in 20 needs review.
    "qa.warn_error_rate": 0.01,
    "qa.fail_error_rate": 0.5,
    # Random labels drift from day to day: not what these tests look at (nor is the churn the
    # nightly template warns on).
    "qa.warn_label_drift": 1.0,
    "qa.fail_label_drift": 1.0,
    "qa.warn_churn_rate": 1.0,
    "qa.fail_churn_rate": 1.0,
    # The nightly's golden rows ride along (vllm_batch_golden_uri): SmolLM2-135M's accuracy (~40%) is shown
    # on the report (the screenshots in docs/operations.md), not gated here; tests/vllm gate it.
    "qa.warn_accuracy_below": 0.0,
    "qa.fail_accuracy_below": 0.0,
    "qa.warn_accuracy_drop": 1.0,
    "qa.fail_accuracy_drop": 1.0,
}


class Shots:
    """Saves named screenshots; the paths are test artifacts."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.docs = ROOT / "docs" / "img" if os.environ.get("VLLM_BATCH_UI_SCREENSHOTS") == "docs" else None
        self.saved: list[Path] = []

    def __call__(self, page, name: str, **kw) -> Path:
        path = self.folder / f"{name}.png"
        page.screenshot(path=str(path), **kw)
        if self.docs is not None:
            self.docs.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, self.docs / path.name)
        self.saved.append(path)
        return path


def _plugin_entry_point_installed() -> bool:
    return any(e.name == "vllm_batch" for e in entry_points(group="airflow.plugins"))


@pytest.fixture(scope="package")
def shots(tmp_path_factory) -> Shots:
    return Shots(tmp_path_factory.mktemp("ui-screenshots"))


@pytest.fixture(scope="package")
def ui_data(tmp_path_factory) -> Path:
    """Inputs: ad-hoc tickets (form run), two nightly days (backfill, the same tickets), two review runs."""
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    from sample_tickets import write_tickets

    data = tmp_path_factory.mktemp("vllm_batch_data")
    write_tickets(data / "adhoc", 40, seed=3, truth_dir=data / "truth" / "adhoc")
    # The same 20 tickets on both nights: the backfill runs them one after the other, and the second night's are all
    # answered from the result cache the first filled (one SmolLM2 worker fewer; its golden rows still run).
    for day in ("2026-11-20", "2026-11-21"):
        write_tickets(data / "tickets" / f"dt={day}", 20, seed=20, truth_dir=data / "truth" / day)
    # One empty ticket in 20: an EMPTY_INPUT error row, error rate 5% -> QA 'warn'.
    texts = [f"My invoice {i} was charged twice, please refund" for i in range(19)] + [""]
    write_parquet(data / "review" / "tickets.parquet", [f"r{i}" for i in range(20)], texts)
    # The nightly's golden rows that ride along: labelled tickets of their own.
    import pyarrow.parquet as pq

    src = write_tickets(data / "golden_src", 60, seed=77)
    golden = pq.read_table(src["tickets"]).append_column("label", pq.read_table(src["labels"]).column("label"))
    pq.write_table(golden, data / "golden.parquet")
    return data


@pytest.fixture(scope="package")
def airflow_ui(tmp_path_factory, ui_data):
    from airflow_provider_vllm.testing.local_models import default_cache_dir, prepare_smollm2

    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: run `make chromium` (apt-get install -y chromium) first")
    # the demo's model: a real one, so the report's quality sections (screenshots) show real figures
    # Through a link in the test's own data folder: the screenshots in docs/ show the model's path, which names no
    # folder of the machine that took them.
    model = ui_data / "models" / "smollm2-135m-instruct"
    model.parent.mkdir(exist_ok=True)
    model.symlink_to(prepare_smollm2(default_cache_dir() / "smollm2-135m-instruct"), target_is_directory=True)
    env = {
        "AIRFLOW_VAR_VLLM_BATCH_DATA_ROOT": str(ui_data),
        "AIRFLOW_VAR_VLLM_BATCH_MODEL": str(model),
        "AIRFLOW_VAR_VLLM_BATCH_SPEC_OVERRIDES": json.dumps(QA_OVERRIDES),
        # QA_OVERRIDES loosens the nightly's gates (churn, accuracy): this deployment lets Variables do that
        "AIRFLOW__VLLM_BATCH__QA_SETTINGS_FROM_VARIABLES": "True",
        "AIRFLOW_VAR_VLLM_BATCH_GOLDEN_URI": str(ui_data / "golden.parquet"),
        "AIRFLOW__VLLM_BATCH__REPORT_ROOTS": str(ui_data),
        # the deployment's allow-list (docs/security.md): without it every plan fails closed and the
        # report page answers 403
        "AIRFLOW__VLLM_BATCH__ALLOWED_URI_PREFIXES": json.dumps([str(ui_data), str(Path(model).resolve().parent)]),
        "AIRFLOW__VLLM_BATCH__SIGNING_KEY": TEST_SIGNING_KEY,  # docs/adr/0007
        "AIRFLOW__VLLM_BATCH__CACHE_URI_PREFIXES": json.dumps([str(ui_data)]),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    if not _plugin_entry_point_installed():
        # An editable install made before the entry point existed: load the provider's declared plugin.
        env["AIRFLOW__CORE__LAZY_DISCOVER_PROVIDERS"] = "False"
    server = Standalone(home=tmp_path_factory.mktemp("airflow_home"), env_extra=env)
    try:
        server.start()
        server.wait_dags(["vllm_batch_rerun", "vllm_nightly_reclassification"])
        yield server
    finally:
        killed = server.stop()
        print(f"airflow standalone stopped; {len(killed)} leftover process(es) killed by marker")


@pytest.fixture(scope="package")
def browser(airflow_ui):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        try:
            yield b
        finally:
            b.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On a failed UI test, a screenshot of where the browser was (next to the others)."""
    outcome = yield
    rep = outcome.get_result()
    pg = item.funcargs.get("page") if hasattr(item, "funcargs") else None
    if rep.when == "call" and rep.failed and pg is not None:
        shots = item.funcargs.get("shots")
        try:
            for p in pg.context.pages:
                p.screenshot(path=str(shots.folder / f"FAILED-{item.name}-{pg.context.pages.index(p)}.png"))
        except Exception as e:  # the report matters more than the picture
            print(f"no failure screenshot: {e}")


@pytest.fixture(scope="package")
def page(browser, airflow_ui):
    """A logged-in page (the simple auth manager's admin, through its login form)."""
    ctx = browser.new_context(viewport={"width": 1400, "height": 900})
    ctx.set_default_timeout(60_000)  # 2 shared cores, vLLM engines running
    pg = ctx.new_page()
    pg.goto(airflow_ui.url + "/auth/login")
    pg.get_by_label("Username").fill("admin")
    pg.get_by_label("Password").fill(airflow_ui.password)
    pg.get_by_role("button", name="Sign in").click()
    pg.wait_for_url(lambda u: "/auth/login" not in u)
    yield pg
    ctx.close()
