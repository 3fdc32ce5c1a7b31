#!/usr/bin/python3
"""Goodput with slow and paused workers: step budgets and stale contributions.

Four Python workers train a small MLP (784-128-10) on Fashion-MNIST with the
README's LocalSGD (K=16, MEAN, SGD lr 0.05 momentum 0.9, batch 64, one
thread each) against one coordinator, for the same wall-clock budget in
every arm (the four clocks start together once all have joined, and a pause
ends at the budget's end), then make their final syncs, and report:

  goodput   local steps whose effect entered the global state / local steps
            computed (the coordinator's count: JobStatus.goodput, from the
            steps every Sync says)
  idle      the fast workers' time inside LocalSGD syncs / wall time (mean
            over the fast workers)
  accuracy  the test accuracy of the job's state once every worker has made
            its final sync and left (a fifth process joins the job, adopts
            the state, evaluates it and leaves); the workers' own models
            after their final syncs are in accuracy_per_rank (a member
            whose last delta was banked holds the state before the round
            that merges it)

Scenarios: `slow`: worker 3 takes 3x as long per step as the others (a step
is its compute plus a sleep that makes it STEP_MS, or 3 x STEP_MS); `pause`:
every PAUSE_EVERY rounds' time a random worker pauses for 1-5 rounds' time
(the schedule drawn from the seed). Modes, each a coordinator configuration:

  sync      fixed deadline, none: every round waits for every member
  adaptive  --deadline_mode=adaptive (a persistent straggler adopts)
  goodput   adaptive + --max_staleness=8 + --step_budget=adaptive
  allfast   all four workers fast (no slow worker, no pauses), sync, each
            stopping at the mean steps per worker of the scenario's goodput
            arm of the same seed: equal total samples

Usage: bench/goodput.py [--seeds 1,2,3] [--seconds 60] [--scenarios slow,pause]
                        [--modes sync,adaptive,goodput] [--trace_s S]
Environment: BUILD_DIR (build). Needs dataset-fashion-mnist and python3-torch.
"""

import argparse
import gzip
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

K = 16
STEP_MS = 20.0
WORKERS = 4
SLOW_FACTOR = 3.0
PAUSE_EVERY = 4  # rounds' time between pauses
DATA = "/usr/share/datasets/fashion-mnist"

MODES = {
    "sync": ["--deadline_mode=fixed"],
    "adaptive": ["--deadline_mode=adaptive"],
    "goodput": ["--deadline_mode=adaptive", "--max_staleness=8",
                "--step_budget=adaptive"],
    "allfast": ["--deadline_mode=fixed"],
}


def load_idx(train):
    import numpy as np
    prefix = "train" if train else "t10k"
    with gzip.open(os.path.join(DATA, f"{prefix}-images-idx3-ubyte.gz")) as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16)
    with gzip.open(os.path.join(DATA, f"{prefix}-labels-idx1-ubyte.gz")) as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8)
    return images.reshape(-1, 784).astype(np.float32) / 255.0, \
        labels.astype(np.int64)


