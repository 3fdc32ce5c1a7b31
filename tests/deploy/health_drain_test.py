"""Health, drain and localsgdctl against the real coordinator binary.

A client that is not the project's (Debian's python3-grpcio, grpc_health.py)
checks grpc.health.v1; real members (scripted_member, on the client library)
run rounds; localsgdctl reports them; SIGTERM drains:

 1. Settings come from LOCALSGD_* environment variables, the command line
    wins over them; a bad value is a startup error naming the variable.
 2. SERVING for "", localsgd.v1.Coordinator and liveness; two members run
    two rounds; /metrics counts them; localsgdctl status (table and --json)
    shows the members and the rounds.
 3. A round is open (a contributed, b not) when SIGTERM comes: readiness is
    NOT_SERVING at once, liveness stays SERVING, a new member is refused
    with UNAVAILABLE ("draining"), b's contribution still closes the round
    and both get its average, the next round is refused with UNAVAILABLE,
    the process exits 0 and the checkpoint holds the round.
 4. Restarted on the same --state_dir: SERVING once the job is restored (at
    that round). A round that does not close within --shutdown_grace: its
    waiting member is told UNAVAILABLE, the process exits 0 soon after the
    grace, the checkpoint keeps the last closed round.

Every wait is for a condition, bounded; no sleep is a synchronisation.
usage: health_drain_test.py COORDINATOR SCRIPTED_MEMBER LOCALSGDCTL
"""
import json
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
try:
    import grpc_health  # noqa: E402  (needs python3-grpcio)
except ImportError as e:
    sys.exit(f"FAIL: {e}; install python3-grpcio and python3-protobuf "
             "(scripts/install-deps.sh) and run with /usr/bin/python3")

COORDINATOR, MEMBER, CTL = sys.argv[1:4]
JOB = "drain-test"
ELEMENTS = 1000
CHUNK = 256  # 4 chunks per sync
TMP = tempfile.mkdtemp(prefix="localsgd-health-drain.")
STATE = os.path.join(TMP, "state")
PROCS = []


def log(msg):
    print(f"[health_drain] {msg}", flush=True)


def fail(msg):
    log(f"FAIL: {msg}")
    for name in sorted(os.listdir(TMP)):
        if name.endswith(".log"):
            with open(os.path.join(TMP, name), errors="replace") as f:
                print(f"----- {name} (last 40 lines)")
                print("".join(f.readlines()[-40:]), end="")
    sys.exit(1)


