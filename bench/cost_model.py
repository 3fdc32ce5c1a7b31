#!/usr/bin/python3
"""A model of a round's time and a coordinator's memory, past one machine.

Round time of one job of pseudo-gradients, from its sizes and its links:

  flat (W members, S coordinator shards; every member's link R_w, every
  coordinator's R_c; members behind an uplink of rate R_u shared by W_u of
  them, if any):
    T_link = max over links and directions of bytes / rate, where
      a member's link carries P x up out and P x down in,
      a coordinator's carries W x P x up / S in and W x P x down / S out,
      an uplink carries W_u x P x up one way and W_u x P x down the other;
    round = KAPPA x T_link  (+ the CPU, below)
  Upload and download overlap chunk by chunk (per-chunk finality), so each
  direction of each link is a bound of its own; KAPPA covers the pipeline's
  fill and drain, TCP and gRPC framing.

  regional (G regions of W_g members, a regional coordinator each on a link
  of R_r, each region's uplink R_u, the upstream on R_U): a regional round
  is pipelined down, not up: the region's uploads, then the exchange with
  the upstream while the region's downloads follow the upstream's result
  chunk by chunk:
    round = KAPPA x (W_g x P x 4 / R_r            the region's float32 uploads
                     + max(P x up_U / R_u, G x P x up_U / R_U, same down,
                                                  one contribution up, one down,
                           W_g x P x 4 / R_r))    the region's downloads

  CPU: each process's core-seconds a round, from CPU_NS (below): a
  member's P x CPU_NS.member, a shard's (W x P x per_member + P x step) /
  S, both measured here per wire by sync_bench (they hold what the process
  spends in gRPC and the kernel's TCP as well as its passes over the
  model).
  Where a process has cores of its own they run while the links carry the
  chunks and add only where they are slower: the round is KAPPA x
  max(T_link, the member's CPU, a shard's CPU / its cores). Where one
  machine's C cores run every member and coordinator (this one: 2 cores
  for 4-8 members and 1-4 coordinators; plan's `--shared_cores`), their
  CPU adds up: that term is the sum over every process / (C x BUSY), BUSY
  the share of the cores they keep busy (0.94 here), and the round the
  largest of it and KAPPA x the others.

  The per-element costs come from `calibrate`, a least-squares fit to
  sync_bench's CPU counts on loopback at two or more member counts (the
  coordinator's share grows with W, its step's does not; with two, the fit
  is exact). The kernel counts the coordinator's CPU in 10 ms ticks: over
  7 rounds, +-1.5 ms a round. Measured with 5-9 processes on 2 cores, the
  costs are an upper bound for processes with cores of their own, and a
  member's CPU is counted as if on one core.

Memory of one coordinator shard (docs/deployment.md "Sizing a
coordinator's memory"): B x P / S + 32 MiB + W x 1.1 MiB, B the bytes per
parameter its rule and wire keep (mean float32: 16).

  bench/cost_model.py validate     every point measured here against the
                                   model, with the error
  bench/cost_model.py calibrate [--params 1e7] RAW.tsv...
                                   CPU_NS and BUSY from sync_round.sh's
                                   raw.tsv (two or more WORLDS), for
                                   another machine
  bench/cost_model.py plan --params 70e9 --members 10000 --wire int4 \\
      [--rule outer_nesterov] [--member_gbit 100] [--coordinator_gbit 100] \\
      [--regions 0] [--uplink_gbit 10] [--max_memory_gib 512] \\
      [--coordinator_cores 16] [--shared_cores 0]
                                   the shards (and whether regions pay) a
                                   size needs
"""

import argparse
import math
import os
import sys

KAPPA = 1.12
# The share of a machine's cores that its members and coordinators keep
# busy when they share them (the mean of the calibration runs).
BUSY = 0.94

# Bytes per element on the wire, up (a member's delta) and down (the
# coordinator's result), at the defaults (int8/int4: one float32 scale per
# block of 64; sparse2: 64 of 4096 kept up, 256 down, 88 and 264 bytes a
# block of 4096 with Elias-Fano positions).
WIRE = {
    "float32": (4.0, 4.0),
    "bfloat16": (2.0, 2.0),
    "int8": (1.0625, 1.0625),
    "int4": (0.5625, 0.5625),
    "sparse2": (88 / 4096, 264 / 4096),
}

