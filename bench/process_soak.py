#!/usr/bin/python3
"""Process-level soak: the real coordinator binary and real member processes.

Members are tests/deploy/scripted_member processes (the real client library,
one-tensor model), driven in lockstep steps: in every step each live member
syncs values the harness chose at random for it (constant within a chunk,
different across chunks and members). Faults, at random points of a step:

  - a member is SIGKILLed (mid-stream or just after) and restarted under the
    same name (a new incarnation), which joins again and fetches the state;
  - the coordinator is SIGKILLed and restarted on its --state_dir;
  - with --netns (as root): every host is its own network namespace behind a
    bridge, and a member's link is cut (its switch port down) for 0.3-2.5 s,
    shorter or longer than the 1 s lease.

Every closed round is checked, independently: the coordinator's log names
the members each round counted ("round R closed ...; contributors [...]");
each of them contributed the values the harness gave it in that step, so the
round's result must be their weighted mean, chunk by chunk (allowing, per
chunk, any subset of the step's other members whose chunks arrived before
they died or were cut off: the coordinator counts a finished chunk). Every
result a member printed (sync, adopt, fetch after a restart) must equal the
result of a closure of its round. Mismatches must be 0. Rounds of steps
without a fault must count every member, unless the outlier guard (on by
default) refused one, which the check verifies: the values are random, so
now and then a member's delta is far above a chunk's recent median.

A member that comes back late (it adopted the state after a coordinator
restart) syncs again in its step when another member waits in the round it
would sync next: workers do not wait for each other as the lockstep would.

Every 100 steps it samples the coordinator's RSS and open file descriptors.

Usage (from the build tree):
  /usr/bin/python3 bench/process_soak.py --coordinator=build/server/localsgd-coordinator \
      --member=build/tests/deploy/scripted_member --rounds=2000 [--netns]
CI runs a short one (ctest -R soak_processes, tests/deploy/CMakeLists.txt).
Exit status: 0 when every check held, 1 otherwise, 77 when --netns was
asked for and this machine cannot build network namespaces.
"""

import argparse
import calendar
import fractions
import itertools
import os
import random
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

JOB = "soak"
LEASE = "1s"
SKIP = 77


def log(msg):
    print(f"[soak] {msg}", flush=True)


def f32(x):
    return struct.unpack("f", struct.pack("f", float(x)))[0]


class NetUnavailable(Exception):
    pass


class Net:
    """Where the processes run: loopback, or one netns per host."""

    def __init__(self, netns, workers):
        self.netns = netns
        self.tag = f"lsgdsoak{os.getpid()}"
        self.made = []
        if not netns:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self.port = s.getsockname()[1]
            self.coordinator_address = f"127.0.0.1:{self.port}"
            return
        self.port = 50051
        subnet = f"10.214.{random.randrange(1, 254)}"
        self.sw = f"{self.tag}-sw"
        self.c = f"{self.tag}-c"
        self.w = [f"{self.tag}-w{i}" for i in range(workers)]
        try:
            for ns in [self.sw, self.c] + self.w:
                self.ip("netns", "add", ns)
                self.made.append(ns)
            self.ip("-n", self.sw, "link", "add", "br0", "type", "bridge")
            self.ip("-n", self.sw, "link", "set", "br0", "up")
            self.wire(self.c, "p-c", f"{subnet}.1")
            for i, ns in enumerate(self.w):
                self.wire(ns, f"p-w{i}", f"{subnet}.{10 + i}")
        except subprocess.SubprocessError as e:
            self.close()
            raise NetUnavailable(str(e)) from e
        self.coordinator_address = f"{subnet}.1:{self.port}"

    @staticmethod
    def remove_stale():
        # Namespaces of soaks that died without cleaning up (their pid gone).
        out = subprocess.run(["ip", "netns", "list"], capture_output=True,
                             text=True).stdout
        for name in re.findall(r"^(lsgdsoak(\d+)-\S+)", out, re.M):
            if not os.path.exists(f"/proc/{name[1]}"):
                subprocess.run(["ip", "netns", "del", name[0]],
                               capture_output=True)

    @staticmethod
    def ip(*args):
        subprocess.run(["ip", *args], check=True, timeout=10,
                       capture_output=True)

    def wire(self, ns, port, addr):
        self.ip("-n", self.sw, "link", "add", port, "type", "veth", "peer",
                "name", "eth0", "netns", ns)
        self.ip("-n", self.sw, "link", "set", port, "master", "br0")
        self.ip("-n", self.sw, "link", "set", port, "up")
        self.ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        self.ip("-n", ns, "link", "set", "eth0", "up")
        self.ip("-n", ns, "link", "set", "lo", "up")

    def coordinator_prefix(self):
        return ["ip", "netns", "exec", self.c] if self.netns else []

    def worker_prefix(self, i):
        return ["ip", "netns", "exec", self.w[i]] if self.netns else []

    def cut(self, i, down):
        self.ip("-n", self.sw, "link", "set", f"p-w{i}",
                "down" if down else "up")

    def close(self):
        for ns in reversed(self.made):
            out = subprocess.run(["ip", "netns", "pids", ns],
                                 capture_output=True, text=True)
            for pid in out.stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.made = []


