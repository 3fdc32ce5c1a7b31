"""deploy/grafana/localsgd-coordinator.json against a real coordinator and,
where Debian's prometheus is installed, a real Prometheus.

 1. The dashboard is well formed: unique panel ids, panels inside the
    24-column grid and not overlapping, every query on the ${datasource}
    variable, the job_id variable defined.
 2. A coordinator (--metrics_listen) runs a job of two members for three
    rounds, a second job that is deleted (localsgdctl delete-job), and a
    refused Join (bad job id).
 3. Every metric every query names exists in the real /metrics scrape, and
    every label a query matches on or aggregates by exists on that metric
    (le on the histogram's _bucket).
 4. With prometheus: it scrapes the coordinator every second (scrape job
    "localsgd", so Prometheus' own job label is there too); every query of
    the dashboard, with $job_id = All and $__rate_interval = 1m, is
    evaluated by Prometheus' HTTP API and returns series without error; the
    members panel shows train's 2 members under job_id (not exported_job).

usage: grafana_test.py DASHBOARD COORDINATOR SCRIPTED_MEMBER LOCALSGDCTL
                       [--prometheus=PATH]
"""
import argparse
import json
import os
import re
import subprocess
import sys
import urllib.parse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deploy_lib  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("dashboard")
parser.add_argument("coordinator")
parser.add_argument("member")
parser.add_argument("ctl")
parser.add_argument("--prometheus", default="")
ARGS = parser.parse_args()
ENV = deploy_lib.Env("grafana")

PROMQL_WORDS = {"sum", "rate", "by", "without", "histogram_quantile",
                "label_values", "count", "avg", "max", "min", "irate",
                "increase", "le"}


def queries(dash):
    """(where, expr) of every panel target and query variable."""
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append((f"panel '{p['title']}' {t['refId']}", t["expr"]))
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            out.append((f"variable {v['name']}", q))
    return out


def used(expr):
    """Metric names, and per metric the labels its selectors match on, plus
    the labels of by (...) clauses (which apply to every metric below them)."""
    metrics = {}
    for m in re.finditer(r"(localsgd_[a-z_]+)(\{([^}]*)\})?", expr):
        labels = set(re.findall(r"([a-zA-Z_]+)\s*(?:=~|!=|!~|=)",
                                m.group(3) or ""))
        metrics.setdefault(m.group(1), set()).update(labels)
    by = set()
    for m in re.finditer(r"\bby\s*\(([^)]*)\)", expr):
        by.update(x.strip() for x in m.group(1).split(",") if x.strip())
    m = re.match(r"label_values\((\w+),\s*(\w+)\)", expr)
    if m:
        metrics.setdefault(m.group(1), set()).add(m.group(2))
    return metrics, by


def check_structure(dash):
    ids = [p["id"] for p in dash["panels"]]
    ENV.check(len(ids) == len(set(ids)), f"panel ids repeat: {ids}")
    cells = {}
    for p in dash["panels"]:
        g = p["gridPos"]
        ENV.check(g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["w"] > 0 and
                  g["h"] > 0, f"panel '{p['title']}' outside the grid: {g}")
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                ENV.check((x, y) not in cells,
                          f"panels '{p['title']}' and '{cells.get((x, y))}' "
                          "overlap")
                cells[(x, y)] = p["title"]
        ENV.check(p["datasource"]["uid"] == "${datasource}" and all(
            t["datasource"]["uid"] == "${datasource}" for t in p["targets"]),
            f"panel '{p['title']}' is not on the ${{datasource}} variable")
        ENV.check(p["targets"], f"panel '{p['title']}' has no query")
    names = {v["name"] for v in dash["templating"]["list"]}
    ENV.check({"datasource", "job_id"} <= names, f"variables: {names}")


def prom_query(port, expr):
    url = (f"http://127.0.0.1:{port}/api/v1/query?" +
           urllib.parse.urlencode({"query": expr}))
    status, _, raw = deploy_lib.http(url)
    try:
        return status, json.loads(raw)
    except ValueError:
        # While it starts, Prometheus answers 503 in plain text.
        return status, {}


