#!/usr/bin/python3
"""The sync cost of the Python binding against the C++ client, side by side.

Runs, in one invocation and against fresh coordinators of the same build:
  C++     bench/sync_bench (the C++ client, forked worker processes);
  Python  the same round through localsgd.Client from --world Python worker
          processes: the peer's tensor mix (t0, t1, ... fp32, as
          ../shared/bench/peer_accelerate_localsgd.py and sync_bench), one
          warm-up round, then --rounds rounds timed barrier to barrier
          (all workers pass a barrier; t0; Client.sync; all pass a barrier;
          t1), the result checked against the mean on sampled elements;
  and prints the median round time of each and Python / C++.

usage: bench/python_sync_bench.py [--build=build] [--world=4] [--millions=25]
                                  [--rounds=5] [--wire_dtype=float32]
"""
import argparse
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np


def shapes(total):
    out, left, i = [], total, 0
    while left > 0:
        n = min(left, [4_194_304, 1_048_576, 768, 3072][i % 4])
        out.append(n)
        left -= n
        i += 1
    return out


def start_coordinator(build, tmp, tag):
    port_file = os.path.join(tmp, f"{tag}.port")
    proc = subprocess.Popen(
        [os.path.join(build, "server", "localsgd-coordinator"),
         "--listen=127.0.0.1:0", f"--port_file={port_file}"],
        stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, f"{tag}.log"),
                                               "w"))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with open(port_file) as f:
                return proc, f"127.0.0.1:{int(f.read().strip())}"
        except (OSError, ValueError):
            time.sleep(0.05)
    proc.kill()
    sys.exit("the coordinator did not start")


def child(rank, args, target, barrier, times):
    sys.path.insert(0, os.path.join(args.build, "python"))
    import localsgd
    sizes = shapes(int(args.millions * 1e6))
    total = sum(sizes)
    client = localsgd.Client(target=target, job="bench-python",
                             member_name=f"py{rank}", rendezvous=args.world,
                             wire_dtype=args.wire_dtype)
    client.join([(f"t{i}", [n], "float32") for i, n in enumerate(sizes)])
    params = np.zeros(total, np.float32)
    client.initialize(params)
    sample = np.arange(0, total - 1, max(2, total // 1000))
    for round_ in range(args.rounds + 1):
        # Rank- and round-dependent values, outside the timed region.
        params[:] = np.float32(rank + 1 + round_)
        params[sample] += np.float32(0.5 * rank)
        barrier.wait()
        t0 = time.perf_counter()
        client.sync(params)
        barrier.wait()
        t1 = time.perf_counter()
        want = np.mean([r + 1 + round_ for r in range(args.world)])
        want_sample = want + np.mean([0.5 * r for r in range(args.world)])
        tol = {"float32": 1e-5, "bfloat16": 1 / 64, "int8": 1 / 64,
               "int4": 1 / 4}[args.wire_dtype]
        if abs(params[sample[0] + 1] - want) > tol * want or \
                np.max(np.abs(params[sample] - want_sample)) > \
                tol * want_sample:
            raise SystemExit(f"rank {rank}: wrong mean in round {round_}")
        if round_ > 0:
            times[rank * args.rounds + round_ - 1] = t1 - t0
    client.leave()
    client.close()


def python_arm(args, target):
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(args.world)
    times = ctx.Array("d", args.world * args.rounds)
    procs = [ctx.Process(target=child, args=(r, args, target, barrier, times))
             for r in range(args.world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
        if p.exitcode != 0:
            sys.exit(f"a Python worker failed (exit {p.exitcode})")
    # A round's time: the slowest worker's (barrier to barrier).
    per_round = [max(times[r * args.rounds + i] for r in range(args.world))
                 for i in range(args.rounds)]
    return statistics.median(per_round), per_round


def cpp_arm(args, target):
    r = subprocess.run(
        [os.path.join(args.build, "bench", "sync_bench"),
         f"--coordinator={target}", f"--world={args.world}",
         f"--millions={args.millions}", f"--rounds={args.rounds}",
         f"--wire_dtype={args.wire_dtype}", "--job_id=bench-cpp"],
        capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        sys.exit(f"sync_bench failed: {r.stderr[-2000:]}")
    line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT"))
    return float(re.search(r"median_s=([0-9.e+-]+)", line).group(1)), line


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--build", default="build")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--millions", type=float, default=25)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--wire_dtype", default="float32")
    args = p.parse_args()
    args.build = os.path.abspath(args.build)
    tmp = tempfile.mkdtemp(prefix="localsgd-python-bench.")
    results = {}
    for arm in ("cpp", "python"):
        proc, target = start_coordinator(args.build, tmp, arm)
        try:
            if arm == "cpp":
                results[arm], detail = cpp_arm(args, target)
            else:
                results[arm], detail = python_arm(args, target)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        print(f"{arm:>6}: median round {results[arm]:.3f} s  ({detail})",
              flush=True)
    print(f"world={args.world} params={args.millions}M wire={args.wire_dtype} "
          f"rounds={args.rounds}: C++ {results['cpp']:.3f} s, Python "
          f"{results['python']:.3f} s, Python/C++ "
          f"{results['python'] / results['cpp']:.3f}")


if __name__ == "__main__":
    main()
