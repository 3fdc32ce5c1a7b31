#!/usr/bin/python3
"""The Python twin of localsgd-fashion-mnist (examples/fashion_mnist_worker.cc):
the same CNN, data, data split, shuffles, flags and output lines, on PyTorch
with localsgd.LocalSGD, so that C++ and Python workers can train one job
(scripts/run-demo.sh with PYTHON_WORKERS=N).

  localsgd-coordinator --listen=127.0.0.1:50051 &
  for r in 0 1 2 3; do
    PYTHONPATH=build/python /usr/bin/python3 examples/fashion_mnist.py \\
      --coordinator=127.0.0.1:50051 --world=4 --rank=$r --k=16 &
  done; wait

Node-local averaging: run under torchrun (LOCAL_RANK, LOCAL_WORLD_SIZE,
RANK, WORLD_SIZE); the processes of a node average over a torch.distributed
group (gloo on CPU, NCCL on CUDA) and only local rank 0 syncs with the
coordinator, with weight LOCAL_WORLD_SIZE. --rank then defaults to RANK.

Output lines (stdout, as the C++ worker's): "rank=R start ...", "rank=R
step=S epoch=E loss=L", "rank=R sync round=... bytes_sent=... rejoined=...",
"rank=R eval round=... test_accuracy=...", "rank=R final ...".
"""
import argparse
import gzip
import os
import struct
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from localsgd import LocalSGD

PIXEL_MEAN, PIXEL_STD = 0.2860, 0.3530
EVAL_BATCH = 1000
MASK = (1 << 64) - 1