def main():
    with open(ARGS.dashboard) as f:
        dash = json.load(f)
    check_structure(dash)
    qs = queries(dash)
    ENV.log(f"{len(dash['panels'])} panels, {len(qs)} queries")

    c = deploy_lib.Coordinator(ENV, ARGS.coordinator, "c",
                               ["--metrics_listen=127.0.0.1:0"],
                               ports=("metrics",))
    a = deploy_lib.Member(ENV, ARGS.member, c, "train", "alice")
    b = deploy_lib.Member(ENV, ARGS.member, c, "train", "bob")
    o = deploy_lib.Member(ENV, ARGS.member, c, "other", "olga")
    for m in (a, b, o):
        m.do("join")
    for m in (a, b, o):
        m.send("init 1")
    for m in (a, b, o):
        m.reply()
    for v in (2, 3, 4):
        a.send(f"sync {v}")
        b.send(f"sync {v}")
        a.reply()
        b.reply()
    o.do("leave")
    r = subprocess.run([ARGS.ctl, f"--target={c.target}", "delete-job",
                        "--job=other"], capture_output=True, text=True,
                       timeout=30)
    ENV.check(r.returncode == 0, f"delete-job: {r.stderr}")
    bad = deploy_lib.Member(ENV, ARGS.member, c, "bad job", "x")
    bad.send("join")
    line = bad.reply()
    ENV.check(line.startswith("error join INVALID_ARGUMENT"),
              f"a Join with a bad job id: {line}")

    _, _, text = deploy_lib.http(c.url("metrics", "/metrics"))
    samples = deploy_lib.prometheus_samples(text.decode())
    labels_of = {}
    for (name, labels) in samples:
        labels_of.setdefault(name, set()).update(k for k, _ in labels)
    for where, expr in qs:
        metrics, by = used(expr)
        ENV.check(metrics, f"{where}: no localsgd metric in {expr}")
        for name, labels in metrics.items():
            ENV.check(name in labels_of,
                      f"{where}: {name} is not in the /metrics scrape")
            missing = (labels | by) - labels_of[name]
            ENV.check(not missing, f"{where}: {name} has no label(s) "
                      f"{sorted(missing)} (it has {sorted(labels_of[name])})")
    ENV.log("every metric and label the dashboard uses is in the scrape")

    if not ARGS.prometheus or not os.path.exists(ARGS.prometheus):
        ENV.log(f"prometheus not found ({ARGS.prometheus or 'not given'}): "
                "the queries were not evaluated (scripts/install-deps.sh "
                "installs Debian's prometheus)")
        ENV.close()
        ENV.log("OK")
        return
    port = deploy_lib.free_port()
    config = os.path.join(ENV.tmp, "prometheus.yml")
    with open(config, "w") as f:
        f.write("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                "scrape_configs:\n  - job_name: localsgd\n"
                "    static_configs:\n"
                f"      - targets: ['127.0.0.1:{c.ports['metrics']}']\n")
    prom = ENV.spawn([ARGS.prometheus, f"--config.file={config}",
                      f"--storage.tsdb.path={os.path.join(ENV.tmp, 'tsdb')}",
                      f"--web.listen-address=127.0.0.1:{port}"],
                     "prometheus.log", stdout=subprocess.DEVNULL)

    def scraped(n):
        def enough():
            if prom.poll() is not None:
                ENV.fail(f"prometheus exited with {prom.returncode}")
            try:
                status, body = prom_query(
                    port, "count_over_time(localsgd_jobs[1m])")
            except OSError:
                return False
            result = body.get("data", {}).get("result", []) \
                if status == 200 else []
            return result and float(result[0]["value"][1]) >= n
        return enough
    ENV.wait_for("3 scrapes of the coordinator by prometheus", scraped(3),
                 timeout=60, interval=0.2)
    for where, expr in qs:
        if expr.startswith("label_values("):
            metric, label = used(expr)[0].popitem()
            expr = f"count by ({label.pop()}) ({metric})"
        q = expr.replace('"$job_id"', '".*"').replace("$__rate_interval",
                                                        "1m")
        status, body = prom_query(port, q)
        ENV.check(status == 200 and body.get("status") == "success",
                  f"{where}: prometheus refused {q}: {body}")
        ENV.check(body["data"]["result"],
                  f"{where}: {q} returned no series")
    status, body = prom_query(port, 'localsgd_members{job_id="train"}')
    ENV.check(status == 200 and [r["metric"].get("job") for r in
                                 body["data"]["result"]] == ["localsgd"] and
              float(body["data"]["result"][0]["value"][1]) == 2,
              f"members of train under job_id: {body}")
    ENV.log(f"prometheus evaluated all {len(qs)} queries; each returns series")
    prom.terminate()
    ENV.close()
    ENV.log("OK")


if __name__ == "__main__":
    main()
