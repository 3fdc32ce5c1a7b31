#!/usr/bin/python3
"""Quality per byte on Fashion-MNIST: test accuracy against bytes exchanged.

Runs the example worker (localsgd-fashion-mnist) with WORKERS workers against
one coordinator for every arm below and every seed, each arm with the same
step budget (EPOCHS passes over each worker's shard, the same samples), and
prints a markdown table: rank 0's final test accuracy (mean and spread over
the seeds; all workers hold the same parameters after the final sync) and
the chunk bytes each worker sent and received in its syncs (mean over
workers and seeds; the state's first seed or fetch when a worker starts,
the same float32 state for every arm, is not counted).

Arms: synchronous (average every step, fp32), MEAN K=16 fp32, OUTER_NESTEROV
K=16 fp32, OUTER_NESTEROV K=64 in fp32, int8 and int4 (the rule on the float32
mean and on the encoded mean: mean encoding wire), the sparse codes (the top 64 or 128 of every 4096
values, 2 or 4 bits each, the coordinator's step 4 times as many) under
OUTER_NESTEROV and MEAN at K=8, 12, 16 and 64, and no averaging.

With --regions R (R >= 2), the workers split evenly among R regional
coordinators (--upstream) under one upstream coordinator: the regions
average with MEAN over float32, and an arm's rule and wire are the
upstream job's (the upstream coordinator is started per arm with them as
its defaults). Bytes are then the workers' own, inside their region.

Any sparse arm can also be named <rule><K>s<bits>k<up>r<down>, e.g.
mean4s2k32r48: MEAN every 4 steps on SPARSE2, 32 of 4096 kept up, 48
down (nest4s2k32r48: OUTER_NESTEROV); with a final e (mean12s2k96r192e),
the workers train on from the global state plus their own residual
(--error_reset, error reset). The table lists the arms in the order
--arms names them.

Usage: bench/quality.py [--seeds 1,2,3] [--epochs 1] [--arms name,...]
       [--worker_flags "--model=wide"] [--regions 2]
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
    # name, label, worker flags
    ("sync", "synchronous (K=1, fp32)", ["--k=1"]),
    ("mean16", "MEAN K=16 fp32", ["--k=16"]),
    ("nest16", "OUTER_NESTEROV K=16 fp32", ["--k=16", "--averaging=nesterov"]),
    ("nest64", "OUTER_NESTEROV K=64 fp32", ["--k=64", "--averaging=nesterov"]),
    ("nest64i8", "OUTER_NESTEROV K=64 int8",
     ["--k=64", "--averaging=nesterov", "--wire_dtype=int8"]),
    ("nest64i4", "OUTER_NESTEROV K=64 int4",
     ["--k=64", "--averaging=nesterov", "--wire_dtype=int4"]),
    # The rule on the encoded mean (mean encoding wire): what a standby
    # coordinator replicates at one member's download per round.
    ("nest64i8w", "OUTER_NESTEROV K=64 int8, mean encoding wire",
     ["--k=64", "--averaging=nesterov", "--wire_dtype=int8",
      "--mean_encoding=wire"]),
    ("nest64i4w", "OUTER_NESTEROV K=64 int4, mean encoding wire",
     ["--k=64", "--averaging=nesterov", "--wire_dtype=int4",
      "--mean_encoding=wire"]),
    # The sparse codes: the top 1.6% (64 of 4096) or 3.1% of the delta plus
    # residual, 2 or 4 bits each; the coordinator's step keeps 4 times as
    # many (the mean of the 4 uploads).
    ("nest64s2", "OUTER_NESTEROV K=64 sparse2, 64/256 of 4096",
     ["--k=64", "--averaging=nesterov", "--wire_dtype=sparse2",
      "--sparse_keep=64", "--sparse_result_keep=256"]),
    ("nest16s2", "OUTER_NESTEROV K=16 sparse2, 64/256 of 4096",
     ["--k=16", "--averaging=nesterov", "--wire_dtype=sparse2",
      "--sparse_keep=64", "--sparse_result_keep=256"]),
    ("mean16s2", "MEAN K=16 sparse2, 64/256 of 4096",
     ["--k=16", "--wire_dtype=sparse2", "--sparse_keep=64",
      "--sparse_result_keep=256"]),
    ("mean16s4k128", "MEAN K=16 sparse4, 128/512 of 4096",
     ["--k=16", "--wire_dtype=sparse4", "--sparse_keep=128",
      "--sparse_result_keep=512"]),
    ("mean8s2", "MEAN K=8 sparse2, 64/256 of 4096",
     ["--k=8", "--wire_dtype=sparse2", "--sparse_keep=64",
      "--sparse_result_keep=256"]),
    ("mean12s2", "MEAN K=12 sparse2, 64/256 of 4096",
     ["--k=12", "--wire_dtype=sparse2", "--sparse_keep=64",
      "--sparse_result_keep=256"]),
    # About 1100x at 1 epoch, four ways: a smaller step down, more kept and
    # fewer rounds, 4-bit values, a larger outer step.
    ("mean8s2r128", "MEAN K=8 sparse2, 64/128 of 4096",
     ["--k=8", "--wire_dtype=sparse2", "--sparse_keep=64",
      "--sparse_result_keep=128"]),
    ("mean16s2k96", "MEAN K=16 sparse2, 96/384 of 4096",
     ["--k=16", "--wire_dtype=sparse2", "--sparse_keep=96",
      "--sparse_result_keep=384"]),
    ("mean8s4k32", "MEAN K=8 sparse4, 32/128 of 4096",
     ["--k=8", "--wire_dtype=sparse4", "--sparse_keep=32",
      "--sparse_result_keep=128"]),
    ("sgd12s2", "OUTER_SGD lr 1.5 K=12 sparse2, 64/256 of 4096",
     ["--k=12", "--averaging=outer_sgd", "--outer_lr=1.5",
      "--wire_dtype=sparse2", "--sparse_keep=64",
      "--sparse_result_keep=256"]),
    ("none", "no averaging", ["--k=16", "--no_sync"]),
]


def sparse_arm(name):
    """An arm named <rule><K>s<bits>k<up>r<down>[e] (the rule, mean for MEAN
    or nest for OUTER_NESTEROV, every K steps on SPARSE2 or SPARSE4, `up`
    of 4096 kept in a member's upload, `down` in the coordinator's step; e:
    with error reset), or None."""
    m = re.fullmatch(r"(mean|nest)(\d+)s([24])k(\d+)r(\d+)(e?)", name)
    if not m:
        return None
    rule, k, bits, up, down, reset = m.groups()
    nesterov = rule == "nest"
    return (name,
            f"{'OUTER_NESTEROV' if nesterov else 'MEAN'} K={k} sparse{bits}, "
            f"{up}/{down} of 4096" + (", error reset" if reset else ""),
            [f"--k={k}", f"--wire_dtype=sparse{bits}", f"--sparse_keep={up}",
             f"--sparse_result_keep={down}"]
            + (["--averaging=nesterov"] if nesterov else [])
            + (["--error_reset"] if reset else []))


def field(name, line):
    m = re.search(r"\b%s=(\S+)" % re.escape(name), line)
    return m.group(1) if m else None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--arms", default=",".join(a[0] for a in ARMS))
    p.add_argument("--outer_lr", type=float, default=0,
                   help="for the nesterov arms; 0: the coordinator's 0.7")
    p.add_argument("--outer_momentum", type=float, default=0,
                   help="for the nesterov arms; 0: the coordinator's 0.9")
    p.add_argument("--worker_flags", default="",
                   help="extra flags for every worker, space separated")
    p.add_argument("--regions", type=int, default=0,
                   help="0: one coordinator; R >= 2: R regional "
                   "coordinators under one upstream")
    args = p.parse_args()
    if args.regions == 1 or (args.regions and args.workers % args.regions):
        sys.exit("[quality] --regions must be 0, or >= 2 and divide --workers")
    build = os.environ.get("BUILD_DIR", "build")
    coordinator = os.path.join(build, "server", "localsgd-coordinator")
    worker = os.path.join(build, "examples", "localsgd-fashion-mnist")
    for b in (coordinator, worker):
        if not os.access(b, os.X_OK):
            sys.exit(f"[quality] {b} not found; build first (BUILD_DIR=<dir>)")
    if not os.path.isdir("/usr/share/datasets/fashion-mnist"):
        print("[quality] skipped: dataset-fashion-mnist is not installed")
        sys.exit(77)
    seeds = [int(s) for s in args.seeds.split(",")]
    arms = []
    for name in dict.fromkeys(args.arms.split(",")):
        arm = next((a for a in ARMS if a[0] == name), None) or sparse_arm(name)
        if arm is None:
            sys.exit(f"[quality] unknown arm {name!r}: one of "
                     f"{', '.join(a[0] for a in ARMS)}, or "
                     "<mean|nest><K>s<2|4>k<up>r<down>[e]")
        if args.regions and "--error_reset" in arm[2]:
            sys.exit(f"[quality] {name}: error reset is the members' own "
                     "option on a lossy wire; with --regions the members' "
                     "wire is float32")
        arms.append(arm)

    tmp = tempfile.mkdtemp(prefix="localsgd-quality.")
    coords = []

    def launch(name, flags):
        """A coordinator on a free port; returns its port."""
        port_file = os.path.join(tmp, f"{name}.port")
        coords.append(subprocess.Popen(
            [coordinator, "--listen=127.0.0.1:0", f"--port_file={port_file}",
             "--metrics_listen="] + flags,
            stdout=open(os.path.join(tmp, f"{name}.log"), "w"),
            stderr=subprocess.STDOUT))
        for _ in range(300):
            if os.path.exists(port_file) and open(port_file).read().strip():
                return open(port_file).read().strip()
            if coords[-1].poll() is not None:
                sys.exit(f"[quality] coordinator {name} exited (logs in {tmp})")
            time.sleep(0.1)
        sys.exit(f"[quality] coordinator {name} wrote no port")

    def stop():
        for c in coords:
            c.terminate()
        for c in coords:
            c.wait()
        coords.clear()

    # A regional arm's rule and wire are the upstream's: the worker flags
    # that set them, as the upstream coordinator's defaults.
    upstream_flag = {"--averaging": "--averaging", "--wire_dtype": "--wire_dtype",
                     "--mean_encoding": "--mean_encoding",
                     "--sparse_keep": "--sparse_keep",
                     "--sparse_result_keep": "--sparse_result_keep",
                     "--outer_lr": "--outer_lr",
                     "--outer_momentum": "--outer_momentum"}
    try:
        # Each arm and seed is a job of its own, held until the run ends.
        max_jobs = [f"--max_jobs={max(64, len(arms) * len(seeds) + 1)}"]
        ports = [] if args.regions else [launch("coordinator", max_jobs)]
        results = {}
        for name, label, flags in arms:
            extra = list(flags)
            if "--averaging=nesterov" in flags:
                if args.outer_lr:
                    extra.append(f"--outer_lr={args.outer_lr}")
                if args.outer_momentum:
                    extra.append(f"--outer_momentum={args.outer_momentum}")
            if args.regions:
                up = [f.replace("=nesterov", "=outer_nesterov") for f in extra
                      if f.split("=")[0] in upstream_flag]
                extra = [f for f in extra if f.split("=")[0] not in upstream_flag]
                upstream = launch(f"{name}.upstream", up)
                ports = [launch(f"{name}.region{g}",
                               [f"--upstream=127.0.0.1:{upstream}",
                                f"--upstream_member=region-{g}",
                                f"--upstream_rendezvous={args.regions}"])
                         for g in range(args.regions)]
                extra.append(f"--rendezvous={args.workers // args.regions}")
            for seed in seeds:
                job = f"quality-{name}-{seed}-{os.getpid()}"
                procs = []
                start = time.time()
                for r in range(args.workers):
                    log = open(os.path.join(tmp, f"{name}.{seed}.{r}.log"), "w")
                    procs.append(subprocess.Popen(
                        [worker, "--coordinator=127.0.0.1:" +
                         ports[r * len(ports) // args.workers],
                         f"--job={job}", f"--world={args.workers}",
                         f"--rank={r}", f"--epochs={args.epochs}",
                         f"--seed={seed}", "--eval_every_sync=0",
                         "--log_every=1000"] + extra +
                        args.worker_flags.split(),
                        stdout=log, stderr=subprocess.STDOUT))
                rcs = [pr.wait() for pr in procs]
                seconds = time.time() - start
                if any(rcs):
                    for r in range(args.workers):
                        path = os.path.join(tmp, f"{name}.{seed}.{r}.log")
                        sys.stderr.write("".join(open(path).readlines()[-5:]))
                    sys.exit(f"[quality] {name} seed {seed}: a worker failed "
                             f"(logs in {tmp})")
                acc, bytes_ = None, []
                for r in range(args.workers):
                    path = os.path.join(tmp, f"{name}.{seed}.{r}.log")
                    final = [l for l in open(path) if f"rank={r} final " in l]
                    line = final[-1]
                    bytes_.append(int(field("bytes_sent", line)) +
                                  int(field("bytes_received", line)))
                    if r == 0:
                        acc = float(field("test_accuracy", line))
                results.setdefault(name, []).append(
                    (acc, statistics.mean(bytes_), seconds))
                print(f"[quality] {name} seed {seed}: accuracy {acc:.4f}, "
                      f"{statistics.mean(bytes_):.0f} bytes/worker, "
                      f"{seconds:.1f} s", file=sys.stderr, flush=True)
            if args.regions:
                stop()
    finally:
        stop()

    sync = results.get("sync")
    sync_acc = statistics.mean(x[0] for x in sync) if sync else None
    sync_bytes = statistics.mean(x[1] for x in sync) if sync else None
    print("| arm | test accuracy (mean ± spread) | vs synchronous (points) "
          "| bytes sent + received per worker | fewer bytes than synchronous |")
    print("|---|---|---|---|---|")
    for name, label, _ in arms:
        accs = [x[0] for x in results[name]]
        mean_acc = statistics.mean(accs)
        spread = (max(accs) - min(accs)) / 2
        b = statistics.mean(x[1] for x in results[name])
        vs = "" if sync_acc is None else f"{100 * (mean_acc - sync_acc):+.2f}"
        ratio = ("" if sync_bytes is None or b == 0
                 else f"{sync_bytes / b:.0f}x")
        print(f"| {label} | {mean_acc:.4f} ± {spread:.4f} | {vs} | "
              f"{b:,.0f} | {ratio} |")
    print()
    where = (f"in {args.regions} regions (regional coordinators, MEAN over "
             f"float32, under one upstream with the arm's rule and wire)"
             if args.regions else "with one coordinator")
    print(f"{args.workers} workers {where}, {args.epochs} epoch(s) over each "
          f"worker's shard, seeds {args.seeds}, {os.cpu_count()} cores.")


if __name__ == "__main__":
    main()