# Core-nanoseconds a round costs each process, per wire (`calibrate` on
# sync_round.sh's raw.tsv, WORLDS="4 8" MILLIONS=10, on CALIBRATED_ON; the
# 2-core VM, every process on the same 2 cores): `member` per parameter (its
# delta, encode, send, receive, decode onto its anchor), `per_member` a
# coordinator's per parameter per member (receive, decode, accumulate, send
# the result), `step` its per parameter (the rule and the result's encode).
CALIBRATED_ON = "d1105b6"
CPU_NS = {
    "float32": dict(member=3.43, per_member=2.61, step=1.29),
    "bfloat16": dict(member=3.63, per_member=2.14, step=3.29),
    "int8": dict(member=2.74, per_member=1.18, step=2.14),
    "int4": dict(member=2.54, per_member=0.96, step=1.71),
    "sparse2": dict(member=3.21, per_member=0.43, step=3.29),
}


# Bytes per parameter a coordinator keeps (docs/deployment.md).
def state_bytes(wire, rule, mean_encoding="float32"):
    b = 8 + 2 * WIRE[wire][1]
    if rule != "mean":
        b += 8
    lossy = wire != "float32"
    if lossy and not (rule == "mean" and mean_encoding == "wire"):
        b += 8
    if mean_encoding == "wire":
        b += 8
    return b


def gbit(x):
    return x * 1e9 / 8


def flat_terms(P, W, S, wire, member_bps, coordinator_bps, uplink_bps=None,
               per_uplink=0, cores=1, shared_cores=0):
    """Each bound of a flat round, in seconds: the links (the busier
    direction) and the busiest process's CPU, a member's or a shard's on
    `cores` cores (its streams' chunks are reduced on gRPC's threads, in
    parallel across streams); with `shared_cores`, every process's CPU on
    that many cores of one machine."""
    c = CPU_NS[wire]
    b = max(WIRE[wire])
    member = P * c["member"] * 1e-9
    coordinators = (W * P * c["per_member"] + P * c["step"]) * 1e-9
    terms = {
        "members' links": P * b / member_bps,
        "members' CPU": member,
        "coordinators' links": W * P * b / S / coordinator_bps,
        "coordinators' CPU": coordinators / S / cores,
    }
    if shared_cores:
        terms["the machine's cores"] = (W * member + coordinators) / shared_cores
    if uplink_bps:
        terms["uplinks"] = per_uplink * P * b / uplink_bps
    return terms


def scaled(terms):
    """Each bound as the round time it gives: KAPPA x a link's or a
    process's; the shared cores' sum over their busy share."""
    return {k: v / BUSY if k == "the machine's cores" else KAPPA * v
            for k, v in terms.items()}


def flat_round(*args, **kwargs):
    return max(scaled(flat_terms(*args, **kwargs)).values())


def regional_round(P, G, Wg, wire, regional_bps, uplink_bps, upstream_bps):
    up, down = WIRE[wire]
    inside = Wg * P * 4 / regional_bps
    across = max(P * max(up, down) / uplink_bps,
                 G * P * max(up, down) / upstream_bps)
    return KAPPA * (inside + max(across, inside))


def memory_mib(P, W, S, wire, rule):
    return state_bytes(wire, rule) * P / S / 2**20 + 32 + 1.1 * W


# Every point measured here (bench/README.md "The cost model's points",
# "Regional coordinators"): (what, predicted s, measured s, commit). The
# flat points on netns and loopback were measured one after the other with
# the calibration (`calibrate`), on one machine whose 2 cores run every
# member and coordinator; the regional ones are bound by their links.
POINTS_ON = "d1105b6"
# (shards, wire, measured s)
NETNS_FLAT = [(1, "float32", 3.712), (4, "float32", 1.007),
              (1, "int4", 0.501), (4, "int4", 0.240),
              (1, "sparse2", 0.210), (4, "sparse2", 0.211)]
# (members, wire, measured s)
LOOPBACK = [(4, "float32", 0.340), (4, "bfloat16", 0.342),
            (4, "int8", 0.225), (4, "int4", 0.227), (4, "sparse2", 0.228),
            (8, "float32", 0.659), (8, "bfloat16", 0.657),
            (8, "int8", 0.429), (8, "int4", 0.406), (8, "sparse2", 0.408)]


