"""The README's span and metric tables against what the code records and exports.

Spans: every call of `telemetry.start_span` / `record_span` / `record_batch_span` in `tandem/`
and `services/` names a span declared in `tandem.telemetry` (REQUEST_SPANS, BATCH_SPANS), every
declared span is recorded somewhere, and the README's span table lists exactly the declared ones.
Metrics: every Prometheus metric constructed in `tandem/` or `services/` (Counter, Gauge,
Histogram, Summary, Info and their *MetricFamily forms, read from the source, so families made
at scrape time count too) stands in the README's metric table with its type and labels, and the
table lists nothing the code does not export.
"""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass, field

from tandem import telemetry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
SOURCE_DIRS = ("tandem", "services")
SKIP_DIRS = {os.path.join("tandem", "rpc"), "__pycache__"}  # generated stubs

# prometheus_client constructor -> the type the README's table gives
METRIC_KINDS = {
    "Counter": "counter",
    "CounterMetricFamily": "counter",
    "Gauge": "gauge",
    "GaugeMetricFamily": "gauge",
    "Histogram": "histogram",
    "HistogramMetricFamily": "histogram",
    "Summary": "summary",
    "SummaryMetricFamily": "summary",
    "Info": "info",
    "InfoMetricFamily": "info",
}
SPAN_FUNCTIONS = {"start_span": "request", "record_span": "request", "record_batch_span": "batch"}


@dataclass
class Metric:
    kind: str
    labels: tuple[str, ...]
    places: list[str] = field(default_factory=list)


def _sources() -> list[tuple[str, ast.Module]]:
    out = []
    for top in SOURCE_DIRS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
            rel_dir = os.path.relpath(dirpath, ROOT)
            dirnames[:] = [d for d in dirnames if os.path.join(rel_dir, d) not in SKIP_DIRS]
            dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
            for name in sorted(filenames):
                if name.endswith(".py"):
                    path = os.path.join(rel_dir, name)
                    with open(os.path.join(ROOT, path)) as f:
                        out.append((path, ast.parse(f.read(), filename=path)))
    return out


def _callee(node: ast.Call) -> str | None:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _arg(node: ast.Call, index: int, keyword: str) -> ast.expr | None:
    for kw in node.keywords:
        if kw.arg == keyword:
            return kw.value
    return node.args[index] if len(node.args) > index else None


def _exported_name(name: str, kind: str) -> str:
    # prometheus_client exposes a counter `x` (or `x_total`) as `x_total`.
    return name.removesuffix("_total") + "_total" if kind == "counter" else name


def _loop_constants(name: ast.Name, parents: dict[ast.AST, ast.AST]) -> list[str] | None:
    """The strings `name` takes in `for (..., name, ...) in TABLE`, where TABLE is a literal
    tuple or list of tuples (or a local variable assigned one); None when it is not that."""
    node: ast.AST = name
    while node in parents:
        node = parents[node]
        if not isinstance(node, ast.For) or not isinstance(node.target, ast.Tuple):
            continue
        ids = [e.id if isinstance(e, ast.Name) else None for e in node.target.elts]
        if name.id not in ids:
            continue
        table = node.iter
        if isinstance(table, ast.Name):  # the last assignment of it before the loop
            assigns = [
                a.value
                for a in ast.walk(parents.get(node, node))
                if isinstance(a, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == table.id for t in a.targets)
                and a.lineno < node.lineno
            ]
            table = assigns[-1] if assigns else table
        if not isinstance(table, (ast.Tuple, ast.List)):
            return None
        k = ids.index(name.id)
        out = []
        for row in table.elts:
            if not isinstance(row, ast.Tuple) or not isinstance(row.elts[k], ast.Constant):
                return None
            out.append(row.elts[k].value)
        return out
    return None


def metrics_in_code() -> dict[str, Metric]:
    """Every metric family the code constructs: exported name -> type, labels, places."""
    found: dict[str, Metric] = {}
    for path, tree in _sources():
        parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or _callee(node) not in METRIC_KINDS:
                continue
            kind = METRIC_KINDS[_callee(node)]
            where = f"{path}:{node.lineno}"
            name = _arg(node, 0, "name")
            names = (
                [name.value]
                if isinstance(name, ast.Constant) and isinstance(name.value, str)
                else _loop_constants(name, parents)
                if isinstance(name, ast.Name)
                else None
            )
            assert names, (
                f"{where}: a metric's name must be a string literal (or come from a literal "
                "table the call loops over), so that this test and the README can see it"
            )
            # Counter(name, doc, labelnames, ...); CounterMetricFamily(name, doc, value, labels)
            family = _callee(node).endswith("MetricFamily")
            labels_node = _arg(node, 3, "labels") if family else _arg(node, 2, "labelnames")
            labels: tuple[str, ...] = ()
            if labels_node is not None:
                assert isinstance(labels_node, (ast.List, ast.Tuple)) and all(
                    isinstance(e, ast.Constant) for e in labels_node.elts
                ), f"{where}: a metric's label names must be a literal list of strings"
                labels = tuple(sorted(e.value for e in labels_node.elts))
            for base in names:
                exported = _exported_name(base, kind)
                m = found.setdefault(exported, Metric(kind, labels))
                assert (m.kind, m.labels) == (kind, labels), (
                    f"metric {exported} is a {kind}{list(labels)} at {where} but a "
                    f"{m.kind}{list(m.labels)} at {m.places}"
                )
                m.places.append(where)
    return found


