#!/usr/bin/python3
"""The time a worker waits across a coordinator failover (--ha_etcd).

Starts, on loopback: an etcd, a primary and a standby coordinator of one
shard (each restarted as a standby when it ends, as a supervisor would),
and --world Python worker processes (localsgd.Client, --millions fp32
parameters) that sync round after round against "primary|standby". The
primary is SIGKILLed --kills times, each once every member has had two
results since the one before, then --every seconds more, and once the
restarted standby is in sync (a kill before would be a double failure). Per kill, the
failover wait is the longest gap between two consecutive results at any
member across the kill (its round in flight when the primary died, the
standby's election, the re-join); the steady round time is the median gap
away from kills. Prints both (p50, p99, max) and checks at the end that all
members hold the same parameters.

With --kills=0 it measures steady rounds alone, and --standbys=0 runs the
same elected primary without a standby: the two side by side give what
following the primary's state costs a round.

usage: bench/failover.py [--build=build] [--world=4] [--millions=1]
                         [--kills=10] [--every=3] [--lease_ttl=2s]
                         [--standbys=1] [--duration=20]
"""
import argparse
import multiprocessing as mp
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"nothing listens on {port}")


class Coordinator:
    def __init__(self, args, tmp, index, port, etcd):
        self.args, self.tmp, self.index, self.port = args, tmp, index, port
        self.etcd = etcd
        self.proc = None

    def start(self):
        log = open(os.path.join(self.tmp, f"coordinator{self.index}.log"), "a")
        self.proc = subprocess.Popen(
            [os.path.join(self.args.build, "server", "localsgd-coordinator"),
             f"--listen=127.0.0.1:{self.port}", f"--ha_etcd={self.etcd}",
             f"--ha_advertise=127.0.0.1:{self.port}", "--ha_group=bench",
             f"--ha_lease_ttl={self.args.lease_ttl}"],
            stdout=log, stderr=log)

    def serving(self):
        ctl = os.path.join(self.args.build, "tools", "localsgdctl")
        return subprocess.run(
            [ctl, f"--target=127.0.0.1:{self.port}", "health"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            timeout=10).returncode == 0


def worker(rank, args, target, stop, times, finals, counts):
    sys.path.insert(0, os.path.join(args.build, "python"))
    import localsgd
    n = int(args.millions * 1e6)
    client = localsgd.Client(target=target, job="failover",
                             member_name=f"w{rank}", rendezvous=args.world,
                             max_retry_time=60.0, rpc_timeout=5.0)
    client.join([("p", [n], "float32")])
    params = np.zeros(n, np.float32)
    client.initialize(params)
    i = 0
    while not stop.is_set() and i < len(times) // args.world:
        params += np.float32(0.25 * (rank + 1))
        client.sync(params)
        times[rank * (len(times) // args.world) + i] = time.monotonic()
        i += 1
    finals[rank] = float(params[0])
    counts[rank] = i
    client.leave()
    client.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build", default="build")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--millions", type=float, default=1)
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--every", type=float, default=3)
    p.add_argument("--lease_ttl", default="2s")
    p.add_argument("--standbys", type=int, default=1)
    p.add_argument("--keep_logs", action="store_true",
                   help="keep the coordinators' and etcd's logs")
    p.add_argument("--duration", type=float, default=20,
                   help="with --kills=0: seconds of steady rounds")
    args = p.parse_args()
    if args.kills > 0 and args.standbys < 1:
        sys.exit("--kills needs a standby (--standbys >= 1)")
    tmp = tempfile.mkdtemp(prefix="localsgd-failover.")
    etcd_port, peer = free_port(), free_port()
    etcd = subprocess.Popen(
        ["/usr/bin/etcd", "--name", "bench", "--data-dir", f"{tmp}/etcd",
         "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
         "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"bench=http://127.0.0.1:{peer}"],
        stdout=subprocess.DEVNULL, stderr=open(f"{tmp}/etcd.log", "w"))
    wait_port(etcd_port)
    coords = [Coordinator(args, tmp, i, free_port(), f"127.0.0.1:{etcd_port}")
              for i in range(1 + args.standbys)]
    for c in coords:
        c.start()
        wait_port(c.port)
    def await_in_sync():
        """Until the primary has its standbys in sync (or 60 s)."""
        ctl = os.path.join(args.build, "tools", "localsgdctl")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            primary = next((c for c in coords if c.serving()), None)
            if primary is not None:
                out = subprocess.run(
                    [ctl, f"--target=127.0.0.1:{primary.port}", "status"],
                    capture_output=True, text=True, timeout=10).stdout
                if out.count(": in sync") >= args.standbys:
                    return primary
            time.sleep(0.1)
        return None

    if args.standbys > 0:
        await_in_sync()  # before the rounds are timed
    target = "|".join(f"127.0.0.1:{c.port}" for c in coords)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    slots = 100000
    times = ctx.Array("d", args.world * slots, lock=False)
    finals = ctx.Array("d", args.world, lock=False)
    counts = ctx.Array("i", args.world, lock=False)
    procs = [ctx.Process(target=worker,
                         args=(r, args, target, stop, times, finals,
                               counts))
             for r in range(args.world)]
    for w in procs:
        w.start()
    kills = []
    try:
        time.sleep(args.every)
        if args.kills == 0:
            time.sleep(args.duration)
        for _ in range(args.kills):
            # A failover, not a double failure: the standby is in sync.
            primary = await_in_sync()
            if primary is None:
                sys.exit(f"no standby in sync; logs in {tmp}")
            killed = time.monotonic()
            kills.append(killed)
            primary.proc.kill()
            primary.proc.wait()
            primary.start()  # back as the standby
            # The next kill only once every member has had two results
            # since this one: each wait is one failover's.
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not all(
                    sum(1 for t in times[r * slots:(r + 1) * slots]
                        if t > killed) >= 2 for r in range(args.world)):
                time.sleep(0.1)
            time.sleep(args.every)
    finally:
        stop.set()
        for w in procs:
            w.join(120)
        for c in coords:
            c.proc.send_signal(signal.SIGTERM)
        for c in coords:
            try:
                c.proc.wait(30)
            except subprocess.TimeoutExpired:
                c.proc.kill()
        etcd.kill()
    if any(w.exitcode != 0 for w in procs):
        sys.exit(f"a worker failed; logs in {tmp}")
    per_member = [[t for t in times[r * slots:(r + 1) * slots] if t > 0]
                  for r in range(args.world)]
    waits, steady = [], []
    for r, ts in enumerate(per_member):
        for a, b in zip(ts, ts[1:]):
            if not any(a <= k < b for k in kills):
                steady.append(b - a)
    for k in kills:
        gaps = [b - a for ts in per_member for a, b in zip(ts, ts[1:])
                if a <= k < b]
        if gaps:
            waits.append(max(gaps))
    waits.sort()
    rounds = min(len(ts) for ts in per_member)
    # At the stop, a member that leaves first misses the others' last round
    # (it closes without it): the members that made as many rounds agree.
    last = max(counts[:])
    same = len({finals[r] for r in range(args.world) if counts[r] == last}) == 1
    print(f"world {args.world}, {args.millions:g}M fp32, lease TTL "
          f"{args.lease_ttl}, {args.standbys} standbys: {len(kills)} kills "
          f"over {rounds} rounds; members agree: {same}")
    print(f"  steady round: median {statistics.median(steady):.3f} s")
    if waits:
        print(f"  failover wait: p50 {statistics.median(waits):.3f} s, p99 "
              f"{waits[min(len(waits) - 1, int(0.99 * len(waits)))]:.3f} s, "
              f"max {waits[-1]:.3f} s  "
              f"({', '.join(f'{w:.2f}' for w in waits)})")
    if not same:
        sys.exit("members disagree: " + ", ".join(str(f) for f in finals) +
                 f"; logs in {tmp}")
    if args.keep_logs:
        print(f"  logs in {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
