"""localsgd.LocalSGD, accelerate's shape: K-th-step syncs, the final sync
on exit, enabled=False, an exception inside the `with` block, a late
joiner, a killed worker, and a 2-process torch.distributed gloo node group
in a job with a C++ member."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

import localsgd
from localsgd import LocalSGD

from conftest import free_port

N = 1000


class W(torch.nn.Module):
    """scripted_member's layout: one float32 tensor "w" of N elements."""

    def __init__(self, value=0.0):
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((N,), float(value)))


class Small(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = torch.nn.Linear(5, 4)
        self.fc2 = torch.nn.Linear(4, 2, dtype=torch.float64)
        self.register_buffer("seen", torch.zeros(1))


def params(model):
    return torch.cat([p.detach().double().reshape(-1)
                      for p in model.parameters()])


def threads(*fns, timeout=120):
    errors, out = [], [None] * len(fns)

    def run(i, fn):
        try:
            out[i] = fn()
        except BaseException as e:  # noqa: B902 - re-raised below
            errors.append(e)
    ts = [threading.Thread(target=run, args=(i, f)) for i, f in enumerate(fns)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
        assert not t.is_alive(), f"did not finish within {timeout}s"
    if errors:
        raise errors[0]
    return out


def train_steps(model, local_sgd, steps, lr=0.1, seed=0):
    """`steps` optimizer steps of a toy loss, local_sgd.step() after each."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        x = torch.randn(8, 5, generator=gen)
        out = model.fc2(torch.relu(model.fc1(x)).double())
        loss = (out ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        local_sgd.step()


def test_syncs_every_k_steps_and_on_exit(coordinator):
    c = coordinator()
    models = [Small(1), Small(2)]
    lsgds = threads(*[lambda m=m, i=i: LocalSGD(
        m, coordinator=c.target, job="k", local_sgd_steps=4,
        member_name=f"m{i}") for i, m in enumerate(models)])
    # Construction made the parameters the job's state: equal everywhere.
    assert torch.equal(params(models[0]), params(models[1]))
    seen = models[0].seen.clone()

    def run(i):
        with lsgds[i] as ls:
            for step in range(1, 11):
                train_steps(models[i], ls, 1, seed=10 * i + step)
                assert ls.num_syncs == step // 4
        return ls
    threads(lambda: run(0), lambda: run(1))
    # 10 steps: syncs at 4 and 8, and the final one on exit.
    for ls in lsgds:
        assert ls.num_steps == 10 and ls.num_syncs == 3
        assert ls.last_outcome["round"] == 3
        assert ls.bytes_sent_total > 0 and ls.bytes_received_total > 0
    assert torch.equal(params(models[0]), params(models[1]))
    # Mixed dtypes kept, buffers untouched.
    assert models[0].fc2.weight.dtype == torch.float64
    assert torch.equal(models[0].seen, seen)
    with pytest.raises(localsgd.Error) as e:
        lsgds[0].step()
    assert e.value.code == "FAILED_PRECONDITION"


def test_error_reset_trains_on_the_residual_and_ends_on_the_state(
        coordinator):
    c = coordinator()
    models = [Small(1), Small(2)]
    lsgds = threads(*[lambda m=m, i=i: LocalSGD(
        m, coordinator=c.target, job="er", local_sgd_steps=4,
        member_name=f"m{i}", wire_dtype="sparse2", sparse_keep=64,
        error_reset=True) for i, m in enumerate(models)])
    after_sync = [None, None]

    def run(i):
        with lsgds[i] as ls:
            train_steps(models[i], ls, 4, seed=10 * i)
            after_sync[i] = params(models[i])
            train_steps(models[i], ls, 2, seed=10 * i + 5)
    threads(lambda: run(0), lambda: run(1))
    # After the sync at step 4 each member holds the state plus its own
    # residual (the small model keeps a few of its 34 values per round).
    assert not torch.equal(after_sync[0], after_sync[1])
    # The final sync leaves both on the job's state, bit for bit.
    assert torch.equal(params(models[0]), params(models[1]))
    cl = localsgd.Client(target=c.target, job="er", member_name="check")
    cl.join([(n, list(p.shape), str(p.dtype).split(".")[1])
             for n, p in models[0].named_parameters()])
    state = np.zeros(sum(p.numel() for p in models[0].parameters()),
                     dtype=np.float32)
    cl.fetch_state(state)
    cl.close()
    assert torch.equal(torch.from_numpy(state).double(), params(models[0]))


def test_enabled_false_is_a_pass_through():
    model = Small(3)
    before = params(model)
    with LocalSGD(model, local_sgd_steps=2, enabled=False) as ls:
        for _ in range(5):
            ls.step()
    assert ls.num_steps == 5 and ls.num_syncs == 0
    assert torch.equal(params(model), before)


def test_an_exception_in_the_with_block_leaves_at_once(coordinator):
    c = coordinator("--lease_ttl=60s")
    a_model, b_model = W(1), W(1)
    a, b = threads(
        lambda: LocalSGD(a_model, coordinator=c.target, job="exc",
                         local_sgd_steps=1, member_name="a"),
        lambda: LocalSGD(b_model, coordinator=c.target, job="exc",
                         local_sgd_steps=1, member_name="b"))

    def failing():
        with pytest.raises(KeyError):
            with a:
                raise KeyError("the training loop failed")
    start = time.monotonic()
    failing()
    # b's next sync does not wait for a (gone at once, not after its 60 s
    # lease): it closes with b alone.
    with torch.no_grad():
        b_model.w.fill_(5.0)
    with b:
        b.step()
    assert time.monotonic() - start < 30
    assert b.last_outcome["contributors"] == 1
    assert torch.all(b_model.w == 5.0)


def test_a_late_joiner_starts_from_the_current_state(coordinator):
    c = coordinator()
    models = [W(0), W(0)]
    first = [LocalSGD(models[0], coordinator=c.target, job="late",
                      local_sgd_steps=1, member_name="a")]
    first.append(LocalSGD(models[1], coordinator=c.target, job="late",
                          local_sgd_steps=1, member_name="b"))
    for round_ in range(1, 4):
        for i, m in enumerate(models):
            with torch.no_grad():
                m.w.fill_(float(round_ * 10 + i))
        threads(first[0].step, first[1].step)
    state = models[0].w.detach().clone()
    late_model = W(123.0)
    late = LocalSGD(late_model, coordinator=c.target, job="late",
                    local_sgd_steps=1, member_name="late")
    assert torch.equal(late_model.w.detach(), state)
    for ls in first + [late]:
        ls.abandon()


def test_a_killed_worker_does_not_stall_the_others_past_its_lease(
        coordinator, tmp_path):
    c = coordinator("--lease_ttl=2s")
    script = tmp_path / "victim.py"
    script.write_text(textwrap.dedent(f"""
        import sys, torch
        from localsgd import LocalSGD
        class W(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.w = torch.nn.Parameter(torch.zeros({N}))
        ls = LocalSGD(W(), coordinator="{c.target}", job="kill",
                      local_sgd_steps=1, member_name="victim")
        print("joined", flush=True)
        sys.stdin.readline()   # killed while waiting here
        """))
    victim = subprocess.Popen([sys.executable, str(script)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=os.environ)
    try:
        assert victim.stdout.readline().strip() == "joined"
        survivor_model = W(0)
        survivor = LocalSGD(survivor_model, coordinator=c.target, job="kill",
                            local_sgd_steps=1, member_name="survivor")
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        start = time.monotonic()
        with torch.no_grad():
            survivor_model.w.fill_(3.0)
        survivor.step()
        waited = time.monotonic() - start
        assert survivor.last_outcome["contributors"] == 1
        assert waited < 15, f"waited {waited:.1f}s for a dead member"
        assert torch.all(survivor_model.w == 3.0)
        survivor.close()
    finally:
        if victim.poll() is None:
            victim.kill()


NODE_SCRIPT = """
import sys, torch, torch.distributed as dist
from localsgd import LocalSGD
rank, store, target = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://{store}", rank=rank,
                        world_size=2)
class W(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(%d))
model = W()
ls = LocalSGD(model, coordinator=target if rank == 0 else None, job="node",
              local_sgd_steps=1, member_name="node0",
              process_group=dist.group.WORLD)
print("init", model.w[0].item(), flush=True)
for value in ([3.0, 5.0], [10.0, 2.0]):
    with torch.no_grad():
        model.w.fill_(value[rank])
    sys.stdin.readline()
    ls.step()
    w = model.w.detach()
    print("sync", ls.last_outcome["round"], ls.last_outcome["contributors"],
          w[0].item(), bool(torch.all(w == w[0])), flush=True)
ls.close()
print("done", flush=True)
""" % N


def test_gloo_node_group_counts_as_one_member_of_its_size(
        coordinator, cpp_member, tmp_path):
    # A node of 2 Python processes (gloo) and one C++ member: the node's
    # leader syncs the node mean with weight 2, as the C++ node groups do.
    c = coordinator()
    cpp = cpp_member(c, "node", "cpp", weight=1.0,
                     extra=["--local_sgd_steps=1"])
    cpp.do("join")
    cpp.do("init 1")  # the state: all ones
    script = tmp_path / "node.py"
    script.write_text(NODE_SCRIPT)
    store = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, str(script), str(r), store,
                               c.target], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True,
                              env=os.environ) for r in range(2)]
    try:
        for p in procs:
            assert p.stdout.readline().split() == ["init", "1.0"]
        # Round 1: node mean 4 (delta 3, weight 2), C++ 7 (delta 6): the
        # state is 1 + (2*3 + 6) / 3 = 5. Round 2: node mean 6 (delta 1),
        # C++ 8 (delta 3): 5 + (2*1 + 3) / 3.
        expected = [np.float32(5.0),
                    np.float32(5.0) + np.float32(np.float32(5.0) /
                                                 np.float32(3.0))]
        for round_, cpp_value in ((1, 7.0), (2, 8.0)):
            cpp.send(f"sync {cpp_value}")
            for p in procs:
                p.stdin.write("\n")
                p.stdin.flush()
            lines = [p.stdout.readline().split() for p in procs]
            reply = cpp.reply()
            assert f"round={round_} " in reply and "contributors=2" in reply
            cpp_printed = reply.split("value=")[1].split()[0]  # %g
            for line in lines:
                assert line[:3] == ["sync", str(round_), "2"], line
                assert line[4] == "True", "a rank's parameters differ"
                assert lines[0][3] == line[3], "the ranks differ"
                assert f"{float(line[3]):g}" == cpp_printed, (line, reply)
            assert abs(float(lines[0][3]) - expected[round_ - 1]) < 1e-6
        cpp.send("sync 8")  # the node's close() is its final sync
        for p in procs:
            assert p.stdout.readline().strip() == "done"
            assert p.wait(timeout=60) == 0
        assert "contributors=2" in cpp.reply()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


FAILING_NODE_SCRIPT = """
import sys, torch, torch.distributed as dist
import localsgd
from localsgd import LocalSGD
rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://{store}", rank=rank,
                        world_size=2)
try:
    LocalSGD(torch.nn.Linear(3, 2), coordinator="127.0.0.1:1" if rank == 0
             else None, job="unreachable", local_sgd_steps=1,
             max_retry_time=0.2, process_group=dist.group.WORLD)
    print("no error", flush=True)
except localsgd.Error as e:
    print("error", e.code, flush=True)
"""


def test_a_leader_failure_at_start_raises_on_every_rank(tmp_path):
    # The leader cannot reach the coordinator: both ranks raise its code,
    # neither waits for the other forever.
    script = tmp_path / "failing_node.py"
    script.write_text(FAILING_NODE_SCRIPT)
    store = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, str(script), str(r), store],
                              stdout=subprocess.PIPE, text=True,
                              env=os.environ) for r in range(2)]
    try:
        for p in procs:
            out, _ = p.communicate(timeout=60)
            assert out.strip() == "error UNAVAILABLE", out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def test_overlap_merges_the_result_plus_the_progress_since_the_snapshot(
        coordinator):
    """overlap=True: the sync runs while training goes on; each merge is the
    round's result (what a plain member holds) plus the local progress made
    since the snapshot; on exit the in-flight round is merged and the final
    sync leaves both members equal."""
    c = coordinator()
    ma, mb = W(0.0), W(0.0)
    la, lb = threads(
        lambda: LocalSGD(ma, coordinator=c.target, job="ov",
                         local_sgd_steps=2, member_name="a", overlap=True),
        lambda: LocalSGD(mb, coordinator=c.target, job="ov",
                         local_sgd_steps=2, member_name="b"))
    assert torch.equal(params(ma), params(mb))

    def run_a():
        with torch.no_grad():
            ma.w += 1.0
            la.step()
            ma.w += 1.0
            la.step()  # step 2: round 1 starts in the background
            assert la._client.sync_in_flight
            snapshot = ma.w.detach().clone()
            ma.w += 0.5  # trains on while the round runs
            progress = ma.w.detach().clone() - snapshot
            # Wait for the result, then the next step merges it.
            deadline = time.monotonic() + 60
            while not la._client.sync_ready:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            la.step()
            assert la.num_merges == 1 and la.num_syncs == 1
            return snapshot, progress

    def run_b():
        with torch.no_grad():
            mb.w += 3.0
        lb.sync_now()
        return mb.w.detach().clone()
    (snapshot, progress), global_ = threads(run_a, run_b)
    # b holds the round's result: the mean of a's snapshot (2) and b's 3.
    assert torch.all(global_ == 2.5)
    assert torch.equal(ma.w.detach(), global_ + progress)
    threads(la.close, lb.close)
    assert la.num_merges == 1
    assert torch.equal(params(ma), params(mb))


OVERLAP_NODE_SCRIPT = """
import sys, torch, torch.distributed as dist
from localsgd import LocalSGD
rank, store, target = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://{store}", rank=rank,
                        world_size=2)