class Coordinator:
    def __init__(self, binary, net, tmp, flags=()):
        self.binary = binary
        self.net = net
        self.tmp = tmp
        self.flags = list(flags)
        self.state = os.path.join(tmp, "state")
        os.makedirs(self.state, exist_ok=True)
        self.incarnation = 0
        self.logs = []
        self.proc = None

    def start(self):
        self.incarnation += 1
        path = os.path.join(self.tmp, f"coordinator.{self.incarnation}.log")
        self.logs.append(path)
        out = open(path, "w")
        self.proc = subprocess.Popen(
            self.net.coordinator_prefix() + [
                self.binary, f"--listen={self.net.coordinator_address}",
                f"--state_dir={self.state}", f"--lease_ttl={LEASE}"] + self.flags,
            stdout=out, stderr=subprocess.STDOUT,
            env=dict(os.environ, TZ="UTC"))  # its log's times: UTC
        out.close()
        deadline = time.time() + 30
        while "coordinator listening on" not in open(path).read():
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"coordinator did not start: {path}")
            time.sleep(0.01)  # polling the log for the condition

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.kill()
            return -9

    def rss_fds(self):
        pid = self.proc.pid
        rss = -1
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1])
        return rss, len(os.listdir(f"/proc/{pid}/fd"))


class Member:
    def __init__(self, args, net, tmp, index, weight):
        self.args = args
        self.net = net
        self.tmp = tmp
        self.index = index
        self.name = f"m{index}"
        self.weight = weight
        self.proc = None
        self.starts = 0
        self.buf = b""

    def start(self):
        self.starts += 1
        err = open(os.path.join(self.tmp, f"{self.name}.{self.starts}.log"), "w")
        self.proc = subprocess.Popen(
            self.net.worker_prefix(self.index) + [
                self.args.member, f"--target={self.net.coordinator_address}",
                f"--job={JOB}", f"--name={self.name}",
                f"--weight={self.weight}", f"--elements={self.args.elements}",
                f"--chunk_elements={self.args.chunk}", "--max_retry_time=120s"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        err.close()
        self.buf = b""

    def send(self, line):
        self.proc.stdin.write((line + "\n").encode())
        self.proc.stdin.flush()

    def read(self):
        """What the member wrote (its stdout is ready)."""
        data = os.read(self.proc.stdout.fileno(), 65536)
        if not data:
            raise RuntimeError(f"{self.name}: exited ({self.proc.poll()})")
        self.buf += data

    def line(self):
        """Its next reply line, or None while it has not written one."""
        if b"\n" not in self.buf:
            return None
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def reply(self, timeout):
        return next_reply([self], timeout)[1]

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def quit(self):
        try:
            self.send("quit")
            self.proc.wait(timeout=10)
        except Exception:
            self.kill()


def next_reply(waiting, timeout):
    """(member, line): the first of `waiting` to reply."""
    deadline = time.time() + timeout
    while True:
        for m in waiting:
            line = m.line()
            if line is not None:
                return m, line
        left = deadline - time.time()
        if left <= 0:
            raise RuntimeError(f"{', '.join(m.name for m in waiting)}: no "
                               f"reply within {timeout} s")
        ready, _, _ = select.select([m.proc.stdout for m in waiting], [], [],
                                    left)
        for m in waiting:
            if m.proc.stdout in ready:
                m.read()


def fields(line):
    return dict(kv.split("=", 1) for kv in line.split()[2:] if "=" in kv)


def parse_chunks(text):
    return [float(v) for v in text.split(",")]


GLOG = re.compile(r"^[IWEF](\d{8}) (\d\d):(\d\d):(\d\d)\.(\d{6}) .*?\] (.*)$")
CLOSED = re.compile(r"^job " + JOB + r": round (\d+) closed \((\w+)\) in [^;]*;"
                    r" contributors \[([^\]]*)\](?:; dropped \[([^\]]*)\])?"
                    r"(?:; timed out \[([^\]]*)\])?")
SEEDED = re.compile(r"^job " + JOB + r": seeded by (\S+)(?: at round (\d+))?$")
# The outlier guard's refusal (src/outlier_guard.cc, src/job.cc).
REFUSED = re.compile(r"^job " + JOB + r": member (\S+)'s contribution to round "
                     r"(\d+) refused at chunk (\d+): chunk \d+ has an L2 norm of "
                     r"(\S+), \S+ times the median (\S+) of \d+ recent "
                     r"contributions of that chunk \(the outlier guard refuses "
                     r"more than (\S+) times\)")


def glog_lines(paths):
    """(coordinator incarnation, time, text) of every glog line."""
    for inc, path in enumerate(paths, 1):
        for line in open(path, errors="replace"):
            m = GLOG.match(line.rstrip("\n"))
            if not m:
                continue
            day, hh, mm, ss, us, text = m.groups()
            t = calendar.timegm(time.strptime(f"{day} {hh}:{mm}:{ss}",
                                              "%Y%m%d %H:%M:%S")) + int(us) / 1e6
            yield inc, t, text


def parse_refusals(paths):
    """The outlier guard's refusals: {(incarnation, round): [(member, chunk,
    norm, median, ratio)]}."""
    out = {}
    for inc, _, text in glog_lines(paths):
        r = REFUSED.match(text)
        if r:
            out.setdefault((inc, int(r.group(2))), []).append(
                (r.group(1), int(r.group(3)), float(r.group(4)),
                 float(r.group(5)), float(r.group(6))))
    return out


def parse_closures(paths):
    """Every closure the coordinators logged: (time, round, reason, names)."""
    out = []
    for inc, t, text in glog_lines(paths):
        c = CLOSED.match(text)
        if c:
            def names_of(group):
                return [n.strip() for n in (group or "").split(",")
                        if n.strip()]
            # Whose finished chunks may count beyond the contributors:
            # the participants that left, lost their lease or timed out.
            out.append((t, int(c.group(1)), c.group(2),
                        names_of(c.group(3)),
                        names_of(c.group(4)) + names_of(c.group(5)), inc))
            continue
        s = SEEDED.match(text)
        if s:
            out.append((t, int(s.group(2) or 0), "seed", [s.group(1)], [],
                        inc))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--coordinator", required=True)
    p.add_argument("--member", required=True)
    p.add_argument("--rounds", type=int, default=2000, help="lockstep steps")
    p.add_argument("--members", type=int, default=4)
    p.add_argument("--seed", type=int, default=20261201)
    p.add_argument("--kill_rate", type=float, default=0.03,
                   help="chance a step SIGKILLs a member")
    p.add_argument("--coordinator_restarts", type=int, default=6)
    p.add_argument("--stateless_restarts", type=int, default=0,
                   help="coordinator restarts that also lose its state dir "
                        "(the members re-seed the job)")
    p.add_argument("--link_cuts", type=int, default=8,
                   help="with --netns: member links cut")
    p.add_argument("--netns", nargs="?", const="on", default="off",
                   choices=["on", "off", "auto"],
                   help="one network namespace per host (root); auto: where "
                        "this process is root and has the ip command")
    p.add_argument("--elements", type=int, default=1000)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--keep", action="store_true", help="keep the logs")
    p.add_argument("--outlier_ratio", default=None,
                   help="the coordinator's --outlier_ratio (default: its own, "
                   "10); the members' values are random, so a low ratio "
                   "makes the guard refuse some, each refusal checked")
    p.add_argument("--deadline", type=float, default=0,
                   help="seconds: stop (and fail) if the run takes longer; "
                        "0: none")
    args = p.parse_args()
    if args.rounds < 6 or not 1 <= args.members <= 8:
        p.error("--rounds must be >= 6 and --members 1..8")
    rng = random.Random(args.seed)
    random.seed(args.seed)
    # SIGTERM (ctest's timeout) ends the run through the cleanup below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("[soak] SIGTERM"))
    if args.deadline > 0:
        signal.signal(signal.SIGALRM,
                      lambda *_: sys.exit(f"[soak] past --deadline={args.deadline:.0f} s"))
        signal.alarm(int(args.deadline))

    want_netns = args.netns
    if want_netns != "off" and os.geteuid() == 0 and shutil.which("ip"):
        Net.remove_stale()
    try:
        if want_netns == "off" or (want_netns == "auto" and (
                os.geteuid() != 0 or not shutil.which("ip"))):
            net = Net(False, args.members)
        else:
            net = Net(True, args.members)
    except NetUnavailable as e:
        if want_netns == "on":
            log(f"SKIP: cannot build the network namespaces: {e}")
            return SKIP
        log(f"network namespaces unavailable ({e}); on loopback")
        net = Net(False, args.members)
    args.netns = net.netns
    tmp = tempfile.mkdtemp(prefix="lsgd-soak-")
    coordinator = Coordinator(
        args.coordinator, net, tmp,
        [] if args.outlier_ratio is None else
        [f"--outlier_ratio={args.outlier_ratio}"])
    weights = [[1.0, 2.0, 0.5, 3.0][i % 4] for i in range(args.members)]
    members = [Member(args, net, tmp, i, weights[i]) for i in range(args.members)]
    weight = {m.name: m.weight for m in members}
    num_chunks = (args.elements + args.chunk - 1) // args.chunk
    # candidates[step][name]: the (v, b, lo, hi, since) values that member
    # sent in the step, for the rounds lo..hi of coordinators from incarnation
    # `since` on (any round of an earlier one): a member that syncs again in
    # its step sent its first values for rounds up to the one it came back
    # with, as far as the coordinator it came back from knows.
    candidates = []
    ANY = (0, float("inf"), 0)
    windows = []  # (start, end) of each step
    replies = []  # (step, name, kind, round, chunks, contributed)
    faults = set()  # steps with a kill, a restart or a cut (and the next)
    errors = []
    kills = restarts = cuts = resyncs = 0
    holds = {}  # the round of the state each member holds, as it last said
    table = []
    T = args.rounds
    restart_steps = set(rng.sample(range(5, T), min(args.coordinator_restarts, T - 5)))
    stateless_steps = set(rng.sample(sorted(set(range(5, T)) - restart_steps),
                                     min(args.stateless_restarts, T - 5 - len(restart_steps))))
    cut_steps = set()
    if args.netns:
        cut_steps = set(rng.sample(range(5, T), min(args.link_cuts, T - 5)))

    def values():
        return (rng.randrange(-64, 65) * 0.25, rng.randrange(-8, 9) * 0.125)

    def start_member(m, step):
        m.start()
        m.send("join")
        r = m.reply(90)
        if not r.startswith("ok join"):
            raise RuntimeError(f"{m.name}: {r}")
        v, b = values()
        candidates[step].setdefault(m.name, []).append((v, b) + ANY)
        m.send(f"init {v} {b}")
        r = m.reply(90)
        if not r.startswith("ok init"):
            raise RuntimeError(f"{m.name}: {r}")
        f = fields(r)
        replies.append((step, m.name, "init", int(f["round"]),
                        parse_chunks(f["chunks"]), None))
        holds[m.name] = int(f["round"])

    ok = False
    try:
        coordinator.start()
        log(f"coordinator at {net.coordinator_address} "
            f"({'one netns per host' if args.netns else 'loopback'}), "
            f"{args.members} members, weights {weights}, {num_chunks} chunks, "
            f"{T} steps, seed {args.seed}")
        candidates.append({})
        t0 = time.time()
        for m in members:
            start_member(m, 0)
        windows.append((t0, time.time()))
        began = time.time()
        for step in range(1, T + 1):
            candidates.append({})
            start = time.time()
            live = list(members)
            behind = []  # members that came back late in this step
            for m in live:
                v, b = values()
                candidates[step].setdefault(m.name, []).append((v, b) + ANY)
                m.send(f"sync {v} {b}")
            victim = None
            if rng.random() < args.kill_rate:
                victim = rng.choice(live)
                time.sleep(rng.uniform(0, 0.01))  # a random point of the step
                victim.kill()
                kills += 1
            if step in restart_steps or step in stateless_steps:
                time.sleep(rng.uniform(0, 0.02))
                coordinator.kill()
                if step in stateless_steps:
                    shutil.rmtree(coordinator.state)
                    os.makedirs(coordinator.state)
                coordinator.start()
                restarts += 1
            if step in cut_steps:
                j = rng.randrange(args.members)
                net.cut(j, True)
                time.sleep(rng.uniform(0.3, 2.5))  # the fault lasts this long
                net.cut(j, False)
                cuts += 1
            waiting = [m for m in live if m is not victim]
            while waiting:
                m, r = next_reply(waiting, 90)
                waiting.remove(m)
                if not r.startswith("ok sync"):
                    errors.append((step, m.name, r))
                    continue
                f = fields(r)
                replies.append((step, m.name, "sync", int(f["round"]),
                                parse_chunks(f["chunks"]),
                                f["contributed"] == "1"))
                holds[m.name] = int(f["round"])
                if f["late"] == "1":
                    behind.append(m)
                # Lockstep must not stall the job: a member that came back
                # late (it adopted the state after a coordinator restart, or
                # its round had closed) syncs again in the same step, as a
                # worker trains on and syncs again, when a member still
                # waiting is in the round it would sync next (the members
                # that got the last result before the restart wait in the
                # round after the restored one for those that did not).
                for late in list(behind):
                    if any(holds[w.name] == holds[late.name] for w in waiting):
                        behind.remove(late)
                        sent = candidates[step][late.name]
                        at = holds[late.name]
                        sent[:] = [(v, b, lo, min(hi, at), coordinator.incarnation)
                                   for (v, b, lo, hi, _) in sent]
                        v, b = values()
                        sent.append((v, b, at + 1) + ANY[1:])
                        late.send(f"sync {v} {b}")
                        waiting.append(late)
                        resyncs += 1
            if victim is not None:
                start_member(victim, step)
            if (victim is not None or step in restart_steps or
                    step in stateless_steps or step in cut_steps):
                faults.update((step, step + 1))
            windows.append((start, time.time()))
            if step % 100 == 0 or step == T:
                rss, fds = coordinator.rss_fds()
                table.append((step, coordinator.incarnation, rss, fds))
                log(f"step {step}: coordinator #{coordinator.incarnation} "
                    f"RSS {rss / 1024:.1f} MiB, {fds} fds; {kills} member "
                    f"kills, {restarts} coordinator restarts, {cuts} cuts, "
                    f"{time.time() - began:.0f} s")
        for m in members:
            m.quit()
        rc = coordinator.stop()
        if rc != 0:
            errors.append((T, "coordinator", f"exit status {rc} on SIGTERM"))
        ok = True
    finally:
        if not ok:
            for m in members:
                if m.proc is not None and m.proc.poll() is None:
                    m.kill()
            if coordinator.proc is not None and coordinator.proc.poll() is None:
                coordinator.kill()
        net.close()

    # --- the independent check ---
    closures = parse_closures(coordinator.logs)

    def steps_of(t):
        # The step whose window holds the closure: the log's and the
        # harness's clocks are the same (CLOCK_REALTIME), to the microsecond
        # the log prints; at a boundary, either step.
        return [s for s, (a, b) in enumerate(windows)
                if a - 2e-6 <= t <= b + 2e-6]

    refusals = parse_refusals(coordinator.logs)
    printed = {}  # (round, chunk): every value a member printed for it
    for (_, _, _, rnd, chunks, _) in replies:
        for c, value in enumerate(chunks):
            printed.setdefault((rnd, c), set()).add(value)

    def sent_for(step, rnd, inc):
        """{name: [(v, b)]}: what each member sent in `step` that round `rnd`
        of coordinator `inc` may count."""
        return {n: [(v, b) for (v, b, lo, hi, since) in sent
                    if inc < since or lo <= rnd <= hi]
                for n, sent in candidates[step].items()}

    def mean_options(names, gone, step, rnd, inc, chunk):
        """Every value the chunk may hold after a closure of round `rnd` by
        coordinator `inc` counting `names` (and, per chunk, any of `gone`:
        participants that left or were dropped, whose finished chunks
        count). A chunk no one gave where the outlier guard refused members
        (every one at it or before) keeps the state of round rnd - 1, as
        members printed it."""
        cand = sent_for(step, rnd, inc)
        others = [n for n in gone if n in cand and n not in names]
        out = set()
        for picks in itertools.product(*[cand.get(n, []) for n in names]):
            num = sum(fractions.Fraction(weight[n]) * fractions.Fraction(v + b * chunk)
                      for n, (v, b) in zip(names, picks))
            den = sum(fractions.Fraction(weight[n]) for n in names)
            for k in range(len(others) + 1):
                for extra in itertools.combinations(others, k):
                    for xpicks in itertools.product(*[cand[n] for n in extra]):
                        xn = num + sum(fractions.Fraction(weight[n]) *
                                       fractions.Fraction(v + b * chunk)
                                       for n, (v, b) in zip(extra, xpicks))
                        xd = den + sum(fractions.Fraction(weight[n]) for n in extra)
                        if xd > 0:
                            out.add(float(xn / xd))
                        elif (inc, rnd) in refusals:
                            out.update(printed.get((rnd - 1, chunk), ()))
        return out

    def matches(value, options):
        # The job takes pseudo-gradients: a result is the previous state plus
        # the mean of (value - previous state) in float32, so it is off by a
        # few ulps of the states' magnitude (below 32 here: 2^-19 is 4 ulps
        # of 32). Candidates differ by far more (multiples of 1/8 / weights).
        return any(abs(value - o) <= 2.0 ** -19 + 4e-7 * abs(o) for o in options)

    def refusal_holds(name, rnd, inc, chunk, norm, median, ratio, steps):
        """Whether the outlier guard's refusal of `name`'s chunk in round
        `rnd` is what the log says: the coordinator's ratio, the norm past
        it times the median, and the norm that of the member's delta (what
        the harness gave it in the step minus the state of round rnd - 1
        that members printed), to the log's 4 digits."""
        configured = f32(args.outlier_ratio if args.outlier_ratio else 10)
        if abs(ratio - configured) > 1e-5 * configured:
            return False
        if not norm > ratio * median * (1 - 1e-3):
            return False
        size = min(args.chunk, args.elements - chunk * args.chunk)
        for step in steps:
            for (v, b) in sent_for(step, rnd, inc).get(name, []):
                for prev in printed.get((rnd - 1, chunk), ()):
                    delta = abs(f32(v + b * chunk) - prev) * size ** 0.5
                    if abs(delta - norm) <= 1e-3 * norm:
                        return True
        return False

    by_round = {}
    unplaced = 0
    incomplete = []  # fault-free steps whose round did not count everyone
    refused = 0  # members the outlier guard refused, each checked
    everyone = sorted(m.name for m in members)
    for (t, rnd, reason, names, gone, inc) in closures:
        s = steps_of(t)
        if not s:
            unplaced += 1
            continue
        by_round.setdefault(rnd, []).append((s, names, gone, reason, inc))
        if (reason != "seed" and not any(x in faults for x in s) and
                (reason != "complete" or sorted(names) != everyone)):
            # The members' values are random, so now and then one's delta is
            # more than 10 times the recent median of a chunk's, and the
            # outlier guard (on by default) rightly refuses it: a round that
            # lost members only that way, each refusal checked, is whole.
            missing = [n for n in everyone if n not in names]
            said = {r[0]: r for r in refusals.get((inc, rnd), [])}
            if (reason == "members_gone" and missing and
                    all(n in said and refusal_holds(n, rnd, inc, *said[n][1:], s)
                        for n in missing)):
                refused += len(missing)
                continue
            incomplete.append((rnd, reason, names, s))

    cache = {}
    observed = set()
    mismatches = []
    for (step, name, kind, rnd, chunks, contributed) in replies:
        found = False
        for idx, (s, names, gone, reason, inc) in enumerate(by_round.get(rnd, [])):
            # A result from the member's own step or before it, and one that
            # counted the member if (and only if, for the round it asked
            # for) it says so.
            if min(s) > step or (contributed and name not in names):
                continue
            good = True
            for c, value in enumerate(chunks):
                key = (rnd, idx, c)
                if key not in cache:
                    cache[key] = set().union(
                        *[mean_options(names, gone, one, rnd, inc, c) for one in s])
                if value != value or not matches(value, cache[key]):
                    good = False
                    break
            if good:
                found = True
                observed.add((rnd, idx))
                break
        if not found:
            seen = [(s, names,
                     sorted(mean_options(names, gone, s[0], rnd, inc, 0))[:4])
                    for (s, names, gone, _, inc) in by_round.get(rnd, [])]
            mismatches.append((step, name, kind, rnd,
                               f"chunks {chunks[:3]}; closures of the round "
                               f"(step, counted, chunk 0 may be): {seen}"))

    reasons = {}
    for (_, _, reason, _, _, _) in closures:
        reasons[reason] = reasons.get(reason, 0) + 1
    log("RSS and open fds of the coordinator, every 100 steps:")
    print("| step | coordinator # | RSS MiB | fds |")
    print("|---:|---:|---:|---:|")
    for (s, inc, rss, fds) in table:
        print(f"| {s} | {inc} | {rss / 1024:.1f} | {fds} |")
    log(f"steps {T}; closures logged {len(closures)} "
        f"({', '.join(f'{k} {v}' for k, v in sorted(reasons.items()))}); "
        f"closures whose result a member printed {len(observed)}; results "
        f"checked {len(replies)}; member kills {kills}; coordinator restarts "
        f"{restarts}; link cuts {cuts}; late members that synced again in "
        f"their step {resyncs}; errors {len(errors)}; closures outside "
        f"any step {unplaced}; members the outlier guard refused (checked) "
        f"{refused}; fault-free rounds that did not count every "
        f"member {len(incomplete)}; mismatches {len(mismatches)}")
    for i in incomplete[:10]:
        log(f"INCOMPLETE: round {i[0]} closed {i[1]} counting {i[2]} in step {i[3]}")
    for e in errors[:10]:
        log(f"error: step {e[0]} {e[1]}: {e[2]}")
    for mm in mismatches[:10]:
        log(f"MISMATCH: step {mm[0]} {mm[1]} {mm[2]} round {mm[3]}: {mm[4]}")
    failed = bool(mismatches or errors or unplaced or incomplete)
    if failed or args.keep:
        log(f"logs kept in {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
