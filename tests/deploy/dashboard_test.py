"""The coordinator's status page (--http_listen) against GetJobStatus.

 1. A coordinator with two jobs: "train" (alice and bob ran rounds 1..3,
    round 4 is open: alice contributed, bob not) and "other" (one member
    whose name holds markup).
 2. /api/v1/status (all jobs, and ?job=) equals `localsgdctl status --json`
    (the GetJobStatus RPC) field by field; members' idle_ms within the time
    between the two reads.
 3. Bad requests get the documented HTTP status and a JSON error naming
    what was wrong (unknown job, path, method, query parameters) and change
    nothing; each is counted in /metrics; HEAD and /metrics answer.
 4. With --browser: Debian's headless Chromium loads the page; the jobs,
    members, rounds (numbers and contributor counts), the open round and
    whom it waits for match GetJobStatus; the markup in a member's name is
    shown as text; a screenshot goes to --out.
 5. `localsgdctl watch --once` shows the same (jobs, open round and whom it
    waits for, members, rounds); `watch` on a terminal (a pty of 24 x 100)
    redraws in place, every frame within the screen, and ends with exit 0
    on SIGINT, the cursor restored.
 6. Per-job tokens: /api/v1/status without a token is 401 with
    WWW-Authenticate; with a job's token only that job shows; another job's
    ?job= is 403; with --browser the page asks for a token, and with
    #token= shows only that job.

usage: dashboard_test.py COORDINATOR SCRIPTED_MEMBER LOCALSGDCTL
                         [--browser=CHROMIUM] [--out=DIR]
Exit status 77 (skipped) with --browser when Chromium cannot start.
"""
import argparse
import fcntl
import html.parser
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deploy_lib  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("coordinator")
parser.add_argument("member")
parser.add_argument("ctl")
parser.add_argument("--browser", default="")
parser.add_argument("--out", default="")
ARGS = parser.parse_args()
ENV = deploy_lib.Env("dashboard")
MARKUP_NAME = "eve<script>alert(1)</script>"


def ctl_status(coordinator, *args, token_file=None):
    cmd = [ARGS.ctl, f"--target={coordinator.target}", "status", "--json",
           "--rounds=100", *args]
    if token_file:
        cmd.append(f"--token_file={token_file}")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    ENV.check(r.returncode == 0, f"localsgdctl status: {r.stderr}")
    return json.loads(r.stdout)


def strip_idle(status):
    """A copy without members' idle_ms (they differ by the time between the
    two reads); returns (copy, {(job, member): idle_ms})."""
    copy = json.loads(json.dumps(status))
    idle = {}
    for job in copy.get("jobs", []):
        for m in job.get("members", []):
            idle[(job["job_id"], m["member_name"])] = int(m.pop("idle_ms"))
    return copy, idle


def compare(api, rpc, what):
    a, a_idle = strip_idle(api)
    r, r_idle = strip_idle(rpc)
    if a != r:
        for ja, jr in zip(a.get("jobs", []), r.get("jobs", [])):
            for key in sorted(set(ja) | set(jr)):
                if ja.get(key) != jr.get(key):
                    ENV.fail(f"{what}: job {ja.get('job_id')} field {key}: "
                             f"HTTP {ja.get(key)!r} != RPC {jr.get(key)!r}")
        ENV.fail(f"{what}: HTTP {a} != RPC {r}")
    ENV.check(a_idle.keys() == r_idle.keys(), f"{what}: members differ")
    for key, ms in a_idle.items():
        ENV.check(abs(ms - r_idle[key]) < 10000,
                  f"{what}: idle_ms of {key}: {ms} vs {r_idle[key]}")


def expect_error(coordinator, path, status, code, needle, method="GET"):
    got, headers, body = deploy_lib.http(coordinator.url("http", path),
                                         method=method)
    ENV.check(got == status, f"{method} {path}: HTTP {got}, want {status}")
    err = json.loads(body)
    ENV.check(err.get("code") == code and needle in err.get("message", ""),
              f"{method} {path}: {err}, want {code} mentioning {needle!r}")
    return headers