def spans_in_code() -> dict[str, tuple[str, str]]:
    """Every span name the code records: name -> (request | batch, place)."""
    found: dict[str, tuple[str, str]] = {}
    for path, tree in _sources():
        if path == os.path.join("tandem", "telemetry.py"):
            continue  # the span functions themselves pass `name` on
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or _callee(node) not in SPAN_FUNCTIONS:
                continue
            where = f"{path}:{node.lineno}"
            arg = _arg(node, 0, "name")
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                name = arg.value
            elif isinstance(arg, ast.Attribute) and isinstance(
                getattr(telemetry, arg.attr, None), str
            ):
                name = getattr(telemetry, arg.attr)
            else:
                raise AssertionError(
                    f"{where}: a span's name must be a string literal or a tandem.telemetry "
                    "constant, so that this test and the README can see it"
                )
            found.setdefault(name, (SPAN_FUNCTIONS[_callee(node)], where))
    return found


def readme_table(header: str) -> list[list[str]]:
    """The rows (cells) of every README table whose header row starts with `| header |`."""
    with open(README) as f:
        lines = f.read().splitlines()
    rows: list[list[str]] = []
    starts = [i for i, line in enumerate(lines) if line.startswith(f"| {header} |")]
    assert starts, f"README.md has no table with a `{header}` column"
    for i in starts:
        for row in lines[i + 2 :]:
            if not row.startswith("|"):
                break
            rows.append([c.strip() for c in row.strip().strip("|").split("|")])
    return rows


def readme_metrics() -> dict[str, tuple[str, tuple[str, ...]]]:
    """The README's metric tables: exported name -> (type, labels)."""
    out = {}
    for cells in readme_table("metric"):
        for name, labels in re.findall(r"`([a-z_:][a-z0-9_:]*)(?:\{([a-z_, ]*)\})?`", cells[0]):
            out[name] = (cells[1], tuple(sorted(x.strip() for x in labels.split(",") if x)))
    return out


def readme_spans() -> set[str]:
    return {re.sub(r"`", "", cells[0]) for cells in readme_table("span")}


def test_every_recorded_span_is_declared_and_every_declared_one_recorded() -> None:
    recorded = spans_in_code()
    declared = {n: "request" for n in telemetry.REQUEST_SPANS} | {
        n: "batch" for n in telemetry.BATCH_SPANS
    }
    for name, (kind, where) in recorded.items():
        assert declared.get(name) == kind, (
            f"{where} records the {kind} span {name!r}, which tandem.telemetry does not declare "
            f"in {'REQUEST_SPANS' if kind == 'request' else 'BATCH_SPANS'}"
        )
    unused = sorted(set(declared) - set(recorded))
    assert not unused, f"tandem.telemetry declares spans no code records: {unused}"


def test_readme_span_table_lists_every_span() -> None:
    declared = telemetry.REQUEST_SPANS | telemetry.BATCH_SPANS
    listed = readme_spans()
    missing = sorted(declared - listed)
    assert not missing, (
        f"README.md's span table (Observability > Traces) lacks the spans {missing}, "
        "declared in tandem/telemetry.py"
    )
    extra = sorted(listed - declared)
    assert not extra, f"README.md's span table lists spans no code records: {extra}"


def test_readme_metric_table_lists_every_metric() -> None:
    code, listed = metrics_in_code(), readme_metrics()
    problems = []
    for name, m in sorted(code.items()):
        if name not in listed:
            problems.append(
                f"metric {name} ({m.kind}, {m.places[0]}) is missing from README.md's metric "
                "table (Observability > Metrics)"
            )
        elif listed[name] != (m.kind, m.labels):
            problems.append(
                f"README.md's metric table gives {name} as {listed[name][0]} with labels "
                f"{list(listed[name][1])}; the code ({m.places[0]}) makes a {m.kind} with labels "
                f"{list(m.labels)}"
            )
    for name in sorted(set(listed) - set(code)):
        problems.append(f"README.md's metric table lists {name}, which no code exports")
    assert not problems, "\n".join(problems)


def test_metric_scan_finds_the_known_families() -> None:
    """The source scan itself sees metrics made at construction and at scrape time."""
    code = metrics_in_code()
    assert code["tandem_time_to_first_token_seconds"].kind == "histogram"
    assert code["tandem_kv_transfer_seconds"].labels == ("transport",)
    assert code["tandem_num_requests_running"].kind == "gauge"  # a GaugeMetricFamily
    assert code["tandem_requests_shed_total"].kind == "counter"  # in services/gateway
    assert code["tandem_gpu_power_watts"].kind == "gauge"  # named in a table the code loops over


# Measurement history belongs in commit messages, not in the tree (acceptance grep of the docs).
HISTORY = re.compile(r"session [0-9]|call [0-9]|issue #[0-9]", re.IGNORECASE)
HISTORY_PATHS = (
    "tandem",
    "services",
    "tests",
    "README.md",
    "docs",
    os.path.join("bench", "README.md"),
)


def test_code_and_docs_carry_no_history_talk() -> None:
    hits = []
    for top in HISTORY_PATHS:
        full = os.path.join(ROOT, top)
        files = [full] if os.path.isfile(full) else []
        for dirpath, dirnames, filenames in os.walk(full):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            files += [os.path.join(dirpath, n) for n in filenames]
        for path in files:
            try:
                with open(path, encoding="utf-8") as f:
                    lines = f.readlines()
            except UnicodeDecodeError:
                continue  # binary
            for i, line in enumerate(lines, 1):
                if HISTORY.search(line):
                    hits.append(f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()}")
    assert not hits, "history talk (say it in a commit message instead):\n" + "\n".join(hits)


def test_bench_readme_stays_short() -> None:
    size = os.path.getsize(os.path.join(ROOT, "bench", "README.md"))
    assert size <= 15_000, f"bench/README.md is {size:,} bytes; keep it within 15,000"