def points():
    G1, M100 = gbit(1), gbit(0.1)
    P = 25e6
    rows = []
    for s, wire, measured in NETNS_FLAT:
        rows.append((f"netns 1 Gbit/s, W=4, 25M, {s} shard(s), {wire}",
                     flat_round(P, 4, s, wire, G1, G1, shared_cores=2),
                     measured, POINTS_ON))
    for wire, flat, regional in [("float32", 38.524, 12.053),
                                 ("int4", 4.759, 7.077)]:
        rows.append((f"netns, 2 regions of 4 flat over 100 Mbit/s uplinks, "
                     f"25M, {wire}",
                     flat_round(P, 8, 1, wire, G1, G1, M100, 4,
                                shared_cores=2), flat, "bdcc431"))
        rows.append((f"netns, the same regional ({wire} upstream)",
                     regional_round(P, 2, 4, wire, G1, M100, G1), regional,
                     "bdcc431"))
    # Loopback: no link of its own; moving the bytes is CPU, in CPU_NS.
    for w, wire, measured in LOOPBACK:
        rows.append((f"loopback, W={w}, 25M, {wire}",
                     flat_round(P, w, 1, wire, math.inf, math.inf,
                                shared_cores=2), measured, POINTS_ON))
    return rows


def validate():
    print("| point | model s | measured s | error | commit |")
    print("|---|---:|---:|---:|---|")
    worst = 0.0
    for what, predicted, measured, commit in points():
        err = (predicted - measured) / measured
        worst = max(worst, abs(err))
        print(f"| {what} | {predicted:.3f} | {measured:.3f} | {100 * err:+.1f}% "
              f"| {commit} |")
    print()
    print(f"KAPPA = {KAPPA}; CPU_NS calibrated on {CALIBRATED_ON} at 10M "
          f"parameters; the largest error: {100 * worst:.1f}%. Every flat "
          "point runs its members and coordinators on this machine's 2 cores "
          "(--shared_cores 2); the regional ones are bound by their links.")
    return worst


def fit_cpu(paths, params=0, cores=0):
    """CPU_NS and BUSY from sync_round.sh raw.tsv files (only the rows of
    `params` parameters, if given), each to two decimals as the model holds
    them: per wire, the members' mean CPU per parameter, and the
    coordinator's CPU fitted as W x P x per_member + P x step (least squares
    over the rows' W and P); BUSY, the mean share of the machine's `cores`
    that the runs kept busy. Also the rows, per wire: (W, P, a worker's CPU
    s, the coordinator's CPU s)."""
    cores = cores or os.cpu_count()
    rows, busy = {}, []
    for path in paths:
        with open(path) as f:
            for line in f:
                kv = dict(x.split("=", 1) for x in line.split() if "=" in x)
                if "worker_cpu_s" not in kv or "coordinator_cpu_s" not in kv:
                    continue
                # sync_round's grid rows only (its rss rows run 2 rounds of
                # float32 alone), each with the coordinator's CPU read.
                if not line.startswith("grid\t"):
                    continue
                if params and float(kv["params"]) != params:
                    continue
                if float(kv["coordinator_cpu_s"]) < 0:
                    continue
                busy.append((int(kv["world"]) * float(kv["worker_cpu_s"]) +
                             float(kv["coordinator_cpu_s"])) /
                            (cores * float(kv["median_s"])))
                rows.setdefault(kv["wire"], []).append(
                    (int(kv["world"]), float(kv["params"]),
                     float(kv["worker_cpu_s"]),
                     float(kv["coordinator_cpu_s"])))
    if not rows:
        sys.exit("calibrate: no RESULT with worker_cpu_s and "
                 "coordinator_cpu_s (sync_round.sh raw.tsv)")
    table = {}
    for wire, rs in sorted(rows.items()):
        member = sum(cpu / p for _, p, cpu, _ in rs) / len(rs) * 1e9
        # Normal equations of c = a x (W P) + b x P.
        sxx = sum((w * p) ** 2 for w, p, _, _ in rs)
        sxy = sum((w * p) * p for w, p, _, _ in rs)
        syy = sum(p * p for _, p, _, _ in rs)
        sxc = sum(w * p * c for w, p, _, c in rs)
        syc = sum(p * c for _, p, _, c in rs)
        det = sxx * syy - sxy * sxy
        if len({w for w, _, _, _ in rs}) < 2 or det == 0:
            sys.exit(f"calibrate: {wire} needs rows at two member counts")
        a = (sxc * syy - syc * sxy) / det * 1e9
        b = (sxx * syc - sxy * sxc) / det * 1e9
        table[wire] = dict(member=round(member, 2), per_member=round(a, 2),
                           step=round(b, 2))
    return table, round(sum(busy) / len(busy), 2), rows


