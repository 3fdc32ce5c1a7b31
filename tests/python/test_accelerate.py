"""localsgd.LocalSGD in place of accelerate's: a script written for
accelerate's LocalSGD (accelerate_train.py, its keyword call, only the
import changed) run by two workers started apart under a launcher's
environment, which average together in every round; the rendezvous a
launcher implies and how to ask for none; the coordinator and the job from
the environment and the errors that name what is missing; accelerate's
positional call; node groups formed from an accelerator of several
processes or from an initialised torch.distributed world, with a
DistributedDataParallel model trained under its no_sync()."""
import json
import os
import subprocess
import sys

import pytest
import torch

import deploy_lib
from conftest import free_port, wait_for
from localsgd import LocalSGD

HERE = os.path.dirname(os.path.abspath(__file__))
N = 1000


class Accelerator:
    """What accelerate's LocalSGD uses of accelerate.Accelerator."""

    def __init__(self, num_processes=1, process_index=0,
                 local_process_index=0, distributed_type="NO"):
        self.num_processes = num_processes
        self.process_index = process_index
        self.local_process_index = local_process_index
        self.distributed_type = distributed_type

    def wait_for_everyone(self):
        pass


def job_status(http_port, job):
    """The job's status from the coordinator's /api/v1/status (64-bit
    numbers are strings, as in proto3's JSON), or None."""
    code, body = deploy_lib.http_json(
        f"http://127.0.0.1:{http_port}/api/v1/status?job={job}")
    if code == 404:  # not created yet
        return None
    assert code == 200, body
    jobs = [j for j in body.get("jobs", []) if j["job_id"] == job]
    return jobs[0] if jobs else None


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher and no LOCALSGD_* variable from the caller."""
    for name in list(os.environ):
        if name.startswith("LOCALSGD_") or name in (
                "WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK"):
            monkeypatch.delenv(name)
    return monkeypatch


def test_an_accelerate_script_launched_apart_averages_every_round(
        coordinator, tmp_path):
    """Two workers of a launched world of 2 (one process per node), the
    second started once the first has sent its first round: both take part
    in every round, from the first, and end with the same parameters."""
    http_port_file = tmp_path / "http_port"
    c = coordinator("--http_listen=127.0.0.1:0",
                    f"--http_port_file={http_port_file}")
    http_port = wait_for("the status page's port",
                         lambda: http_port_file.exists() and
                         http_port_file.read_text().strip())
    job = "accelerate-launched"
    steps, k = 12, 4
    env = {name: value for name, value in os.environ.items()
           if not name.startswith("LOCALSGD_")}
    env.update(LOCALSGD_COORDINATOR=c.target, LOCALSGD_JOB=job,
               WORLD_SIZE="2", LOCAL_WORLD_SIZE="1", LOCAL_RANK="0")
    outs = [tmp_path / f"worker{r}.json" for r in range(2)]
    logs = [open(tmp_path / f"worker{r}.log", "w") for r in range(2)]
    procs = []

    def start(rank):
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(HERE, "accelerate_train.py"),
             str(outs[rank]), str(steps), str(k)],
            env=dict(env, RANK=str(rank), LOCALSGD_MEMBER_NAME=f"rank{rank}"),
            stdout=logs[rank], stderr=subprocess.STDOUT))

    def log(rank):
        return (tmp_path / f"worker{rank}.log").read_text(errors="replace")

    try:
        start(0)

        def first_round_sent():
            assert procs[0].poll() is None, \
                f"worker 0 exited {procs[0].returncode}: {log(0)}"
            s = job_status(http_port, job)
            if s is None:
                return None
            sent = int(s["state_round"]) >= 1 or \
                "rank0" in s["open_round_contributed"]
            return s if sent else None
        status = wait_for("worker 0's first contribution", first_round_sent,
                          timeout=60)
        # The launcher's world is the job's rendezvous; round 1 gathers.
        assert status["settings"]["rendezvous_members"] == 2, status
        assert int(status["state_round"]) == 0, (
            "round 1 closed without worker 1: " + json.dumps(status))
        start(1)
        for rank, p in enumerate(procs):
            try:
                rc = p.wait(timeout=120)
            except subprocess.TimeoutExpired:
                pytest.fail(f"worker {rank} did not finish: {log(rank)}")
            assert rc == 0, f"worker {rank} exited {rc}: {log(rank)}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
    results = [json.loads(o.read_text()) for o in outs]
    rounds = steps // k + 1  # and the final sync
    for rank, r in enumerate(results):
        assert [s["round"] for s in r["syncs"]] == \
            list(range(1, rounds + 1)), (rank, r["syncs"])
        assert all(s["contributors"] == 2 and s["contributor_weight"] == 2.0
                   for s in r["syncs"]), (rank, r["syncs"])
    assert results[0]["params"] == results[1]["params"]
    # The coordinator saw the same: both names in every round.
    status = job_status(http_port, job)
    by_round = {int(r["round"]): r for r in status["recent_rounds"]}
    for round_ in range(1, rounds + 1):
        assert sorted(by_round[round_]["contributors"]) == \
            ["rank0", "rank1"], by_round[round_]


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_rendezvous_zero_asks_for_no_wait_under_a_launcher(
        coordinator, clean_env, how):
    c = coordinator()
    clean_env.setenv("WORLD_SIZE", "2")
    clean_env.setenv("LOCAL_WORLD_SIZE", "1")
    clean_env.setenv("RANK", "0")
    clean_env.setenv("LOCALSGD_COORDINATOR", c.target)
    clean_env.setenv("LOCALSGD_JOB", f"no-wait-{how}")
    kwargs = {"rendezvous": 0} if how == "argument" else {}
    if how == "environment":
        clean_env.setenv("LOCALSGD_RENDEZVOUS", "0")
    model = torch.nn.Linear(3, 2)
    # Alone in the job, the first sync closes at once without a rendezvous;
    # with one it would wait for a second member until sync_timeout, and be
    # skipped (DEADLINE_EXCEEDED).
    with LocalSGD(accelerator=Accelerator(), model=model, local_sgd_steps=1,
                  sync_timeout=20.0, **kwargs) as ls:
        ls.step()
        assert ls.num_skipped_syncs == 0
        assert ls.last_outcome["round"] == 1
        assert ls.last_outcome["contributors"] == 1


def test_coordinator_and_job_from_the_environment_or_a_clear_error(
        coordinator, clean_env):
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="LOCALSGD_COORDINATOR"):
        LocalSGD(accelerator=Accelerator(), model=model, local_sgd_steps=2)
    clean_env.setenv("LOCALSGD_COORDINATOR", "127.0.0.1:1")
    with pytest.raises(ValueError, match="LOCALSGD_JOB"):
        LocalSGD(accelerator=Accelerator(), model=model, local_sgd_steps=2)
    clean_env.setenv("LOCALSGD_JOB", "from-env")
    clean_env.setenv("LOCALSGD_RENDEZVOUS", "two")
    with pytest.raises(ValueError, match="LOCALSGD_RENDEZVOUS"):
        LocalSGD(accelerator=Accelerator(), model=model, local_sgd_steps=2)
    clean_env.delenv("LOCALSGD_RENDEZVOUS")
    clean_env.setenv("WORLD_SIZE", "x")
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        LocalSGD(accelerator=Accelerator(), model=model, local_sgd_steps=2)
    clean_env.delenv("WORLD_SIZE")
    # accelerate refuses DeepSpeed, FSDP, Megatron-LM and XLA; so does this.
    with pytest.raises(NotImplementedError, match="DEEPSPEED"):
        LocalSGD(accelerator=Accelerator(distributed_type="DEEPSPEED"),
                 model=model, local_sgd_steps=2)
    # Arguments win over the environment.
    c = coordinator()
    clean_env.setenv("LOCALSGD_WIRE_DTYPE", "bfloat16")
    with LocalSGD(model, coordinator=c.target, job="arguments",
                  local_sgd_steps=2, wire_dtype="float32") as ls:
        assert ls._client.info["wire_dtype"] == "float32", ls._client.info
    # The environment's coordinator, job and settings.
    clean_env.setenv("LOCALSGD_COORDINATOR", c.target)
    with LocalSGD(accelerator=Accelerator(), model=model,
                  local_sgd_steps=2) as ls:
        assert ls._client.info["wire_dtype"] == "bfloat16", ls._client.info
        ls.step()
        ls.step()
        assert ls.last_outcome["round"] == 1


def test_accelerates_positional_call(coordinator, clean_env):
    c = coordinator()
    clean_env.setenv("LOCALSGD_COORDINATOR", c.target)
    clean_env.setenv("LOCALSGD_JOB", "positional")
    model = torch.nn.Linear(3, 2)
    with LocalSGD(Accelerator(), model, 2) as ls:
        assert ls.model is model and ls.local_sgd_steps == 2
        for _ in range(4):
            ls.step()
        assert ls.num_syncs == 2
    off = LocalSGD(Accelerator(), model, 3, False)
    assert not off.enabled and off.local_sgd_steps == 3


NODE_SCRIPT = """
import os, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from localsgd import LocalSGD
rank, store, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://{store}", rank=rank,
                        world_size=2)
