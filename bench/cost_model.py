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

  CPU: where a process has cores of its own, its passes over the model
  (a member's encode and decode; a shard's decode-and-accumulate of W
  contributions and its step) run while the links carry the chunks, and
  add only where they are slower than the links. The model takes them as
  max(T_link, T_cpu) with T_cpu the busiest process's elements over its
  kernels' rates (bench/README.md "Blockwise codes", "Sparse codes").
  Where every process shares a few cores (this machine: 2 cores for 4
  members and up to 4 coordinators) the CPU adds up across processes: the
  model does not cover that (it says which measured points it is).

Memory of one coordinator shard (docs/deployment.md "Sizing a
coordinator's memory"): B x P / S + 32 MiB + W x 1.1 MiB, B the bytes per
parameter its rule and wire keep (mean float32: 16).

  bench/cost_model.py validate     every point measured here against the
                                   model, with the error
  bench/cost_model.py plan --params 70e9 --members 10000 --wire int4 \\
      [--rule outer_nesterov] [--member_gbit 100] [--coordinator_gbit 100] \\
      [--regions 0] [--uplink_gbit 10] [--max_memory_gib 512] \\
      [--coordinator_cores 16]
                                   the shards (and whether regions pay) a
                                   size needs
"""

import argparse
import math
import sys

KAPPA = 1.12

# Bytes per element on the wire, up (a member's delta) and down (the
# coordinator's result), at the defaults (int8/int4: one float32 scale per
# block of 64; sparse2: 64 of 4096 kept up, 256 down, 88 and 264 bytes a
# block of 4096 with Elias-Fano positions; "sparse2-12bit": the same with
# the 12-bit positions of the points measured on 178f71b, 120 and 456).
WIRE = {
    "float32": (4.0, 4.0),
    "bfloat16": (2.0, 2.0),
    "int8": (1.0625, 1.0625),
    "int4": (0.5625, 0.5625),
    "sparse2": (88 / 4096, 264 / 4096),
    "sparse2-12bit": (120 / 4096, 456 / 4096),
}

# Elements per second per core of the kernels a round runs (bench/README.md,
# on the machines measured): a member's encode with error feedback, its
# decode onto the anchor; a coordinator's decode and accumulate, its step's
# encode.
RATE = {
    "float32": dict(encode=7e9, decode=7e9, accumulate=7.3e9, step=3.8e9),
    "bfloat16": dict(encode=0.5e9, decode=8e9, accumulate=8e9, step=0.5e9),
    "int8": dict(encode=3.9e9, decode=5.5e9, accumulate=5.5e9, step=3.9e9),
    "int4": dict(encode=3.7e9, decode=2.7e9, accumulate=2.7e9, step=3.7e9),
    "sparse2": dict(encode=1.38e9, decode=12e9, accumulate=12e9, step=1.38e9),
    "sparse2-12bit": dict(encode=1.38e9, decode=12e9, accumulate=12e9,
                          step=1.38e9),
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
               per_uplink=0, cores=1):
    """Each bound of a flat round, in seconds: the links (the busier
    direction) and the busiest process's passes, a member's or a shard's on
    `cores` cores (its streams' chunks are reduced on gRPC's threads, in
    parallel across streams)."""
    r = RATE[wire]
    b = max(WIRE[wire])
    terms = {
        "members' links": P * b / member_bps,
        "members' CPU": P / r["encode"] + P / r["decode"],
        "coordinators' links": W * P * b / S / coordinator_bps,
        "coordinators' CPU":
            (W * P / S / r["accumulate"] + P / S / r["step"]) / cores,
    }
    if uplink_bps:
        terms["uplinks"] = per_uplink * P * b / uplink_bps
    return terms


def flat_round(*args, **kwargs):
    return KAPPA * max(flat_terms(*args, **kwargs).values())


def regional_round(P, G, Wg, wire, regional_bps, uplink_bps, upstream_bps):
    up, down = WIRE[wire]
    inside = Wg * P * 4 / regional_bps
    across = max(P * max(up, down) / uplink_bps,
                 G * P * max(up, down) / upstream_bps)
    return KAPPA * (inside + max(across, inside))


def memory_mib(P, W, S, wire, rule):
    return state_bytes(wire, rule) * P / S / 2**20 + 32 + 1.1 * W


# Every point measured here (bench/README.md "The encoded wires at their
# link bound", "Regional coordinators"): (what, predicted s, measured s,
# commit, whether the model covers it).
def points():
    G1, M100 = gbit(1), gbit(0.1)
    P = 25e6
    rows = []
    for s, wire, measured, commit in [
            (1, "float32", 3.668, "178f71b"), (4, "float32", 1.030, "178f71b"),
            (1, "int4", 0.500, "178f71b"), (4, "int4", 0.186, "178f71b"),
            (1, "sparse2-12bit", 0.153, "178f71b"),
            (4, "sparse2-12bit", 0.155, "178f71b")]:
        rows.append((f"netns 1 Gbit/s, W=4, 25M, {s} shard(s), {wire}",
                     flat_round(P, 4, s, wire, G1, G1), measured, commit,
                     s == 1 and not wire.startswith("sparse")))
    for wire, flat, regional in [("float32", 38.524, 12.053),
                                 ("int4", 4.759, 7.077)]:
        rows.append((f"netns, 2 regions of 4 flat over 100 Mbit/s uplinks, "
                     f"25M, {wire}",
                     flat_round(P, 8, 1, wire, G1, G1, M100, 4), flat,
                     "bdcc431", True))
        rows.append((f"netns, the same regional ({wire} upstream)",
                     regional_round(P, 2, 4, wire, G1, M100, G1), regional,
                     "bdcc431", True))
    # Loopback: 4 workers and the coordinator on 2 cores; links ~6.4 GB/s.
    lo = 6.4e9
    for wire, measured in [("float32", 0.231), ("int4", 0.142)]:
        rows.append((f"loopback, W=4, 25M, {wire} (2 cores shared)",
                     flat_round(P, 4, 1, wire, lo, lo), measured, "178f71b",
                     False))
    return rows


def validate():
    print("| point | model s | measured s | error | covered | commit |")
    print("|---|---:|---:|---:|---|---|")
    worst = 0.0
    for what, predicted, measured, commit, covered in points():
        err = (predicted - measured) / measured
        if covered:
            worst = max(worst, abs(err))
        print(f"| {what} | {predicted:.3f} | {measured:.3f} | {100 * err:+.0f}% "
              f"| {'yes' if covered else 'no: CPU shared'} | {commit} |")
    print()
    print(f"KAPPA = {KAPPA}; the largest error where the model applies: "
          f"{100 * worst:.0f}%. 'no: CPU shared': this machine's 2 cores run "
          "every member and coordinator, whose passes over the model then add "
          "up instead of overlapping the links.")
    return worst


def plan(args):
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
        terms = flat_terms(P, W, s, wire, mbps, cbps,
                           cores=args.coordinator_cores)
        bound = max(terms, key=terms.get)
        t = KAPPA * terms[bound]
        mem = memory_mib(P, W, s, wire, rule) / 1024
        member_floor = KAPPA * max(terms["members' links"],
                                   terms["members' CPU"])
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
                          ubps, per, args.coordinator_cores)
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
    args = p.parse_args()
    if args.cmd == "validate":
        worst = validate()
        sys.exit(0 if worst <= 0.15 else 1)
    plan(args)


if __name__ == "__main__":
    main()