class W(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(%d))
model = W()
ls = LocalSGD(model, coordinator=target if rank == 0 else None, job="ovnode",
              local_sgd_steps=1, member_name="node0", overlap=True,
              process_group=dist.group.WORLD)
def report(what):
    w = model.w.detach()
    print(what, ls.num_merges, ls._node_in_flight, w[0].item(),
          bool(torch.all(w == w[0])), flush=True)
with torch.no_grad():
    model.w.fill_([3.0, 5.0][rank])
ls.step()  # the node mean; round 1 starts with it in the background
report("step")
with torch.no_grad():
    model.w += [1.0, 3.0][rank]  # trains on while round 1 runs
sys.stdin.readline()
ls.step()  # merges round 1 into the node mean of now; starts round 2
report("step")
ls.close()  # merges round 2, then the final sync
report("done")
""" % N


def test_overlap_node_group_merges_in_lockstep(coordinator, cpp_member,
                                               tmp_path):
    # A node of 2 Python processes with overlap=True and one C++ member
    # syncing normally; the state starts at 1 (everywhere). Step 1: node
    # mean 4 starts round 1; with the C++ member's 7 it closes at
    # 1 + (2*3 + 6) / 3 = 5. The ranks train on by 1 and 3 (node mean 6);
    # step 2 merges: 5 + (6 - 4) = 7 on both ranks, and starts round 2 from
    # it; with the C++ member's 8: 5 + (2*2 + 3) / 3.
    c = coordinator()
    cpp = cpp_member(c, "ovnode", "cpp", weight=1.0,
                     extra=["--local_sgd_steps=1"])
    cpp.do("join")
    cpp.do("init 1")
    script = tmp_path / "overlap_node.py"
    script.write_text(OVERLAP_NODE_SCRIPT)
    store = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, str(script), str(r), store,
                               c.target], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True,
                              env=os.environ) for r in range(2)]
    try:
        for p in procs:  # before round 1 closed: nothing merged yet
            assert p.stdout.readline().split() == \
                ["step", "0", "True", "4.0", "True"]
        reply = cpp.do("sync 7")
        assert reply["round"] == "1" and reply["contributors"] == "2", reply
        for p in procs:
            p.stdin.write("\n")
            p.stdin.flush()
        for p in procs:
            assert p.stdout.readline().split() == \
                ["step", "1", "True", "7.0", "True"]
        reply = cpp.do("sync 8")
        assert reply["round"] == "2" and reply["contributors"] == "2", reply
        theta2 = float(reply["value"])
        assert abs(theta2 - (5 + 7 / 3)) < 1e-5
        cpp.send("sync 8")  # the node's close(): its final sync, round 3
        for p in procs:
            line = p.stdout.readline().split()
            assert line[:3] == ["done", "2", "False"] and line[4] == "True", \
                line
            assert p.wait(timeout=60) == 0
        assert "round=3 " in cpp.reply()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def test_start_sync_keeps_the_client_for_itself(coordinator):
    """While start_sync's round runs, the client takes no other call."""
    c = coordinator()
    cl = localsgd.Client(target=c.target, job="ss", member_name="only")
    cl.join([("w", [N], "float32")])
    p = np.zeros(N, dtype=np.float32)
    cl.initialize(p)
    with pytest.raises(localsgd.Error) as e:
        cl.finish_sync(p)
    assert e.value.code == "FAILED_PRECONDITION"
    p += 2.0
    cl.start_sync(p)
    for call in (lambda: cl.sync(p), lambda: cl.start_sync(p),
                 lambda: cl.fetch_state(p)):
        with pytest.raises(localsgd.Error) as e:
            call()
        assert e.value.code == "FAILED_PRECONDITION"
        assert "in flight" in e.value.message
    p += 1.0  # progress since the snapshot
    out = cl.finish_sync(p)
    assert out["contributed"] and out["contributors"] == 1
    assert np.all(p == 3.0)  # the result (2: alone) plus the progress (1)
    cl.close()