class Dom(html.parser.HTMLParser):
    """What the rendered page shows: per job section, its member rows, round
    rows (number -> contributors cell), open round; scripts inside jobs."""

    def __init__(self):
        super().__init__()
        self.body = {}
        self.jobs = {}
        self.job = None
        self.cell = None  # (job, round) while in a contributors cell
        self.waiting = False
        self.auth_hidden = None
        self.scripts_in_jobs = 0
        self.scripts = 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "body":
            self.body = a
        if tag == "script":
            self.scripts += 1
        if tag == "div" and a.get("id") == "auth":
            self.auth_hidden = "hidden" in a
        if tag == "section" and "data-job" in a:
            self.job = a["data-job"]
            self.jobs[self.job] = {"members": [], "rounds": {}, "open": None,
                                   "waiting": "", "settings": {}}
        if self.job is None:
            return
        j = self.jobs[self.job]
        if tag == "script":
            self.scripts_in_jobs += 1
        if tag == "span" and "data-setting" in a:
            j["settings"][a["data-setting"]] = a.get("data-value")
        if tag == "tr" and "data-member" in a:
            j["members"].append(a["data-member"])
        if tag == "tr" and "data-round" in a:
            self.round = int(a["data-round"])
            j["rounds"][self.round] = ""
        if tag == "td" and "contributors" in a.get("class", ""):
            self.cell = self.round
        if tag == "div" and "open-round" in a.get("class", ""):
            j["open"] = a.get("data-open", "")
        if tag == "div" and a.get("class") == "waiting":
            self.waiting = True

    def handle_endtag(self, tag):
        if tag == "section":
            self.job = None
        if tag == "td":
            self.cell = None
        if tag == "div":
            self.waiting = False

    def handle_data(self, data):
        if self.job is None:
            return
        if self.cell is not None:
            self.jobs[self.job]["rounds"][self.cell] += data
        if self.waiting:
            self.jobs[self.job]["waiting"] += data