def wait_for(what, predicate, timeout=30.0, interval=0.05):
    """Polls `predicate` until it returns a true value; fails after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class Coordinator:
    def __init__(self, tag, env, args):
        self.port_file = os.path.join(TMP, f"{tag}.port")
        self.metrics_port_file = os.path.join(TMP, f"{tag}.metrics_port")
        self.log_path = os.path.join(TMP, f"coordinator-{tag}.log")
        full_env = dict(os.environ)
        full_env.update(env)
        self.proc = subprocess.Popen(
            [COORDINATOR, f"--port_file={self.port_file}",
             f"--metrics_port_file={self.metrics_port_file}", *args],
            env=full_env, stdout=open(self.log_path, "w"),
            stderr=subprocess.STDOUT)
        PROCS.append(self.proc)

        def port():
            if self.proc.poll() is not None:
                fail(f"coordinator exited with {self.proc.returncode} "
                     "before serving")
            try:
                with open(self.port_file) as f:
                    return int(f.read().strip())
            except (OSError, ValueError):
                return None
        self.port = wait_for("the coordinator's port file", port)
        with open(self.metrics_port_file) as f:
            self.metrics_port = int(f.read().strip())
        self.target = f"127.0.0.1:{self.port}"

    def health(self, service=""):
        return grpc_health.check(self.target, service)

    def metrics(self):
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                samples[key] = float(value)
        return samples

    def log_text(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()


class Member:
    """A scripted_member process: one command in, one line out."""

    def __init__(self, coordinator, name, retry="0s"):
        self.name = name
        self.proc = subprocess.Popen(
            [MEMBER, f"--target={coordinator.target}", f"--job={JOB}",
             f"--name={name}", f"--elements={ELEMENTS}",
             f"--chunk_elements={CHUNK}", f"--max_retry_time={retry}"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=open(os.path.join(TMP, f"member-{name}.log"), "w"),
            text=True, bufsize=1)
        PROCS.append(self.proc)

    def send(self, command):
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def reply(self, timeout=30.0):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            fail(f"member {self.name}: no reply within {timeout}s")
        line = self.proc.stdout.readline().strip()
        if not line:
            fail(f"member {self.name} exited ({self.proc.poll()})")
        return line

    def do(self, command, expect_ok=True):
        self.send(command)
        line = self.reply()
        if expect_ok and not line.startswith("ok "):
            fail(f"member {self.name}: '{command}' -> {line}")
        return line

    def quit(self):
        self.send("quit")
        self.proc.wait(timeout=30)


def fields(line):
    return dict(f.split("=", 1) for f in line.split()[2:] if "=" in f)


def ctl(coordinator, *args):
    return subprocess.run([CTL, f"--target={coordinator.target}", *args],
                          capture_output=True, text=True, timeout=30)


def status_json(coordinator):
    r = ctl(coordinator, "status", f"--job={JOB}", "--json")
    if r.returncode != 0:
        fail(f"localsgdctl status --json: {r.returncode} {r.stderr}")
    return json.loads(r.stdout)["jobs"][0]


def checkpoint_round(path):
    """The round in a checkpoint file (format in src/checkpoint.h)."""
    with open(path, "rb") as f:
        head = f.read(4096)
    if head[:8] != b"LSGDCKPT":
        fail(f"{path} is not a checkpoint")
    (id_len,) = struct.unpack_from("<I", head, 24)
    (round_,) = struct.unpack_from("<Q", head, 28 + id_len)
    return round_


def wait_exit(coordinator, timeout):
    try:
        return coordinator.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        fail(f"coordinator still running {timeout}s after SIGTERM")


def sync_pair(a, va, b, vb):
    a.send(f"sync {va}")
    b.send(f"sync {vb}")
    return a.reply(), b.reply()


def main():
    # --- 1. Settings from the environment; the command line wins. --------
    r = subprocess.run([COORDINATOR, "--listen=127.0.0.1:0"],
                       env=dict(os.environ, LOCALSGD_LEASE_TTL="soon"),
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 2 or "LOCALSGD_LEASE_TTL='soon'" not in r.stderr:
        fail(f"a bad LOCALSGD_LEASE_TTL: exit {r.returncode}, {r.stderr!r}")
    coord = Coordinator("first", env={
        "LOCALSGD_LISTEN": "127.0.0.1:1",  # overridden by --listen below
        "LOCALSGD_METRICS_LISTEN": "127.0.0.1:0",
        "LOCALSGD_STATE_DIR": STATE,
        "LOCALSGD_SHUTDOWN_GRACE": "60s",
        "LOCALSGD_LEASE_TTL": "20s",
    }, args=["--listen=127.0.0.1:0"])
    log(f"coordinator on {coord.target}, metrics on {coord.metrics_port}")
    if not os.path.isdir(STATE):
        fail("LOCALSGD_STATE_DIR was not applied (no state dir)")

    # --- 2. Serving; two rounds; metrics; localsgdctl. --------------------
    for service in ["", "localsgd.v1.Coordinator", "liveness"]:
        got = coord.health(service)
        if got != "SERVING":
            fail(f"health '{service}' is {got}, expected SERVING")
    r = ctl(coord, "health")
    if r.returncode != 0 or r.stdout.strip() != "SERVING":
        fail(f"localsgdctl health: rc={r.returncode} out={r.stdout!r}")

    a, b = Member(coord, "a"), Member(coord, "b")
    a.do("join")
    a.do("init 1")  # seeds round 0
    b.do("join")
    b.do("init 0")  # fetches the seed
    for rnd in (1, 2):
        ra, rb = sync_pair(a, 1, b, 3)
        for line in (ra, rb):
            f = fields(line)
            if not line.startswith("ok sync") or f["round"] != str(rnd) or \
                    f["contributors"] != "2" or float(f["value"]) != 2.0:
                fail(f"round {rnd}: {line}")
    log("two rounds closed with both members")

    m = coord.metrics()
    for key, want in [
        (f'localsgd_rounds_closed_total{{job_id="{JOB}",reason="complete"}}', 2),
        (f'localsgd_rounds_closed_total{{job_id="{JOB}",reason="seed"}}', 1),
        (f'localsgd_members{{job_id="{JOB}"}}', 2),
        (f'localsgd_round_duration_seconds_count{{job_id="{JOB}"}}', 2),
        # a seeds (1 model), then 2 members x 2 rounds.
        (f'localsgd_bytes_received_total{{job_id="{JOB}"}}', 5 * ELEMENTS * 4),
        # seed result to a, FetchState to b, 2 x 2 results.
        (f'localsgd_bytes_sent_total{{job_id="{JOB}"}}', 6 * ELEMENTS * 4),
    ]:
        if m.get(key) != want:
            fail(f"/metrics: {key} = {m.get(key)}, expected {want}")
    log("/metrics of the binary counts the rounds and bytes")

    r = ctl(coord, "status")
    if r.returncode != 0:
        fail(f"localsgdctl status: {r.returncode} {r.stderr}")
    table = r.stdout
    print(table, end="")
    for needle in [f"job {JOB}", "\na ", "\nb ", "\n2 ", "\n1 ", "\n0 ",
                   "complete", "seed", "a,b"]:
        if needle not in table:
            fail(f"localsgdctl status table lacks {needle!r}")
    job = status_json(coord)
    if job["state_round"] != "2" or \
            sorted(x["member_name"] for x in job["members"]) != ["a", "b"] or \
            [x["round"] for x in job["recent_rounds"]] != ["2", "1", "0"] or \
            job["recent_rounds"][0]["contributors"] != ["a", "b"] or \
            job["recent_rounds"][0]["close_reason"] != "CLOSE_REASON_COMPLETE":
        fail(f"localsgdctl status --json: {json.dumps(job)}")
    log("localsgdctl status shows members a, b and rounds 2, 1, 0")

    # --- 3. SIGTERM with an open round that then closes. -----------------
    a.send("sync 5")  # opens round 3; b has not contributed
    wait_for("a's contribution to round 3",
             lambda: status_json(coord)["open_round_contributed"] == ["a"])
    t0 = time.monotonic()
    coord.proc.send_signal(signal.SIGTERM)
    wait_for("readiness NOT_SERVING after SIGTERM",
             lambda: coord.health("") == "NOT_SERVING", timeout=10)
    log(f"NOT_SERVING {time.monotonic() - t0:.3f}s after SIGTERM")
    for service, want in [("localsgd.v1.Coordinator", "NOT_SERVING"),
                          ("liveness", "SERVING")]:
        got = coord.health(service)
        if got != want:
            fail(f"while draining, health '{service}' is {got}, want {want}")
    r = ctl(coord, "health")
    if r.returncode != 1 or r.stdout.strip() != "NOT_SERVING":
        fail(f"localsgdctl health while draining: rc={r.returncode} "
             f"out={r.stdout!r}")
    c = Member(coord, "c")
    line = c.do("join", expect_ok=False)
    if not line.startswith("error join UNAVAILABLE") or "draining" not in line:
        fail(f"a join while draining: {line}")
    c.quit()
    b.send("sync 7")  # closes round 3
    for line in (a.reply(), b.reply()):
        f = fields(line)
        if not line.startswith("ok sync") or f["round"] != "3" or \
                float(f["value"]) != 6.0:
            fail(f"round 3 while draining: {line}")
    log("round 3, open at SIGTERM, closed with both members")
    # No new round opens while draining: UNAVAILABLE while the server still
    # answers; once every round has closed it stops after kSettleTime
    # (500 ms), and a call that arrives later (slow machine, sanitizers) is
    # CANCELLED by the stopping server. Clients retry both. The checkpoint
    # below (round 3) shows no round 4 ever opened.
    line = a.do("sync 1", expect_ok=False)
    if not (line.startswith("error sync UNAVAILABLE") or
            line.startswith("error sync CANCELLED")):
        fail(f"a new round while draining: {line}")
    rc = wait_exit(coord, 30)
    if rc != 0:
        fail(f"coordinator exited with {rc} after SIGTERM")
    ckpt = os.path.join(STATE, f"{JOB}.ckpt")
    if not os.path.exists(ckpt) or checkpoint_round(ckpt) != 3:
        fail(f"checkpoint {ckpt} missing or not at round 3")
    if "draining: no round open" not in coord.log_text():
        fail("the coordinator did not log the drain")
    log(f"exit 0 {time.monotonic() - t0:.1f}s after SIGTERM; "
        "checkpoint at round 3")
    a.quit()
    b.quit()

    # --- 4. Restart from the state; a round that misses the grace. --------
    coord = Coordinator("second", env={"LOCALSGD_STATE_DIR": STATE}, args=[
        "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
        "--shutdown_grace=1s"])
    if coord.health("") != "SERVING":
        fail("restarted coordinator is not SERVING")
    job = status_json(coord)
    if job["state_round"] != "3" or not job["has_state"] or job["members"]:
        fail(f"restored job: {json.dumps(job)}")
    log("restarted: SERVING with the job restored at round 3")
    a, b = Member(coord, "a2"), Member(coord, "b2")
    for member in (a, b):
        member.do("join")
        if fields(member.do("init 0")).get("round") != "3":
            fail("members did not fetch the restored round 3")
    a.send("sync 1")  # round 4; b2 never contributes
    wait_for("a2's contribution to round 4",
             lambda: status_json(coord)["open_round_contributed"] == ["a2"])
    t0 = time.monotonic()
    coord.proc.send_signal(signal.SIGTERM)
    line = a.reply(timeout=20)
    if not line.startswith("error sync UNAVAILABLE"):
        fail(f"a round open past the grace: {line}")
    waited = time.monotonic() - t0
    if waited < 0.9:
        fail(f"the open round was failed after {waited:.2f}s, before the 1s "
             "grace")
    rc = wait_exit(coord, 20)
    if rc != 0:
        fail(f"coordinator exited with {rc}")
    if checkpoint_round(ckpt) != 3:
        fail("the checkpoint changed though no round closed")
    if "rounds still open after 1s" not in coord.log_text():
        fail("the coordinator did not log the missed grace")
    log(f"round 4 missed the 1s grace: UNAVAILABLE after {waited:.1f}s, "
        f"exit 0 after {time.monotonic() - t0:.1f}s, checkpoint at round 3")
    a.quit()
    b.quit()
    log("OK")


if __name__ == "__main__":
    try:
        main()
        shutil.rmtree(TMP, ignore_errors=True)
    finally:
        for p in PROCS:
            if p.poll() is None:
                p.kill()
                p.wait()
        if os.path.exists(TMP):
            log(f"logs kept in {TMP}")