def test_finish_sync_waits_without_holding_the_client(coordinator):
    """finish_sync waits for its round without holding the client: a second
    finish_sync from another thread is refused at once (before, it waited
    for the round: here forever, as the round waits for b, which syncs only
    after the refusal), and sync_in_flight / sync_ready answer meanwhile."""
    c = coordinator()
    a = localsgd.Client(target=c.target, job="fw", member_name="a")
    b = localsgd.Client(target=c.target, job="fw", member_name="b")
    for cl in (a, b):
        cl.join([("w", [N], "float32")])
    pa, pb = np.zeros(N, dtype=np.float32), np.zeros(N, dtype=np.float32)
    a.initialize(pa)
    b.initialize(pb)
    pa += 2.0
    a.start_sync(pa)
    refused = threading.Event()
    errors = []

    def finish():
        try:
            return a.finish_sync(pa)
        except localsgd.Error as e:
            errors.append(e)
            refused.set()
            return None

    def poll_then_b():
        assert refused.wait(30), "the second finish_sync was not refused"
        assert a.sync_in_flight and not a.sync_ready
        np.add(pb, 4.0, out=pb)
        return b.sync(pb)
    out = threads(finish, finish, poll_then_b, timeout=60)
    assert len(errors) == 1 and errors[0].code == "FAILED_PRECONDITION"
    assert "already finishing" in errors[0].message
    out_a = out[0] or out[1]
    assert out_a["round"] == out[2]["round"] == 1
    assert np.all(pa == 3.0) and np.all(pb == 3.0)  # mean of 2 and 4
    assert not a.sync_in_flight
    a.close()
    b.close()