def chromium(url, *flags):
    cmd = [ARGS.browser, "--headless", "--no-sandbox", "--disable-gpu",
           "--hide-scrollbars", "--virtual-time-budget=4000", *flags, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def render(url):
    r = chromium(url, "--dump-dom")
    ENV.check(r.returncode == 0, f"chromium --dump-dom {url}: {r.stderr[-2000:]}")
    dom = Dom()
    dom.feed(r.stdout)
    return dom, r.stdout


def check_page(coordinator, rpc):
    dom, _ = render(coordinator.url("http", "/"))
    ENV.check(dom.body.get("data-state") == "ok" and
              int(dom.body.get("data-updates", "0")) >= 1,
              f"page did not render the status: body {dom.body}")
    want_jobs = [j["job_id"] for j in rpc["jobs"]]
    ENV.check(list(dom.jobs) == want_jobs,
              f"page shows jobs {list(dom.jobs)}, GetJobStatus {want_jobs}")
    for job in rpc["jobs"]:
        shown = dom.jobs[job["job_id"]]
        names = [m["member_name"] for m in job["members"]]
        ENV.check(shown["members"] == names,
                  f"{job['job_id']}: page members {shown['members']} != {names}")
        # Every setting GetJobStatus returns, with its value.
        want_settings = {k: str(v) for k, v in job["settings"].items()}
        ENV.check(shown["settings"] == want_settings,
                  f"{job['job_id']}: page settings {shown['settings']} != "
                  f"{want_settings}")
        # The table shows the 25 most recent rounds.
        rounds = {int(r["round"]): f"{len(r['contributors'])}/"
                  f"{len(r['participants'])}"
                  for r in job["recent_rounds"][:25]}
        ENV.check(shown["rounds"] == rounds,
                  f"{job['job_id']}: page rounds {shown['rounds']} != {rounds}")
        want_open = str(int(job["state_round"]) + 1) if job["round_open"] else ""
        ENV.check(shown["open"] == want_open,
                  f"{job['job_id']}: open round {shown['open']!r}, want "
                  f"{want_open!r}")
        for name in job["open_round_waiting_for"]:
            ENV.check(name in shown["waiting"],
                      f"{job['job_id']}: page's waiting-for "
                      f"{shown['waiting']!r} lacks {name}")
    # (The dump keeps "<" inside attribute values as is: count elements.)
    ENV.check(dom.scripts_in_jobs == 0 and dom.scripts == 1,
              f"a member's name was rendered as markup ({dom.scripts} scripts, {dom.scripts_in_jobs} in jobs)")
    ENV.check(MARKUP_NAME in dom.jobs["other"]["members"],
              "the markup name is not shown as text")
    if ARGS.out:
        os.makedirs(ARGS.out, exist_ok=True)
        shot = os.path.join(ARGS.out, "dashboard.png")
        r = chromium(coordinator.url("http", "/"), "--window-size=1280,1400",
                     f"--screenshot={shot}")
        ENV.check(r.returncode == 0 and os.path.getsize(shot) > 10000,
                  f"screenshot failed: {r.stderr[-1000:]}")
        with open(shot, "rb") as f:
            ENV.check(f.read(8) == b"\x89PNG\r\n\x1a\n", "screenshot: not a PNG")
        ENV.log(f"screenshot: {shot}")
    ENV.log(f"page matches GetJobStatus: jobs {want_jobs}, "
            f"{sum(len(j['recent_rounds']) for j in rpc['jobs'])} rounds")


def check_watch(coordinator, rpc):
    r = subprocess.run([ARGS.ctl, f"--target={coordinator.target}", "watch",
                        "--once"], capture_output=True, text=True, timeout=30)
    ENV.check(r.returncode == 0, f"watch --once: {r.returncode} {r.stderr}")
    frame = r.stdout
    for job in rpc["jobs"]:
        ENV.check(f"job {job['job_id']}  state round {job['state_round']}"
                  in frame, f"watch --once lacks job {job['job_id']}:\n{frame}")
        for m in job["members"]:
            ENV.check(re.search(rf"^  {re.escape(m['member_name'])} +"
                                rf"{m['member_ref']} ", frame, re.M),
                      f"watch --once lacks member {m['member_name']}")
    train = next(j for j in rpc["jobs"] if j["job_id"] == "train")
    ENV.check(f"round {int(train['state_round']) + 1} open: 1/2 contributed, "
              "waiting for bob" in frame, f"watch: no open round:\n{frame}")
    for rs in train["recent_rounds"]:
        ENV.check(re.search(rf"^  {rs['round']} +"
                            f"{reason_word(rs)} .* "
                            f"{len(rs['contributors'])}/"
                            f"{len(rs['participants'])} ", frame, re.M),
                  f"watch: no line for round {rs['round']}:\n{frame}")
    # On a terminal: redrawn in place, within 24 rows, SIGINT ends it.
    pid, fd = pty.fork()
    if pid == 0:
        os.execv(ARGS.ctl, [ARGS.ctl, f"--target={coordinator.target}",
                            "watch", "--interval=200ms"])
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    out = b""
    deadline = time.monotonic() + 30
    while out.count(b"\x1b[H") < 3 and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready:
            try:
                out += os.read(fd, 65536)
            except OSError:
                break
    ENV.check(out.count(b"\x1b[H") >= 3, f"watch redrew {out.count(b'[H')} "
              f"times in 30 s: {out[-500:]!r}")
    os.kill(pid, signal.SIGINT)
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    _, wstatus = os.waitpid(pid, 0)
    os.close(fd)
    ENV.check(os.WIFEXITED(wstatus) and os.WEXITSTATUS(wstatus) == 0,
              f"watch after SIGINT: wait status {wstatus}")
    ENV.check(out.endswith(b"\x1b[?25h\r\n") or b"\x1b[?25h" in out[-20:],
              f"watch did not restore the cursor: {out[-40:]!r}")
    frames = out.split(b"\x1b[H")[1:]
    for f in frames[:-1]:
        # Lines are separated, not ended, by newlines: a full frame must
        # not scroll the screen.
        lines = f.split(b"\x1b[J")[0].count(b"\n") + 1
        ENV.check(lines <= 24 and b"job train" in f and
                  b"localsgd 127.0.0.1" in f,
                  f"a frame of {lines} lines (screen 24): {f!r}")
    ENV.log(f"watch: --once matches GetJobStatus; {len(frames)} frames on "
            "a 24-row pty, exit 0 on SIGINT")


def reason_word(round_status):
    return round_status["close_reason"].replace("CLOSE_REASON_", "").lower()


def two_jobs(coordinator, extra_a=(), extra_o=()):
    """train: rounds 1..3 closed, round 4 open waiting for bob; other: one
    member. Returns the members (kept alive by the caller)."""
    a = deploy_lib.Member(ENV, ARGS.member, coordinator, "train", "alice",
                          extra_a)
    b = deploy_lib.Member(ENV, ARGS.member, coordinator, "train", "bob",
                          extra_a)
    for m in (a, b):
        m.do("join")
    for m in (a, b):
        m.send("init 1")
    for m in (a, b):
        m.reply()
    for v in (2, 3, 4):
        a.send(f"sync {v}")
        b.send(f"sync {v + 10}")
        for m in (a, b):
            line = m.reply()
            ENV.check(line.startswith("ok sync"), f"{m.name}: {line}")
    e = deploy_lib.Member(ENV, ARGS.member, coordinator, "other", MARKUP_NAME,
                          extra_o)
    e.do("join")
    e.do("init 5")
    a.send("sync 9")  # opens round 4; bob does not come
    return [a, b, e]


def round_open(coordinator, headers=None):
    status, body = deploy_lib.http_json(
        coordinator.url("http", "/api/v1/status?job=train"), headers)
    return status == 200 and body["jobs"][0]["round_open"] and \
        body["jobs"][0]["open_round_contributed"] == ["alice"]


def check_ha_page():
    """A primary and a standby (--ha_etcd, a real etcd): the page names the
    epoch and the standby, in sync, as GetJobStatus does."""
    if not os.path.exists("/usr/bin/etcd"):
        ENV.log("SKIP the standby's line: no /usr/bin/etcd")
        return
    client, peer = deploy_lib.free_port(), deploy_lib.free_port()
    etcd = ENV.spawn(["/usr/bin/etcd", "--name=n0",
                      f"--data-dir={os.path.join(ENV.tmp, 'etcd')}",
                      f"--listen-client-urls=http://127.0.0.1:{client}",
                      f"--advertise-client-urls=http://127.0.0.1:{client}",
                      f"--listen-peer-urls=http://127.0.0.1:{peer}",
                      f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                      f"--initial-cluster=n0=http://127.0.0.1:{peer}"],
                     "etcd.log", stdout=subprocess.DEVNULL)
    coordinators = []
    for tag in ("ha0", "ha1"):
        port = deploy_lib.free_port()
        coordinators.append(deploy_lib.Coordinator(
            ENV, ARGS.coordinator, tag,
            [f"--listen=127.0.0.1:{port}", "--http_listen=127.0.0.1:0",
             f"--ha_etcd=127.0.0.1:{client}", "--ha_group=page",
             f"--ha_advertise=127.0.0.1:{port}", "--shutdown_grace=1s"],
            ports=("http",)))

    def primary_with_standby():
        for c in coordinators:
            r = subprocess.run([ARGS.ctl, f"--target={c.target}", "status",
                                "--json"], capture_output=True, text=True,
                               timeout=30)
            if r.returncode != 0:  # a standby answers UNAVAILABLE
                continue
            rpc = json.loads(r.stdout)
            standbys = rpc.get("standbys", [])
            if int(rpc.get("epoch", 0)) > 0 and standbys and \
                    all(s.get("in_sync") for s in standbys):
                return c, rpc
        return None
    primary, rpc = ENV.wait_for("a primary with its standby in sync",
                                primary_with_standby)
    standby = [c for c in coordinators if c is not primary][0]
    dom, html = render(primary.url("http", "/"))
    want = (f"primary at epoch {int(rpc['epoch'])}; standbys: "
            f"{standby.target} (in sync)")
    ENV.check(want in html, f"the page does not say {want!r}")
    for c in coordinators:
        c.stop()
    etcd.kill()
    ENV.log(f"page: {want}")


def main():
    if ARGS.browser:
        r = subprocess.run([ARGS.browser, "--headless", "--no-sandbox",
                            "--disable-gpu", "--dump-dom", "about:blank"],
                           capture_output=True, text=True, timeout=120) \
            if os.path.exists(ARGS.browser) else None
        if r is None or r.returncode != 0:
            ENV.log(f"SKIP: Chromium ({ARGS.browser}) cannot start: "
                    f"{'not installed' if r is None else r.stderr[-500:]}; "
                    "scripts/install-deps.sh installs Debian's chromium")
            ENV.close()
            sys.exit(77)

    # --- 1-4: no tokens.
    c = deploy_lib.Coordinator(ENV, ARGS.coordinator, "plain",
                               ["--http_listen=127.0.0.1:0",
                                "--lease_ttl=120s", "--shutdown_grace=1s"],
                               ports=("http",))
    members = two_jobs(c)
    ENV.wait_for("round 4 open", lambda: round_open(c))
    rpc = ctl_status(c)
    _, api = deploy_lib.http_json(c.url("http", "/api/v1/status?rounds=100"))
    compare(api, rpc, "/api/v1/status")
    _, api_job = deploy_lib.http_json(
        c.url("http", "/api/v1/status?job=train&rounds=3"))
    compare(api_job, ctl_status(c, "--job=train", "--rounds=3"),
            "/api/v1/status?job=train&rounds=3")
    ENV.check(len(api_job["jobs"][0]["recent_rounds"]) == 3,
              "rounds=3 did not limit the rounds")
    ENV.log("/api/v1/status equals GetJobStatus field by field")

    expect_error(c, "/api/v1/status?job=nope", 404, "NOT_FOUND", "nope")
    for q in ("rounds=0", "rounds=101", "rounds=ten", "rounds=-1"):
        expect_error(c, f"/api/v1/status?{q}", 400, "INVALID_ARGUMENT",
                     q.split("=")[1])
    expect_error(c, "/api/v1/status?colour=red", 400, "INVALID_ARGUMENT",
                 "colour")
    expect_error(c, "/api/v1/status?job=a&job=b", 400, "INVALID_ARGUMENT",
                 "twice")
    expect_error(c, "/api/v1/status?job=bad%20id", 400, "INVALID_ARGUMENT",
                 "job_id")
    expect_error(c, "/favicon.ico", 404, "NOT_FOUND", "/favicon.ico")
    # A path that is not UTF-8: still a JSON error (json.loads parses it).
    expect_error(c, "/%FF%FE", 404, "NOT_FOUND", "\u00ff")
    allow = expect_error(c, "/api/v1/status", 405, "UNIMPLEMENTED", "POST",
                         method="POST")
    ENV.check(allow.get("Allow") == "GET, HEAD", f"405 without Allow: {allow}")
    status, headers, body = deploy_lib.http(c.url("http", "/"), method="HEAD")
    ENV.check(status == 200 and body == b"" and
              headers.get("Content-Type", "").startswith("text/html"),
              f"HEAD /: {status} {headers}")
    status, headers, page = deploy_lib.http(c.url("http", "/"))
    ENV.check(status == 200 and b"api/v1/status" in page and
              b"src=\"http" not in page and b"href=\"http" not in page,
              "the page is missing or loads something from elsewhere")
    ENV.check("default-src 'none'" in headers.get("Content-Security-Policy", ""),
              "the page has no Content-Security-Policy")
    # Nothing changed: the same status as before the bad requests.
    compare(deploy_lib.http_json(
        c.url("http", "/api/v1/status?rounds=100"))[1], ctl_status(c),
        "after bad requests")
    _, _, metrics = deploy_lib.http(c.url("http", "/metrics"))
    samples = deploy_lib.prometheus_samples(metrics.decode())
    rejected = {dict(k[1])["code"]: v for k, v in samples.items()
                if k[0] == "localsgd_requests_rejected_total" and
                dict(k[1])["method"] == "HTTP /api/v1/status"}
    ENV.check(rejected.get("INVALID_ARGUMENT") == 7 and
              rejected.get("NOT_FOUND") == 1 and
              rejected.get("UNIMPLEMENTED") == 1,
              f"rejected HTTP requests counted as {rejected}")
    # Unknown paths share one series: a caller cannot grow the registry.
    other = {dict(k[1])["code"]: v for k, v in samples.items()
             if k[0] == "localsgd_requests_rejected_total" and
             dict(k[1])["method"] == "HTTP other"}
    ENV.check(other == {"NOT_FOUND": 2.0}, f"unknown paths counted {other}")
    ENV.check(samples.get(("localsgd_rounds_closed_total", frozenset(
        {"job_id": "train", "reason": "complete"}.items()))) == 3,
        "/metrics on the status port lacks train's 3 complete rounds")
    ENV.log("bad requests: the documented errors, counted, nothing changed")

    check_watch(c, ctl_status(c))
    if ARGS.browser:
        check_page(c, ctl_status(c))
        check_ha_page()
    for m in members:
        m.proc.kill()
    c.stop()

    # --- 5: per-job tokens.
    tokens = {"train": "tok-train-0123456789", "other": "tok-other-9876543210"}
    token_file = os.path.join(ENV.tmp, "tokens")
    with open(token_file, "w") as f:
        for job, token in tokens.items():
            f.write(f"{job} {token}\n")
    member_token = {}
    for job, token in tokens.items():
        member_token[job] = os.path.join(ENV.tmp, f"{job}.token")
        with open(member_token[job], "w") as f:
            f.write(token + "\n")
    c = deploy_lib.Coordinator(ENV, ARGS.coordinator, "tokens",
                               ["--http_listen=127.0.0.1:0",
                                f"--token_file={token_file}",
                                "--lease_ttl=120s", "--shutdown_grace=1s"],
                               ports=("http",))
    members = two_jobs(c, [f"--token_file={member_token['train']}"],
                       [f"--token_file={member_token['other']}"])
    bearer = {"Authorization": f"Bearer {tokens['train']}"}
    ENV.wait_for("round 4 open", lambda: round_open(c, bearer))
    headers = expect_error(c, "/api/v1/status", 401, "UNAUTHENTICATED",
                           "authorization")
    ENV.check("Bearer" in headers.get("WWW-Authenticate", ""),
              "401 without WWW-Authenticate: Bearer")
    status, body = deploy_lib.http_json(
        c.url("http", "/api/v1/status?rounds=100"), bearer)
    ENV.check(status == 200 and [j["job_id"] for j in body["jobs"]] ==
              ["train"], f"train's token sees {body}")
    compare(body, ctl_status(c, token_file=member_token["train"]),
            "with train's token")
    status, body = deploy_lib.http_json(
        c.url("http", "/api/v1/status?job=other"), bearer)
    ENV.check(status == 403 and body["code"] == "PERMISSION_DENIED",
              f"train's token on ?job=other: {status} {body}")
    ENV.log("tokens: 401 without, only the token's job with one, 403 across")
    if ARGS.browser:
        dom, _ = render(c.url("http", "/"))
        ENV.check(dom.body.get("data-state") == "auth" and
                  dom.auth_hidden is False and not dom.jobs,
                  f"without a token the page shows {list(dom.jobs)}, state "
                  f"{dom.body.get('data-state')}")
        dom, _ = render(c.url("http", f"/#token={tokens['other']}"))
        ENV.check(dom.body.get("data-state") == "ok" and
                  list(dom.jobs) == ["other"] and
                  dom.jobs["other"]["members"] == [MARKUP_NAME],
                  f"with other's token the page shows {dom.jobs}")
        ENV.log("page: asks for a token without one; #token= shows its job")
    for m in members:
        m.proc.kill()
    c.stop()
    ENV.close()
    ENV.log("OK")


if __name__ == "__main__":
    main()