class Net(torch.nn.Module):
    """conv(1->8, 3x3) relu maxpool2, conv(8->16, 3x3) relu maxpool2,
    fc 400->64, relu, fc 64->10: the C++ worker's NetImpl, parameter for
    parameter (names, shapes, order), so both join the same layout."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 8, 3)
        self.conv2 = torch.nn.Conv2d(8, 16, 3)
        self.fc1 = torch.nn.Linear(16 * 5 * 5, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


# The C++ worker's portable shuffles (SplitMix64 + Fisher-Yates).
def splitmix64(state):
    state = (state + 0x9E3779B97F4A7C15) & MASK
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return state, z ^ (z >> 31)


def portable_shuffle(values, seed):
    state = seed & MASK
    for i in range(len(values), 1, -1):
        state, r = splitmix64(state)
        j = r % i
        values[i - 1], values[j] = values[j], values[i - 1]


def epoch_seed(seed, rank, epoch):
    prime = 0x100000001B3
    return ((((seed * prime) & MASK) ^ (rank + 1)) * prime & MASK) ^ \
        (epoch + 1)


def load_idx(data_dir, train):
    prefix = "train" if train else "t10k"
    images_path = os.path.join(data_dir, f"{prefix}-images-idx3-ubyte.gz")
    labels_path = os.path.join(data_dir, f"{prefix}-labels-idx1-ubyte.gz")
    for p in (images_path, labels_path):
        if not os.path.exists(p):
            sys.exit(f"fashion_mnist.py: {p} not found (install Debian's "
                     "dataset-fashion-mnist, or pass --data_dir)")
    with gzip.open(images_path) as f:
        magic, n, rows, cols = struct.unpack(">IIII", f.read(16))
        if magic != 2051:
            sys.exit(f"fashion_mnist.py: {images_path}: not an IDX image file")
        pixels = np.frombuffer(f.read(n * rows * cols), np.uint8)
    with gzip.open(labels_path) as f:
        magic, m = struct.unpack(">II", f.read(8))
        if magic != 2049 or m != n:
            sys.exit(f"fashion_mnist.py: {labels_path}: bad IDX label file")
        labels = np.frombuffer(f.read(m), np.uint8)
    images = torch.from_numpy(pixels.copy()).view(n, 1, rows, cols)
    images = (images.float() / 255.0 - PIXEL_MEAN) / PIXEL_STD
    return images, torch.from_numpy(labels.astype(np.int64))


def evaluate(model, images, labels, device):
    model.eval()
    correct, loss_sum = 0, 0.0
    with torch.no_grad():
        for begin in range(0, images.size(0), EVAL_BATCH):
            x = images[begin:begin + EVAL_BATCH].to(device)
            y = labels[begin:begin + EVAL_BATCH].to(device)
            logits = model(x)
            loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
            correct += (logits.argmax(1) == y).sum().item()
    model.train()
    n = images.size(0)
    return correct / n, loss_sum / n


def parse_args():
    env = os.environ
    p = argparse.ArgumentParser(
        description="Trains a small CNN on Fashion-MNIST with Local SGD: "
        "every --k steps the workers' parameters are averaged by a localsgd "
        "coordinator (the Python twin of localsgd-fashion-mnist).")
    p.add_argument("--coordinator", default="127.0.0.1:50051")
    p.add_argument("--job", default="fashion-mnist")
    p.add_argument("--rank", type=int, default=int(env.get("RANK", 0)),
                   help="this worker's rank in [0, --world) (default $RANK)")
    p.add_argument("--world", type=int,
                   default=int(env.get("WORLD_SIZE", 1)),
                   help="workers (data shards); default $WORLD_SIZE")
    p.add_argument("--k", type=int, default=16)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max_steps", type=int, default=0)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--data_dir", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--wire_dtype", default="float32",
                   choices=["float32", "bfloat16", "int8", "int4"])
    p.add_argument("--contribution", default="pseudo_gradients",
                   choices=["pseudo_gradients", "parameters"])
    p.add_argument("--averaging", default="mean",
                   choices=["mean", "nesterov", "outer_nesterov", "outer_sgd"])
    p.add_argument("--outer_lr", type=float, default=0.0)
    p.add_argument("--outer_momentum", type=float, default=0.0)
    p.add_argument("--no_sync", action="store_true")
    p.add_argument("--log_every", type=int, default=50)
    p.add_argument("--eval_every_sync", type=int, default=1)
    p.add_argument("--eval_examples", type=int, default=0)
    p.add_argument("--rendezvous", type=int, default=-1)
    p.add_argument("--chunk_elements", type=int, default=0)
    p.add_argument("--dump_dir", default="")
    p.add_argument("--tls_ca", default="")
    p.add_argument("--tls_cert", default="")
    p.add_argument("--tls_key", default="")
    p.add_argument("--tls_server_name", default="")
    p.add_argument("--token_file", default="")
    args = p.parse_args()
    if not 0 <= args.rank < args.world:
        p.error(f"--rank={args.rank} must be in [0, --world={args.world})")
    if args.k < 1 or args.batch_size < 1 or args.epochs < 1:
        p.error("--k, --batch_size and --epochs must be >= 1")
    return args


def main():
    a = parse_args()
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    emit = lambda line: print(f"rank={a.rank} {line}", flush=True)  # noqa

    train_images, train_labels = load_idx(a.data_dir, True)
    test_images, test_labels = load_idx(a.data_dir, False)
    if a.eval_examples > 0:
        test_images = test_images[:a.eval_examples]
        test_labels = test_labels[:a.eval_examples]
    num_train = train_images.size(0)
    permutation = list(range(num_train))
    portable_shuffle(permutation, a.seed)
    shard = permutation[a.rank::a.world]
    steps_per_epoch = (num_train // a.world) // a.batch_size
    total_steps = steps_per_epoch * a.epochs
    if a.max_steps > 0:
        total_steps = min(total_steps, a.max_steps)

    torch.manual_seed(a.seed)
    model = Net().to(device)

    # A node of torchrun processes averages first (torch.distributed).
    group, local_size = None, int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if local_size > 1 and not a.no_sync:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        # torchrun numbers a node's processes contiguously; every process
        # creates every node's group, in the same order (new_group's rule).
        world = dist.get_world_size()
        if world % local_size:
            sys.exit(f"fashion_mnist.py: WORLD_SIZE={world} is not a "
                     f"multiple of LOCAL_WORLD_SIZE={local_size}")
        for first in range(0, world, local_size):
            g = dist.new_group(list(range(first, first + local_size)))
            if first <= dist.get_rank() < first + local_size:
                group = g
        emit(f"node_group local_rank={dist.get_rank(group)} "
             f"local_world_size={local_size} backend={dist.get_backend(group)}")
    leader = group is None or dist.get_rank(group) == 0
    local_sgd = LocalSGD(
        model, coordinator=a.coordinator if leader else None, job=a.job,
        local_sgd_steps=a.k, enabled=not a.no_sync,
        member_name=(f"node-rank{a.rank}x{local_size}" if group is not None
                     else f"rank{a.rank}"),
        wire_dtype=a.wire_dtype, contribution=a.contribution,
        averaging=a.averaging, outer_lr=a.outer_lr,
        outer_momentum=a.outer_momentum, chunk_elements=a.chunk_elements,
        # One member per node: a node group's leader alone joins.
        rendezvous=(a.world // local_size if group is not None else a.world)
        if a.rendezvous < 0 else a.rendezvous,
        tls_ca=a.tls_ca, tls_cert=a.tls_cert, tls_key=a.tls_key,
        tls_server_name=a.tls_server_name, token_file=a.token_file,
        process_group=group)
    numel = sum(p.numel() for p in model.parameters())

    def dump(what, round_):
        if not a.dump_dir:
            return
        flat = torch.cat([p.detach().cpu().float().reshape(-1)
                          for p in model.parameters()])
        flat.numpy().tofile(os.path.join(a.dump_dir,
                                         f"r{a.rank}_{what}{round_}.bin"))

    if local_sgd.enabled and leader:
        emit(f"joined state_round={local_sgd.state_round} elements={numel}")
    dump("init_round", local_sgd.state_round)
    emit(f"start world={a.world} k={a.k} batch_size={a.batch_size} "
         f"lr={a.lr:g} momentum={a.momentum:g} shard={len(shard)} "
         f"steps={total_steps} params={numel} device={device} "
         f"threads={a.threads} sync={0 if a.no_sync else 1} "
         f"wire_dtype={a.wire_dtype} contribution={a.contribution} "
         f"averaging={a.averaging} language=python")

    optimizer = torch.optim.SGD(model.parameters(), lr=a.lr,
                                momentum=a.momentum)
    model.train()
    losses = []
    step, evals_due, last_sync_start = 0, 0, 0.0
    train_start = time.monotonic()

    def sync_line():
        o = local_sgd.last_outcome
        return (f"sync round={o['round']} step={step} "
                f"seconds={local_sgd.sync_seconds_total - last_sync_start:.3f}"
                f" contributed={int(o.get('contributed', True))} "
                f"late={int(o.get('late', False))} "
                f"contributors={o['contributors']} "
                f"bytes_sent={local_sgd.bytes_sent_total} "
                f"bytes_received={local_sgd.bytes_received_total} "
                f"rejoined={int(o.get('rejoined', False))}")

    for epoch in range(a.epochs):
        if step >= total_steps:
            break
        order = list(shard)
        portable_shuffle(order, epoch_seed(a.seed, a.rank, epoch))
        order = torch.tensor(order, dtype=torch.int64)
        for b in range(steps_per_epoch):
            if step >= total_steps:
                break
            index = order[b * a.batch_size:(b + 1) * a.batch_size]
            x = train_images.index_select(0, index).to(device)
            y = train_labels.index_select(0, index).to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            step += 1
            syncs, skipped = local_sgd.num_syncs, local_sgd.num_skipped_syncs
            last_sync_start = local_sgd.sync_seconds_total
            local_sgd.step()
            period_ended = False
            if local_sgd.num_skipped_syncs != skipped:
                emit(f"sync skipped step={step} (coordinator unreachable; "
                     "training on locally)")
            elif local_sgd.num_syncs != syncs:
                emit(sync_line())
                period_ended = True
                dump("round", local_sgd.last_outcome["round"])
            elif a.no_sync and step % a.k == 0:
                period_ended = True
            if step % a.log_every == 0:
                window = losses[-a.log_every:]
                emit(f"step={step} epoch={epoch} "
                     f"loss={sum(window) / len(window):.4f}")
            if period_ended and a.rank == 0 and a.eval_every_sync > 0:
                evals_due += 1
                if evals_due == a.eval_every_sync:
                    evals_due = 0
                    acc, test_loss = evaluate(model, test_images,
                                              test_labels, device)
                    round_ = local_sgd.last_outcome["round"] \
                        if local_sgd.last_outcome else 0
                    emit(f"eval round={round_} step={step} "
                         f"test_accuracy={acc:.4f} test_loss={test_loss:.4f}")
    train_seconds = time.monotonic() - train_start
    syncs = local_sgd.num_syncs
    last_sync_start = local_sgd.sync_seconds_total
    local_sgd.close()  # the final sync (accelerate's __exit__), then Leave
    if local_sgd.num_syncs != syncs:
        emit(sync_line())
        dump("round", local_sgd.last_outcome["round"])
    window = min(a.log_every, len(losses))
    final = f"final step={step} rounds={local_sgd.num_syncs}"
    if a.rank == 0:
        acc, test_loss = evaluate(model, test_images, test_labels, device)
        final += f" test_accuracy={acc:.4f} test_loss={test_loss:.4f}"
    first = sum(losses[:window]) / max(1, window)
    last = sum(losses[-window:]) / max(1, window)
    final += (f" first_loss={first:.4f} last_loss={last:.4f} "
              f"sync_seconds_total={local_sgd.sync_seconds_total:.3f} "
              f"train_seconds={train_seconds:.1f} "
              f"bytes_sent={local_sgd.bytes_sent_total} "
              f"bytes_received={local_sgd.bytes_received_total}")
    emit(final)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
