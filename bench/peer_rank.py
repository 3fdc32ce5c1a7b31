#!/usr/bin/python3
"""One rank of the peer (../shared/bench/peer_accelerate_localsgd.py:
accelerate's LocalSGD sync, an all-reduce per tensor on torch.distributed's
gloo), run as its own process, so that bench/netns_scaleout.sh can put each
rank on its own network-namespace host, as it does our workers.

usage: peer_rank.py PEER_DIR RANK WORLD MILLIONS ROUNDS
  (MASTER_ADDR / MASTER_PORT: rank 0's address; GLOO_SOCKET_IFNAME: the
  host's interface). Rank 0 prints the peer's result line.
"""
import sys

peer_dir, rank, world, millions, rounds = sys.argv[1:6]
sys.path.insert(0, peer_dir)
import peer_accelerate_localsgd as peer  # noqa: E402

import statistics  # noqa: E402


class Report:
    """What the peer's worker hands its queue: rank 0's round times."""

    def put(self, times):
        total = int(float(millions) * 1e6)
        med = statistics.median(times)
        print(f"peer=accelerate-localsgd/gloo world={world} params={total} "
              f"rounds={rounds} median_s={med:.4f} min_s={min(times):.4f}",
              flush=True)


peer.worker(int(rank), int(world), int(float(millions) * 1e6), int(rounds),
            Report())
