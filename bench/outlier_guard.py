#!/usr/bin/python3
"""The outlier guard on Fashion-MNIST: a hostile member, and what the guard costs.

Runs the example worker (localsgd-fashion-mnist) against two coordinators,
one with the outlier guard (--outlier_ratio, 10 by default) and one without
(--outlier_ratio=off), for ROUNDS rounds of OUTER_NESTEROV (K=16, fp32) and
every seed, and prints a markdown table of rank 0's final test accuracy.

Arms (ranks 0-2 train the same shards, with the same seeds, in every arm):
  honest3      ranks 0-2 of a world of 4 (rank 3's shard unused), guard on:
               the run without the hostile member
  hostile      ranks 0-2 and rank 3 with --scale_delta=1e6 (its change since
               the state it trained from, a million times too large, at every
               sync), guard on
  hostile_off  the same without the guard
  honest4_on   ranks 0-3 honest, guard on
  honest4_off  ranks 0-3 honest, guard off

Usage: bench/outlier_guard.py [--seeds 1,2,3] [--rounds 20] [--arms a,b]
Environment: BUILD_DIR (build). Needs dataset-fashion-mnist.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ARMS = [
    # name, label, guard on, ranks, hostile rank
    ("honest3", "3 honest members (guard on)", True, 3, None),
    ("hostile", "3 honest + 1 sending 10^6 x its delta, guard on", True, 4, 3),
    ("hostile_off", "3 honest + 1 sending 10^6 x its delta, guard off", False,
     4, 3),
    ("honest4_on", "4 honest members, guard on", True, 4, None),
    ("honest4_off", "4 honest members, guard off", False, 4, None),
]


def field(name, line):
    m = re.search(r"\b%s=(\S+)" % re.escape(name), line)
    return m.group(1) if m else None


def start_coordinator(binary, tmp, name, ratio):
    port_file = os.path.join(tmp, f"{name}.port")
    proc = subprocess.Popen(
        [binary, "--listen=127.0.0.1:0", f"--port_file={port_file}",
         "--metrics_listen=", f"--outlier_ratio={ratio}",
         "--lease_ttl=10s"],
        stdout=open(os.path.join(tmp, f"{name}.log"), "w"),
        stderr=subprocess.STDOUT)
    for _ in range(300):
        if os.path.exists(port_file) and open(port_file).read().strip():
            return proc, open(port_file).read().strip()
        if proc.poll() is not None:
            sys.exit(f"[outlier_guard] coordinator {name} exited (see {tmp})")
        time.sleep(0.1)
    sys.exit("[outlier_guard] a coordinator did not start")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--ratio", default="10",
                   help="the guarded coordinator's --outlier_ratio")
    p.add_argument("--scale", default="1e6",
                   help="the hostile member's --scale_delta")
    p.add_argument("--arms", default=",".join(a[0] for a in ARMS))
    p.add_argument("--worker_flags",
                   default="--k=16 --averaging=nesterov --outer_lr=0.7 "
                           "--outer_momentum=0.5 --epochs=3",
                   help="flags for every worker, space separated")
    args = p.parse_args()
    build = os.environ.get("BUILD_DIR", "build")
    coordinator = os.path.join(build, "server", "localsgd-coordinator")
    worker = os.path.join(build, "examples", "localsgd-fashion-mnist")
    for b in (coordinator, worker):
        if not os.access(b, os.X_OK):
            sys.exit(f"[outlier_guard] {b} not found; build first "
                     "(BUILD_DIR=<dir>)")
    if not os.path.isdir("/usr/share/datasets/fashion-mnist"):
        print("[outlier_guard] skipped: dataset-fashion-mnist is not installed")
        sys.exit(77)
    seeds = [int(s) for s in args.seeds.split(",")]
    arms = [a for a in ARMS if a[0] in args.arms.split(",")]

    tmp = tempfile.mkdtemp(prefix="localsgd-outlier.")
    guarded, guarded_port = start_coordinator(coordinator, tmp, "guarded",
                                              args.ratio)
    open_, open_port = start_coordinator(coordinator, tmp, "unguarded", "off")
    results = {}
    honest_uncounted = {}
    try:
        for name, label, guard, ranks, hostile in arms:
            port = guarded_port if guard else open_port
            for seed in seeds:
                job = f"outlier-{name}-{seed}-{os.getpid()}"
                procs = []
                start = time.time()
                for r in range(ranks):
                    extra = [f"--scale_delta={args.scale}"] \
                        if r == hostile else []
                    log = open(os.path.join(tmp, f"{name}.{seed}.{r}.log"), "w")
                    procs.append(subprocess.Popen(
                        [worker, f"--coordinator=127.0.0.1:{port}",
                         f"--job={job}", "--world=4", f"--rank={r}",
                         f"--rendezvous={ranks}", f"--seed={seed}",
                         f"--max_rounds={args.rounds}", "--eval_every_sync=0",
                         "--log_every=1000"] + args.worker_flags.split() +
                        extra,
                        stdout=log, stderr=subprocess.STDOUT))
                rcs = [pr.wait() for pr in procs]
                seconds = time.time() - start
                path = os.path.join(tmp, f"{name}.{seed}.0.log")
                if rcs[0] and hostile is not None and not guard:
                    # Without the guard the hostile delta is averaged in:
                    # what the honest workers make of it is the outcome.
                    error = [l.strip() for l in open(path) if " error: " in l]
                    results.setdefault(name, []).append((None, 0))
                    print(f"[outlier_guard] {name} seed {seed}: rank 0 "
                          f"failed: {error[-1] if error else '?'}",
                          file=sys.stderr, flush=True)
                    continue
                if any(rcs[r] for r in range(ranks) if r != hostile):
                    for r in range(ranks):
                        path = os.path.join(tmp, f"{name}.{seed}.{r}.log")
                        sys.stderr.write("".join(open(path).readlines()[-5:]))
                    sys.exit(f"[outlier_guard] {name} seed {seed}: a worker "
                             f"failed (logs in {tmp})")
                final = [l for l in open(path) if "rank=0 final " in l]
                acc = float(field("test_accuracy", final[-1]))
                # Syncs not counted (contributed=0), the hostile member's
                # and the honest ones' (the guard's false alarms).
                refused, honest_refused = 0, 0
                for r in range(ranks):
                    rpath = os.path.join(tmp, f"{name}.{seed}.{r}.log")
                    n = sum(1 for l in open(rpath)
                            if " sync round=" in l and "contributed=0" in l)
                    if r == hostile:
                        refused += n
                    else:
                        honest_refused += n
                results.setdefault(name, []).append((acc, refused))
                honest_uncounted.setdefault(name, []).append(honest_refused)
                print(f"[outlier_guard] {name} seed {seed}: accuracy "
                      f"{acc:.4f}, syncs not counted: hostile {refused}, "
                      f"honest {honest_refused}, {seconds:.1f} s",
                      file=sys.stderr, flush=True)
    finally:
        for proc in (guarded, open_):
            proc.terminate()
            proc.wait()

    print("| arm | " + " | ".join(f"seed {s}" for s in seeds) +
          " | mean | vs 3 honest (points) |")
    print("|---|" + "---|" * len(seeds) + "---|---|")
    base = statistics.mean(a for a, _ in results["honest3"]) \
        if "honest3" in results else None
    for name, label, _, _, _ in arms:
        accs = [a for a, _ in results[name]]
        if any(a is None for a in accs):
            print(f"| {label} | " + " | ".join(
                "failed" if a is None else f"{a:.4f}" for a in accs) +
                " | | |")
            continue
        mean = statistics.mean(accs)
        vs = "" if base is None else f"{100 * (mean - base):+.2f}"
        print(f"| {label} | " + " | ".join(f"{a:.4f}" for a in accs) +
              f" | {mean:.4f} | {vs} |")
    for name in ("hostile", "hostile_off"):
        if name in results:
            print(f"\n{name}: the hostile member's syncs not counted, per "
                  f"seed: {[r for _, r in results[name]]}")
    print("\nhonest members' syncs not counted, per arm and seed: " +
          ", ".join(f"{name} {counts}"
                    for name, counts in honest_uncounted.items()))
    if "honest4_on" in results and "honest4_off" in results:
        on = statistics.mean(a for a, _ in results["honest4_on"])
        off = statistics.mean(a for a, _ in results["honest4_off"])
        print(f"\nhonest runs, guard on - off: {100 * (on - off):+.2f} points "
              "(mean over the seeds)")
    print(f"\n{args.rounds} rounds, seeds {args.seeds}, worker flags "
          f"'{args.worker_flags}', guard ratio {args.ratio}, "
          f"{os.cpu_count()} cores.")


if __name__ == "__main__":
    main()