def test_bad_arguments():
    with pytest.raises(ValueError, match="local_sgd_steps"):
        LocalSGD(Small(1), coordinator="127.0.0.1:1", job="j",
                 local_sgd_steps=0)
    with pytest.raises(ValueError, match="coordinator"):
        LocalSGD(Small(1), job="j")
    with pytest.raises(ValueError, match="no parameters"):
        LocalSGD(torch.nn.ReLU(), coordinator="127.0.0.1:1", job="j")
    with pytest.raises(ValueError, match="error_reset"):
        LocalSGD(Small(1), coordinator="127.0.0.1:1", job="j",
                 error_reset="yes")
    with pytest.raises(ValueError, match="error_reset= with client="):
        LocalSGD(Small(1), client=localsgd.Client(target="127.0.0.1:1",
                                                   job="j"),
                 error_reset=True)

    class Ints(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.p = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(ValueError, match="dtype"):
        LocalSGD(Ints(), coordinator="127.0.0.1:1", job="j")
    with pytest.raises(localsgd.Error) as e:
        LocalSGD(Small(1), coordinator="127.0.0.1:1", job="j",
                 max_retry_time=0.2)
    assert e.value.code == "UNAVAILABLE"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_parameters_go_through_the_pinned_buffer(coordinator):
    c = coordinator()
    model = Small(1).cuda()
    ls = LocalSGD(model, coordinator=c.target, job="cuda", local_sgd_steps=1)
    assert ls._host.is_pinned()
    ls.step()
    assert model.fc1.weight.is_cuda
    ls.close()