def worker(a):
    """One worker: trains until its deadline (or max_steps), then a final
    sync; prints one JSON line of what it measured."""
    import numpy as np
    import torch
    from localsgd import LocalSGD
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    images, labels = load_idx(True)
    rng = np.random.default_rng(a.seed * 100 + a.rank)
    # Each rank its quarter of the training set.
    idx = np.arange(a.rank, len(labels), WORKERS)
    model = torch.nn.Sequential(torch.nn.Linear(784, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    pauses = json.loads(a.pauses)
    step_s = a.step_ms / 1000.0
    test_x, test_y = load_idx(False)
    test_x = torch.from_numpy(test_x)

    def accuracy():
        with torch.no_grad():
            pred = model(test_x).argmax(1).numpy()
        return float((pred == test_y).mean())
    trace = []
    with LocalSGD(model, coordinator=a.coordinator, job="goodput",
                  local_sgd_steps=K, member_name=f"w{a.rank}",
                  rendezvous=WORKERS,
                  keep_training_when_unavailable=False) as local_sgd:
        # Every worker starts its clock at once, when all four have joined
        # (so that their final syncs meet in one round).
        open(os.path.join(a.barrier, f"ready.{a.rank}"), "w").close()
        while len(os.listdir(a.barrier)) < WORKERS:
            time.sleep(0.005)
        start = time.monotonic()
        deadline = start + a.seconds
        steps = 0
        while time.monotonic() < deadline and \
                (a.max_steps == 0 or steps < a.max_steps):
            now = time.monotonic() - start
            for w, at, length in pauses:
                if w == a.rank and at <= now < at + length:
                    time.sleep(min(at + length, a.seconds) - now)
            t0 = time.monotonic()
            batch = rng.choice(idx, 64)
            x = torch.from_numpy(images[batch])
            y = torch.from_numpy(labels[batch])
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            spent = time.monotonic() - t0
            if spent < step_s:
                time.sleep(step_s - spent)
            local_sgd.step()
            steps += 1
            if a.trace_s and a.rank == 0 and time.monotonic() - start >= \
                    a.trace_s * (len(trace) + 1):
                trace.append(round(accuracy(), 4))
        wall = time.monotonic() - start
        idle = local_sgd.sync_seconds_total
    print(json.dumps({"rank": a.rank, "steps": steps, "wall": wall,
                      "idle": idle, "accuracy": accuracy(), "trace": trace}),
          flush=True)


def evaluate(a):
    """Joins the job once the workers have left, adopts its state (the
    global state: what the last round left) and prints its test accuracy."""
    import torch
    from localsgd import LocalSGD
    torch.set_num_threads(1)
    test_x, test_y = load_idx(False)
    model = torch.nn.Sequential(torch.nn.Linear(784, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10))
    local_sgd = LocalSGD(model, coordinator=a.coordinator, job="goodput",
                         local_sgd_steps=K, member_name="evaluator",
                         rendezvous=WORKERS)
    try:
        with torch.no_grad():
            pred = model(torch.from_numpy(test_x)).argmax(1).numpy()
        print(json.dumps({"accuracy": float((pred == test_y).mean()),
                          "round": local_sgd.state_round}), flush=True)
    finally:
        local_sgd.abandon()


def start_coordinator(binary, tmp, flags):
    port_file = os.path.join(tmp, "grpc.port")
    http_file = os.path.join(tmp, "http.port")
    for f in (port_file, http_file):
        if os.path.exists(f):
            os.remove(f)
    proc = subprocess.Popen(
        [binary, "--listen=127.0.0.1:0", f"--port_file={port_file}",
         "--http_listen=127.0.0.1:0", f"--http_port_file={http_file}",
         "--metrics_listen=", "--lease_ttl=10s"] + flags,
        stdout=open(os.path.join(tmp, "coordinator.log"), "a"),
        stderr=subprocess.STDOUT)
    for _ in range(300):
        ready = all(os.path.exists(f) and open(f).read().strip()
                    for f in (port_file, http_file))
        if ready:
            return (proc, open(port_file).read().strip(),
                    open(http_file).read().strip())
        if proc.poll() is not None:
            sys.exit(f"[goodput] the coordinator exited (see {tmp})")
        time.sleep(0.1)
    sys.exit("[goodput] the coordinator did not start")


def job_status(http_port):
    with urllib.request.urlopen(
            f"http://127.0.0.1:{http_port}/api/v1/status?job=goodput",
            timeout=5) as r:
        body = json.load(r)
    jobs = body.get("jobs", [body])
    return jobs[0]


def pause_schedule(seed, seconds):
    """(worker, start s, length s): every PAUSE_EVERY rounds' time, a random
    worker pauses for 1-5 rounds' time."""
    rng = random.Random(seed)
    round_s = K * STEP_MS / 1000.0
    out, t = [], 2.0
    while t < seconds:
        length = rng.randint(1, 5) * round_s
        out.append((rng.randrange(WORKERS), t, length))
        t += length + PAUSE_EVERY * round_s
    return out


def run_arm(binary, tmp, scenario, mode, seed, seconds, max_steps=0,
            trace_s=0):
    proc, port, http = start_coordinator(binary, tmp, MODES[mode])
    try:
        pauses = pause_schedule(seed, seconds) \
            if scenario == "pause" and mode != "allfast" else []
        procs = []
        barrier = tempfile.mkdtemp(prefix="barrier-", dir=tmp)
        for rank in range(WORKERS):
            slow = scenario == "slow" and rank == WORKERS - 1 and \
                mode != "allfast"
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--worker",
                 f"--coordinator=127.0.0.1:{port}", f"--rank={rank}",
                 f"--seed={seed}", f"--seconds={seconds}",
                 f"--max_steps={max_steps}", f"--trace_s={trace_s}",
                 f"--barrier={barrier}",
                 f"--step_ms={STEP_MS * (SLOW_FACTOR if slow else 1)}",
                 f"--pauses={json.dumps(pauses)}"],
                stdout=subprocess.PIPE, stderr=open(
                    os.path.join(tmp, f"w{rank}.log"), "a"), text=True))
        results = []
        for p in procs:
            out, _ = p.communicate(timeout=seconds + 600)
            if p.returncode != 0:
                sys.exit(f"[goodput] a worker failed (see {tmp})")
            results.append(json.loads(out.strip().splitlines()[-1]))
        status = job_status(http)
        out = subprocess.run(
            [sys.executable, __file__, "--evaluate",
             f"--coordinator=127.0.0.1:{port}"], check=True, timeout=300,
            stdout=subprocess.PIPE, text=True).stdout
        global_state = json.loads(out.strip().splitlines()[-1])
    finally:
        proc.terminate()
        proc.wait()
    results.sort(key=lambda r: r["rank"])
    slow_ranks = {WORKERS - 1} if scenario == "slow" and mode != "allfast" \
        else set()
    fast = [r for r in results if r["rank"] not in slow_ranks]
    steps = status.get("steps", {})
    merged = int(steps.get("merged", 0))
    computed = sum(r["steps"] for r in results)
    return {
        "goodput": float(status.get("goodput", 0.0)),
        "merged_over_computed": merged / computed if computed else 0.0,
        "idle": statistics.mean(r["idle"] / r["wall"] for r in fast),
        "accuracy": global_state["accuracy"],
        "accuracy_per_rank": [r["accuracy"] for r in results],
        "trace": results[0]["trace"],
        "steps": [r["steps"] for r in results],
        "stale": int(steps.get("merged_stale", 0)),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--evaluate", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--coordinator")
    p.add_argument("--rank", type=int)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--max_steps", type=int, default=0)
    p.add_argument("--trace_s", type=float, default=0,
                   help="rank 0 also records its model's test accuracy "
                   "every this many seconds (0: never)")
    p.add_argument("--step_ms", type=float, default=STEP_MS)
    p.add_argument("--pauses", default="[]")
    p.add_argument("--barrier", help=argparse.SUPPRESS)
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--scenarios", default="slow,pause")
    p.add_argument("--modes", default="sync,adaptive,goodput")
    p.add_argument("--allfast", action=argparse.BooleanOptionalAction,
                   default=True, help="run the all-fast reference too")
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    if a.evaluate:
        evaluate(a)
        return
    if not os.path.isdir(DATA):
        print("[goodput] skipped: dataset-fashion-mnist is not installed")
        return
    build = os.environ.get("BUILD_DIR", "build")
    binary = os.path.join(build, "server", "localsgd-coordinator")
    os.environ["PYTHONPATH"] = os.path.join(build, "python") + \
        os.pathsep + os.environ.get("PYTHONPATH", "")
    tmp = tempfile.mkdtemp(prefix="goodput-")
    seeds = [int(s) for s in a.seeds.split(",")]
    rows = {}
    for seed in seeds:
        for scenario in a.scenarios.split(","):
            for mode in a.modes.split(","):
                r = run_arm(binary, tmp, scenario, mode, seed, a.seconds,
                            trace_s=a.trace_s)
                rows.setdefault((scenario, mode), []).append(r)
                print(f"[goodput] {scenario} {mode} seed {seed}: "
                      f"{json.dumps(r)}", flush=True)
                if a.allfast and mode == "goodput":
                    cap = round(sum(r["steps"]) / WORKERS)
                    f = run_arm(binary, tmp, scenario, "allfast", seed,
                                a.seconds * 2, max_steps=cap,
                                trace_s=a.trace_s)
                    rows.setdefault((f"all fast ({scenario}'s samples)",
                                     "sync"), []).append(f)
                    print(f"[goodput] allfast {scenario} seed {seed}: "
                          f"{json.dumps(f)}", flush=True)
    print()
    print("| scenario | mode | goodput | fast idle | accuracy | "
          "accuracy per seed | stale steps | steps per worker |")
    print("|---|---|---|---|---|---|---|---|")
    for (scenario, mode), rs in rows.items():
        def mean(key):
            return statistics.mean(r[key] for r in rs)
        steps = [round(statistics.mean(r["steps"][i] for r in rs))
                 for i in range(WORKERS)]
        per_seed = ", ".join(f"{r['accuracy']:.4f}" for r in rs)
        print(f"| {scenario} | {mode} | {mean('goodput'):.3f} | "
              f"{100 * mean('idle'):.1f}% | {mean('accuracy'):.4f} | "
              f"{per_seed} | {round(mean('stale'))} | {steps} |")
    print(f"\n({len(seeds)} seeds, {a.seconds:g} s each; logs in {tmp})")


if __name__ == "__main__":
    main()
