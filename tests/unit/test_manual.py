"""The generated pages of the manual (dynamo_graph/manual/): current, and nothing in them
undocumented: every flag, graph key and metric has its text where it is declared."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dynamo_graph.graph.schema import Frontend, Graph, Worker
from dynamo_graph.manual import __main__ as manual
from dynamo_graph.manual import engines, graph_keys, metrics
from dynamo_graph.options import field_docs, options
from dynamo_graph.process.run_config import RUN_SETTINGS

ROOT = Path(__file__).resolve().parents[2]


def test_the_generated_pages_are_current() -> None:
    stale = [str(p.relative_to(ROOT)) for p in manual.stale()]
    assert not stale, f"stale: {stale}; run python -m dynamo_graph.manual"


def test_the_readme_matrix_is_the_registry_s() -> None:
    readme = (ROOT / "README.md").read_text()
    assert engines.block() in readme
    assert "| `vllm`" not in readme.replace(engines.block(), "")  # no second, hand-written table


def test_the_readme_stays_a_landing_page() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_the_readme_links_to_files_that_exist() -> None:
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", readme)
    assert len(targets) > 20
    assert [t for t in targets if not (ROOT / t).exists()] == []


def test_every_flag_has_a_doc() -> None:
    missing = [
        opt.flag
        for cls in RUN_SETTINGS
        for opt in options(cls)
        if opt.flag and not field_docs(opt.owner).get(opt.name)
    ]
    assert not missing


def test_every_graph_key_has_a_doc() -> None:
    rows = graph_keys.rows(Graph) + graph_keys.rows(Frontend) + graph_keys.rows(Worker)
    assert len(rows) > 100
    assert [path for path, _, _, doc in rows if not doc] == []


def test_every_metric_has_a_doc_and_a_unique_name() -> None:
    found = metrics.metrics()
    names = {m.exported for m in found}
    assert {"dynamo_frontend_requests_total", "dyngraph_replicas", "dyngraph_mocker_kv_blocks_used"} <= names
    assert [m.name for m in found if not m.doc] == []
    assert all(m.name.startswith(("dynamo_", "dyngraph_")) for m in found)


def _declared(tmp_path: Path, source: str) -> list[metrics.Metric]:
    module = tmp_path / "frontend" / "probe.py"
    module.parent.mkdir()
    module.write_text(source)
    return metrics.declared(module, tmp_path)


def test_the_metric_reader_follows_helpers_tables_and_conditionals(tmp_path: Path) -> None:
    found = _declared(
        tmp_path,
        """
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
PREFIX = "dyngraph_probe"
SERIES = (("a", "A things", True), ("b", "B things", False))

def collect():
    def gauge(name, doc, labels=["x"]):
        return GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)
    gauge("one", "The first")
    gauge("two", "The second", labels=["y"])
    for name, doc, counter in SERIES:
        (CounterMetricFamily if counter else GaugeMetricFamily)(PREFIX + "_" + name, doc)
""",
    )
    got = {(m.name, m.kind, m.doc, m.labels) for m in found}
    assert got == {
        ("dyngraph_probe_one", "gauge", "The first", ("x",)),
        ("dyngraph_probe_two", "gauge", "The second", ("y",)),
        ("dyngraph_probe_a", "counter", "A things", ()),
        ("dyngraph_probe_b", "gauge", "B things", ()),
    }
    assert {m.process for m in found} == {"frontend"}


def test_a_metric_name_the_reader_cannot_resolve_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(metrics.Unresolved):
        _declared(
            tmp_path,
            "from prometheus_client.core import GaugeMetricFamily\n"
            "def collect(name):\n    return GaugeMetricFamily(name.upper(), 'x')\n",
        )


def test_the_metrics_page_names_where_each_series_is_declared() -> None:
    page = metrics.page()
    for metric in metrics.metrics():
        assert f"| `{metric.exported}` |" in page
        assert (ROOT / metric.module).exists()
        assert (
            metric.name in (ROOT / metric.module).read_text()
            or "PREFIX" in (ROOT / metric.module).read_text()
        )


def test_check_mode_reports_a_stale_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    page = tmp_path / "metrics.md"
    page.write_text("old\n")
    monkeypatch.setattr(manual, "generated", lambda: {page: lambda _: metrics.page()})
    assert manual.main(["--check"]) == 1
    assert manual.main([]) == 0
    assert manual.main(["--check"]) == 0
    assert page.read_text() == metrics.page()