class Accelerator:
    distributed_type = "MULTI_CPU"
    num_processes = 2
    process_index = rank
    local_process_index = rank
    def wait_for_everyone(self):
        dist.barrier()
class W(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(%d))
    def forward(self):
        return self.w
# What accelerator.prepare returns for several processes.
model = DistributedDataParallel(W())
optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
extra = {"accelerator": Accelerator()} if mode == "accelerator" else {}
with LocalSGD(model=model, local_sgd_steps=1, **extra) as ls:
    print("init", model.module.w[0].item(), ls._size, flush=True)
    for target in ([3.0, 5.0], [10.0, 2.0]):
        # One step to `target`: w - (w - target). Under no_sync the ranks'
        # gradients are not averaged by DistributedDataParallel.
        loss = ((model() - target[rank]) ** 2).sum() / 2
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print("local", model.module.w[0].item(), flush=True)
        sys.stdin.readline()
        ls.step()
        w = model.module.w.detach()
        print("sync", ls.last_outcome["round"],
              ls.last_outcome["contributors"], w[0].item(),
              bool(torch.all(w == w[0])), flush=True)
print("done", flush=True)
""" % N


@pytest.mark.parametrize("mode", ["accelerator", "world"])
def test_the_processes_of_a_node_form_its_group(coordinator, cpp_member,
                                                tmp_path, mode):
    """Two processes of one node (an accelerator of 2 processes, or an
    initialised gloo world with torchrun's LOCAL_RANK) and a C++ member:
    the node is one member of weight 2, as with process_group=."""
    c = coordinator()
    cpp = cpp_member(c, "node", "cpp", weight=1.0,
                     extra=["--local_sgd_steps=1"])
    cpp.do("join")
    cpp.do("init 1")  # the state: all ones
    script = tmp_path / "node.py"
    script.write_text(NODE_SCRIPT)
    store = f"127.0.0.1:{free_port()}"
    env = {name: value for name, value in os.environ.items()
           if not name.startswith("LOCALSGD_")}
    env.update(LOCALSGD_COORDINATOR=c.target, LOCALSGD_JOB="node",
               WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    procs = [subprocess.Popen(
        [sys.executable, str(script), str(r), store, mode],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(2)]
    try:
        for p in procs:
            assert p.stdout.readline().split() == ["init", "1.0", "2"]
        # Round 1: the ranks step to 3 and 5 on their own (no_sync), node
        # mean 4 (delta 3, weight 2), C++ 7 (delta 6): 1 + (2*3 + 6)/3 = 5.
        # Round 2: the ranks step to 10 and 2, node mean 6 (delta 1), C++
        # 8 (delta 3): 5 + (2*1 + 3)/3.
        expected = [5.0, 5.0 + 5.0 / 3.0]
        for round_, locals_, cpp_value in ((1, ["3.0", "5.0"], 7.0),
                                           (2, ["10.0", "2.0"], 8.0)):
            for p, local in zip(procs, locals_):
                assert p.stdout.readline().split() == ["local", local]
            cpp.send(f"sync {cpp_value}")
            for p in procs:
                p.stdin.write("\n")
                p.stdin.flush()
            lines = [p.stdout.readline().split() for p in procs]
            reply = cpp.reply()
            assert f"round={round_} " in reply and "contributors=2" in reply
            for line in lines:
                assert line[:3] == ["sync", str(round_), "2"], line
                assert line[4] == "True", "a rank's parameters differ"
                assert lines[0][3] == line[3], "the ranks differ"
                assert abs(float(line[3]) - expected[round_ - 1]) < 1e-5
        cpp.send("sync 8")  # the node's final sync, leaving the block
        for p in procs:
            assert p.stdout.readline().strip() == "done"
            assert p.wait(timeout=60) == 0
        assert "contributors=2" in cpp.reply()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