def calibrate(paths, params=0, cores=0):
    """Prints fit_cpu's CPU_NS and BUSY as Python to paste into this file,
    with each row's coordinator CPU against the fit."""
    table, busy, rows = fit_cpu(paths, params, cores)
    print("CPU_NS = {")
    for wire, c in table.items():
        print(f'    "{wire}": dict(member={c["member"]:.2f}, '
              f'per_member={c["per_member"]:.2f}, step={c["step"]:.2f}),')
        for w, p, _, cpu in rows[wire]:
            fit = (w * p * c["per_member"] + p * c["step"]) * 1e-9
            print(f"    # W={w} P={p:.3g}: coordinator {cpu:.4f} s, fit "
                  f"{fit:.4f} s")
    print("}")
    n = sum(len(rs) for rs in rows.values())
    print(f"BUSY = {busy:.2f}  # {n} runs on {cores or os.cpu_count()} cores")


def plan(args):
    if args.regions and args.shared_cores:
        sys.exit("plan: --regions with --shared_cores is not modelled (a "
                 "regional round has no CPU term; regions imply machines of "
                 "their own)")
    P, W = args.params, args.members
    wire, rule = args.wire, args.rule
    mbps, cbps = gbit(args.member_gbit), gbit(args.coordinator_gbit)
    print(f"{P:.3g} parameters, {W} members, wire {wire}, rule {rule}; "
          f"members at {args.member_gbit} Gbit/s, coordinators at "
          f"{args.coordinator_gbit} Gbit/s")
    best = None
    print("| shards | round s | bound by | memory per shard GiB |")
    print("|---:|---:|---|---:|")
    for s in [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]:
        terms = scaled(flat_terms(P, W, s, wire, mbps, cbps,
                                  cores=args.coordinator_cores,
                                  shared_cores=args.shared_cores))
        bound = max(terms, key=terms.get)
        t = terms[bound]
        mem = memory_mib(P, W, s, wire, rule) / 1024
        # What the members alone take: their links and CPU, and where they
        # share a machine's cores with the coordinators, those cores.
        member_floor = max(terms["members' links"], terms["members' CPU"],
                           terms.get("the machine's cores", 0))
        print(f"| {s} | {t:.2f} | {bound} | {mem:.1f} |")
        if best is None and mem <= args.max_memory_gib and \
                t <= member_floor * 1.25:
            best = (s, t)
    if best:
        print(f"\n{best[0]} shard(s): within 25% of what the members alone "
              f"take (their links and passes) "
              f"({best[1]:.2f} s a round) and within {args.max_memory_gib} GiB "
              "per shard.")
    else:
        print("\nNo shard count up to 4096 fits: more memory or cores per "
              "shard, a smaller wire, or regions.")
    if args.regions:
        g = args.regions
        per = math.ceil(W / g)
        ubps = gbit(args.uplink_gbit)
        flat = flat_round(P, W, best[0] if best else 1, wire, mbps, cbps,
                          ubps, per, args.coordinator_cores,
                          shared_cores=args.shared_cores)
        reg = regional_round(P, g, per, wire, cbps, ubps, cbps)
        print(f"\n{g} regions of {per} members, uplinks {args.uplink_gbit} "
              f"Gbit/s: flat across the uplinks {flat:.2f} s, regional "
              f"{reg:.2f} s a round: regions "
              f"{'pay' if reg < flat else 'do not pay'} "
              f"({reg / flat:.2f}x).")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("validate")
    c = sub.add_parser("calibrate")
    c.add_argument("raw", nargs="+", help="sync_round.sh raw.tsv files")
    c.add_argument("--params", type=float, default=0,
                   help="only the rows of this many parameters")
    c.add_argument("--cores", type=int, default=0,
                   help="the cores the runs shared (default: this machine's)")
    q = sub.add_parser("plan")
    q.add_argument("--params", type=float, required=True)
    q.add_argument("--members", type=int, required=True)
    q.add_argument("--wire", default="float32", choices=sorted(WIRE))
    q.add_argument("--rule", default="mean",
                   choices=["mean", "outer_nesterov", "outer_sgd"])
    q.add_argument("--member_gbit", type=float, default=100)
    q.add_argument("--coordinator_gbit", type=float, default=100)
    q.add_argument("--regions", type=int, default=0)
    q.add_argument("--uplink_gbit", type=float, default=10)
    q.add_argument("--max_memory_gib", type=float, default=512)
    q.add_argument("--coordinator_cores", type=int, default=16)
    q.add_argument("--shared_cores", type=int, default=0,
                   help="the cores of one machine that runs every member "
                   "and coordinator (0: each has its own)")
    args = p.parse_args()
    if args.cmd == "validate":
        worst = validate()
        sys.exit(0 if worst <= 0.15 else 1)
    if args.cmd == "calibrate":
        calibrate(args.raw, args.params, args.cores)
        return
    plan(args)


if __name__ == "__main__":
    main()
