"""LocalSGD for PyTorch modules, shaped like Hugging Face accelerate's.

Every `local_sgd_steps`-th call of step() replaces every parameter of the
model with the job's new global state: the plain mean of all members'
parameters (averaging="mean", as accelerate's LocalSGD does), or DiLoCo's
outer optimizer step (averaging="nesterov" / "outer_sgd") computed by the
coordinator. Only parameters are averaged (model.named_parameters()):
buffers such as BatchNorm statistics and optimizer state stay local, as in
accelerate. On the wire travel pseudo-gradients (the change since the last
global state) in float32, bfloat16, or 8- or 4-bit blocks with error
feedback (wire_dtype).

A script written for accelerate changes its import only; the coordinator
and the job come from the environment (LOCALSGD_COORDINATOR, LOCALSGD_JOB):

    # from accelerate.local_sgd import LocalSGD
    from localsgd import LocalSGD

    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=8,
                  enabled=True) as local_sgd:
        for batch in loader:
            loss = ...; accelerator.backward(loss); optimizer.step()
            optimizer.zero_grad(); local_sgd.step()

or, naming them:

    with LocalSGD(model, coordinator="host:50051", job="run1",
                  local_sgd_steps=16) as local_sgd:
        ...

Construction joins the job and makes the model's parameters its global
state (the first member seeds the job, later ones, late joiners included,
fetch it). Leaving the `with` block normally does the final sync (as
accelerate's __exit__) and leaves the job; leaving it with an exception
leaves at once, without the final sync, so that the other members do not
wait for this one. enabled=False is a pass-through: nothing is joined, step()
only counts.

Where accelerate averages over the processes of one torch.distributed world
(and so does nothing for a single process: its DistributedType.NO), a
member here averages with every member of the job, on any machine, through
the coordinator: a single process syncs too. The averaged result is
accelerate's when every member is in every round (averaging="mean",
float32 on the wire).

Launched together: under a launcher's environment (WORLD_SIZE, as torchrun
and `accelerate launch` set it, with LOCAL_WORLD_SIZE), the job's first
rounds wait until the launched world's members all take part (a rendezvous
of WORLD_SIZE / node size members: one per node when the processes of a
node form a node group, one per process otherwise), so that workers which
start seconds apart average together from the first round, as accelerate's
ranks do. rendezvous=0 (or LOCALSGD_RENDEZVOUS=0) asks for no wait.
Without a launcher there is no wait: a member averages with the members
present when a round opens, and one that joins later takes part from the
next round (it starts from the job's state); in a short job, a worker that
starts late may find the first one's rounds over. To wait for N members
there, pass rendezvous=N or set LOCALSGD_RENDEZVOUS=N. A rendezvous is a
setting of the job (its first member's): every member must ask for the same
N, or for none; a round that gathers waits for its members without limit
unless the coordinator has a --round_deadline.

Node-local averaging (process_group): the processes of a node (torchrun
--nproc-per-node, `accelerate launch --num_processes`) average over a
torch.distributed group (gloo for CPU tensors, NCCL for CUDA); at every
sync they all-reduce the parameters to the node mean, rank 0 of the group
alone syncs it with the coordinator (as a member of weight = the group's
size) and broadcasts the result. The group is formed by itself when the
accelerator has several processes (accelerator.num_processes > 1, with
torch.distributed initialised, as accelerate does), or torch.distributed is
initialised with several processes and no accelerator is given: the
processes of a node are those with the same process_index -
local_process_index (accelerate), the same RANK - LOCAL_RANK (torchrun's
environment) or, without LOCAL_RANK, the same host name; process_group=
names the group instead. Forming the groups is a collective of the whole
world: every process constructs its LocalSGD at the same point. Every rank
of the group must construct, step(), sync_now() and close() in lockstep,
exactly as the C++ node groups (client/node_group.h). If the leader skips a
sync (coordinator unreachable and keep_training_when_unavailable), every
rank keeps its own parameters; if it fails, every rank raises with its code.
With overlap=True a node merges in lockstep at sync points only: the node
mean; the leader merges the round in flight into it (result + (mean_now -
mean_then)) and starts the next round from that; every rank goes on from
what the leader broadcasts (the node mean when no round was merged), as
LocalSGDOptions::overlap does in C++. A model wrapped in
DistributedDataParallel (what accelerator.prepare returns for several
processes) trains inside the `with` block under its no_sync(), as with
accelerate, so that the ranks do not all-reduce gradients at every step;
its parameters are named as the wrapped module's.

Parameters on CUDA are copied through one reused pinned host buffer; CPU
float32 parameters are copied once into the flat buffer and back.
"""
import os
import socket
import time
import zlib

import torch
import torch.distributed as dist

from localsgd._localsgd import Client, Error, decide_step

# gRPC status code names by number (for the node group's status broadcast).
_CODES = ["OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT",
          "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
          "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
          "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL",
          "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"]
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16",
           torch.float16: "float16", torch.float64: "float64"}
_OK, _SKIPPED, _FAILED = 0, 1, 2
# The node's status flags (overlap's sync point).
_MERGED, _STARTED = 1, 2
# accelerate's DistributedType values that its LocalSGD supports (one
# process, or data parallel over processes); the others (DEEPSPEED, FSDP,
# MEGATRON_LM, XLA) raise NotImplementedError there and here.
_SUPPORTED_DISTRIBUTED_TYPES = ("NO", "MULTI_")


def _error(code, message):
    """A localsgd.Error as the C++ client raises it."""
    e = Error(f"{code}: {message}")
    e.code = code
    e.message = message
    return e


def _env(name, default=None):
    """The environment variable `name`, or `default` when unset or empty."""
    value = os.environ.get(name, "")
    return value if value != "" else default


def _error_reset(value):
    """LocalSGD's error_reset: the argument, else LOCALSGD_ERROR_RESET."""
    if value is not None:
        if not isinstance(value, bool):
            raise ValueError(f"error_reset={value!r}: must be True or False")
        return value
    env = _env("LOCALSGD_ERROR_RESET", "0")
    if env not in ("0", "1"):
        raise ValueError(f"LOCALSGD_ERROR_RESET={env!r}: must be 0 or 1")
    return env == "1"


def _env_number(name, kind, default):
    value = _env(name)
    if value is None:
        return default
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not "
                         f"a{'n int' if kind is int else ' number'}") \
            from None


def _distributed_type_name(accelerator):
    """accelerator.distributed_type as a string ("NO", "MULTI_GPU", ...), or
    None when the accelerator has none."""
    t = getattr(accelerator, "distributed_type", None)
    if t is None:
        return None
    return str(getattr(t, "value", t)).upper()


def _node_group(accelerator, device):
    """The torch.distributed group of this process's node, formed from the
    accelerator or the initialised world (see the module's documentation);
    None when this process is alone on its node or not distributed."""
    initialised = dist.is_available() and dist.is_initialized()
    if accelerator is not None:
        n = int(accelerator.num_processes)
        if n <= 1:
            return None
        if not initialised:
            raise ValueError(
                f"accelerator.num_processes={n} but torch.distributed is not "
                "initialised (accelerate initialises it for several "
                "processes); pass process_group= or initialise it")
        if dist.get_world_size() != n:
            raise ValueError(
                f"accelerator.num_processes={n} but the torch.distributed "
                f"world has {dist.get_world_size()} processes")
        rank = dist.get_rank()
        key = rank - int(accelerator.local_process_index)
    elif initialised and dist.get_world_size() > 1:
        rank = dist.get_rank()
        local_rank = _env_number("LOCAL_RANK", int, None)
        if local_rank is not None:
            key = rank - local_rank
        else:
            # A stable number for the host (not hash(): it is salted).
            key = -1 - zlib.crc32(socket.gethostname().encode())
    else:
        return None
    world = dist.get_world_size()
    if dist.get_backend() != "nccl":
        device = torch.device("cpu")
    elif device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.tensor([key], dtype=torch.int64, device=device)
    keys = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(keys, mine)
    nodes = {}  # key -> global ranks, in the order of their first rank
    for r, k in enumerate(t.item() for t in keys):
        nodes.setdefault(k, []).append(r)
    group = None
    # new_group is a collective of the whole world: every process creates
    # every node's group, in the same order.
    for ranks in nodes.values():
        if len(ranks) == 1:
            continue
        g = dist.group.WORLD if len(ranks) == world else \
            dist.new_group(ranks)
        if rank in ranks:
            group = g
    return group


def _rendezvous_members(rendezvous, node_size):
    """The job's rendezvous: `rendezvous` if given, else LOCALSGD_RENDEZVOUS,
    else the launched world's members (WORLD_SIZE / node size), else 0."""
    if rendezvous is None:
        rendezvous = _env_number("LOCALSGD_RENDEZVOUS", int, None)
    if rendezvous is not None:
        if isinstance(rendezvous, bool) or not isinstance(rendezvous, int) \
                or rendezvous < 0:
            raise ValueError(f"rendezvous={rendezvous!r}: must be an int "
                             ">= 0 (0: no wait)")
        return rendezvous
    world = _env_number("WORLD_SIZE", int, None)
    if world is None:
        return 0
    if world < 1 or world % node_size:
        raise ValueError(
            f"WORLD_SIZE={world} is not a multiple of this node's "
            f"{node_size} processes, so the launched world's members are "
            "unknown: pass rendezvous=N (or LOCALSGD_RENDEZVOUS=N; 0: no "
            "wait)")
    members = world // node_size
    return members if members > 1 else 0


class LocalSGD:
    """See the module's documentation. Arguments (None: from the
    environment variable named, else the default shown):

    model: the torch.nn.Module whose parameters are averaged.
    accelerator: an accelerate.Accelerator (or any object with its
        num_processes, local_process_index and distributed_type): its
        processes form the node group (see the module's documentation);
        one process (num_processes=1) is a member of its own. accelerate's
        positional order, LocalSGD(accelerator, model, local_sgd_steps,
        enabled), is accepted too.
    coordinator: "host:port" of the coordinator; LOCALSGD_COORDINATOR (a
        comma-separated list: the replicas of sharded coordinators).
    replicas: ["host:port", ...] of sharded coordinators, instead.
    job: the job id (the job is created by its first member); LOCALSGD_JOB.
    local_sgd_steps: K, optimizer steps between two syncs (8).
    enabled: False makes LocalSGD a pass-through (accelerate's enabled).
    weight: this member's weight in the mean (a node group's leader joins
        with the group's size instead).
    member_name: shown in the coordinator's status and logs;
        LOCALSGD_MEMBER_NAME ("").
    rendezvous: the job's first rounds wait until this many members take
        part; LOCALSGD_RENDEZVOUS; else, under a launcher (WORLD_SIZE set),
        WORLD_SIZE / the node group's size; else 0 (no wait). 0 asks for no
        wait. See the module's documentation.
    wire_dtype: "float32", "bfloat16", "int8", "int4", "sparse2" or
        "sparse4" (the job's); LOCALSGD_WIRE_DTYPE ("float32").
    sparse_keep: with "sparse2" or "sparse4", the values kept of every 4096,
        1 to 4096 (the job's); LOCALSGD_SPARSE_KEEP (0: the coordinator's
        default, 64). sparse_result_keep, LOCALSGD_SPARSE_RESULT_KEEP: the
        same for the coordinator's step (default 256).
    error_reset: with a lossy wire dtype, train on after each counted sync
        from the global state plus this member's residual (what its
        encoding has not sent yet) instead of the global state alone; the
        final sync (close()) leaves the global state alone.
        LOCALSGD_ERROR_RESET ("1" or "0"; default "0"). The residual then
        lives in the parameters: bfloat16 or float16 parameters round part
        of it away. With client=, the client's own error_reset applies
        (error_reset= then raises ValueError). See docs/design.md.
    averaging: "mean", "nesterov" or "outer_sgd" (the job's);
        LOCALSGD_AVERAGING ("mean"); with outer_lr and outer_momentum,
        LOCALSGD_OUTER_LR and LOCALSGD_OUTER_MOMENTUM (0: the coordinator's
        defaults).
    deadline_mode: "fixed" or "adaptive" (the job's); LOCALSGD_DEADLINE_MODE
        ("": the coordinator's default).
    mean_encoding: "float32" or "wire" (the job's: whether the rule runs on
        the round's mean as computed or as the wire dtype encodes it, which
        a standby coordinator then replicates at the cost of one member's
        download; docs/design.md); LOCALSGD_MEAN_ENCODING ("": the
        coordinator's default).
    max_staleness: "off" or 1 to 64 (the job's: how many rounds old a
        delta's anchor may be for it to be merged, weighed by
        1/(1 + staleness), instead of thrown away); LOCALSGD_MAX_STALENESS
        ("": the coordinator's default, off).
    step_budget: "fixed" or "adaptive" (the job's: with adaptive the
        coordinator hands each member the local steps to make so that
        contributions arrive together, and step() syncs when they are made;
        local_sgd_steps stays a member of median speed's);
        LOCALSGD_STEP_BUDGET ("": the coordinator's default, fixed).
    tls_ca, tls_server_name: the CA of the coordinator's certificate and
        the name to check in it; LOCALSGD_TLS_CA, LOCALSGD_TLS_SERVER_NAME.
    tls_cert, tls_key: this member's certificate and key (mutual TLS);
        LOCALSGD_CLIENT_TLS_CERT, LOCALSGD_CLIENT_TLS_KEY (the coordinator's
        LOCALSGD_TLS_CERT and LOCALSGD_TLS_KEY are its own).
    token, token_file: the job's token, or a file holding it
        (docs/security.md); LOCALSGD_JOB_TOKEN, LOCALSGD_JOB_TOKEN_FILE (the
        coordinator's LOCALSGD_TOKEN_FILE is its table of tokens).
    process_group: a torch.distributed group of this node's processes
        (None: formed from the accelerator or the initialised world).
    keep_training_when_unavailable: when a sync cannot reach the
        coordinator (after the client's retries), keep the local parameters
        and train on; the next sync tries again.
    client: a localsgd.Client to use instead of creating one (it must not
        have joined; LocalSGD then does not leave or close it).
    overlap: train on while a round syncs in the background (the client's
        start_sync / finish_sync): every local_sgd_steps-th step() starts
        it and returns at once; the first step() that finds the result in
        merges it as result + (theta_now - theta_snapshot), keeping the
        local progress made meanwhile; one still in flight at the next
        sync point is waited for first; close() merges it, then makes the
        final sync. With a process_group the merge is at sync points, in
        lockstep (see the module's documentation).

    The environment is read by the member that creates the client (a node
    group's leader), when enabled. Without a coordinator (argument or
    LOCALSGD_COORDINATOR) or a job (job= or LOCALSGD_JOB), ValueError names
    what is missing.
    """

    def __init__(self, model=None, coordinator=None, job=None,
                 local_sgd_steps=8, enabled=True, *, accelerator=None,
                 weight=1.0, member_name=None, wire_dtype=None,
                 averaging=None, outer_lr=None, outer_momentum=None,
                 contribution="pseudo_gradients", chunk_elements=0,
                 rendezvous=None, replicas=None, tls_ca=None, tls_cert=None,
                 tls_key=None, tls_server_name=None, token=None,
                 token_file=None, process_group=None,
                 keep_training_when_unavailable=True, rpc_timeout=30.0,
                 sync_timeout=1800.0, max_retry_time=60.0, client=None,
                 overlap=False, deadline_mode=None, mean_encoding=None,
                 max_staleness=None, step_budget=None, sparse_keep=None,
                 sparse_result_keep=None, error_reset=None):
        if accelerator is None and model is not None and \
                not isinstance(model, torch.nn.Module) and \
                isinstance(coordinator, torch.nn.Module):
            # accelerate's positional order: (accelerator, model,
            # local_sgd_steps, enabled).
            accelerator, model, coordinator = model, coordinator, None
            if job is not None:
                if isinstance(local_sgd_steps, bool):
                    enabled = local_sgd_steps
                local_sgd_steps, job = job, None
        if isinstance(local_sgd_steps, bool) or \
                not isinstance(local_sgd_steps, int) or local_sgd_steps < 1:
            raise ValueError(f"local_sgd_steps={local_sgd_steps!r}: must be "
                             "an int >= 1")
        if accelerator is not None:
            kind = _distributed_type_name(accelerator)
            if kind is not None and not kind.startswith(
                    _SUPPORTED_DISTRIBUTED_TYPES):
                raise NotImplementedError(
                    f"LocalSGD is supported only for CPUs and GPUs, one "
                    f"process or data parallel (distributed_type {kind})")
        self.model = model
        self.accelerator = accelerator
        self.overlap = bool(overlap)
        self.num_merges = 0
        # Overlap with a process_group: the leader's round in flight, as
        # every rank of the node knows it (from the leader's status).
        self._node_in_flight = False
        self.local_sgd_steps = local_sgd_steps
        self.enabled = bool(enabled)
        self.keep_training_when_unavailable = keep_training_when_unavailable
        self.num_steps = 0
        # num_steps when the last contribution went to the coordinator.
        self._contributed_at = 0
        self.num_syncs = 0
        self.num_skipped_syncs = 0
        self.sync_seconds_total = 0.0
        self.bytes_sent_total = 0
        self.bytes_received_total = 0
        self.last_outcome = None
        self._closed = False
        self._round = 0
        self._client = None
        self._owns_client = client is None
        self._no_sync = None
        if not self.enabled:
            return
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model={type(model).__name__}: must be a "
                            "torch.nn.Module")
        # The parameters of a DistributedDataParallel model are its
        # module's (the same tensors), named without "module.".
        inner = model.module if isinstance(
            model, torch.nn.parallel.DistributedDataParallel) else model
        self._params = []
        layout = []
        for name, p in inner.named_parameters():
            if p.dtype not in _DTYPES:
                raise ValueError(f"parameter {name}: dtype {p.dtype} is not "
                                 "one LocalSGD can average (float32, "
                                 "bfloat16, float16, float64)")
            layout.append((name, list(p.shape), _DTYPES[p.dtype]))
            self._params.append(p)
        if not self._params:
            raise ValueError("the model has no parameters")
        self._numel = sum(p.numel() for p in self._params)
        device = self._params[0].device
        cuda = any(p.is_cuda for p in self._params)
        if process_group is None:
            process_group = _node_group(accelerator, device)
        self._group = process_group
        self._rank = dist.get_rank(process_group) if process_group else 0
        self._size = dist.get_world_size(process_group) if process_group \
            else 1
        # The host buffer the client reads and writes (pinned for CUDA).
        self._host = torch.empty(self._numel, dtype=torch.float32,
                                 pin_memory=cuda)
        self._host_np = self._host.numpy()
        # The node group's collectives run on the parameters' device.
        self._node = None
        if self._group is not None:
            self._node = self._host if device.type == "cpu" else \
                torch.empty(self._numel, dtype=torch.float32, device=device)
            self._status = torch.zeros(5, dtype=torch.int64, device=device)
            # Every rank agrees on the sizes, and that only rank 0 was given
            # a client, before anything else (so no rank raises alone).
            self._check_group(device, client is not None and self._rank != 0)
        leader = self._rank == 0
        # Join and adopt the job's state (the first member seeds it). On the
        # leader any failure (bad arguments, the environment, the client,
        # the RPCs) is first shared with the group, so that no rank waits
        # for it forever.
        error = None
        if client is not None and error_reset is not None:
            raise ValueError("error_reset= with client=: error reset is the "
                             "client's own option (Client(error_reset=...))")
        if leader:
            try:
                if client is None:
                    client = self._make_client(
                        coordinator=coordinator, replicas=replicas, job=job,
                        member_name=member_name,
                        weight=float(self._size) if self._group else weight,
                        wire_dtype=wire_dtype, averaging=averaging,
                        outer_lr=outer_lr, outer_momentum=outer_momentum,
                        contribution=contribution,
                        chunk_elements=chunk_elements, rendezvous=rendezvous,
                        tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
                        tls_server_name=tls_server_name, token=token,
                        token_file=token_file, rpc_timeout=rpc_timeout,
                        sync_timeout=sync_timeout,
                        max_retry_time=max_retry_time,
                        deadline_mode=deadline_mode,
                        mean_encoding=mean_encoding,
                        max_staleness=max_staleness,
                        step_budget=step_budget, sparse_keep=sparse_keep,
                        sparse_result_keep=sparse_result_keep,
                        error_reset=error_reset)
                self._client = client
                self._client.join(layout)
                self._flatten_into(self._host)
                self._client.initialize(self._host_np)
                if self._node is not None and self._node is not self._host:
                    self._node.copy_(self._host)
            except Exception as e:  # noqa: B902 - shared, then re-raised
                error = e
                self._leave()
        if self._group is not None:
            self._share(_FAILED if error else _OK, error,
                        0 if error or not leader else
                        self._client.state_round, 0, initial=True)
        elif error is not None:
            raise error
        self._write_back(self._node if self._group is not None
                         else self._host)

    def _make_client(self, coordinator, replicas, job, rendezvous,
                     wire_dtype, averaging, outer_lr, outer_momentum,
                     member_name, tls_ca, tls_cert, tls_key, tls_server_name,
                     token, token_file, deadline_mode, mean_encoding,
                     max_staleness, step_budget, sparse_keep,
                     sparse_result_keep, error_reset, **rest):
        """The leader's Client, from the arguments and, for those not
        given, the environment (see the class's documentation)."""
        if not coordinator and not replicas:
            env = _env("LOCALSGD_COORDINATOR")
            if env is None:
                raise ValueError(
                    "no coordinator: pass coordinator='host:port' (or "
                    "replicas=[...]) or set the environment variable "
                    "LOCALSGD_COORDINATOR=host:port")
            targets = [t.strip() for t in env.split(",") if t.strip()]
            if len(targets) == 1:
                coordinator = targets[0]
            else:
                replicas = targets
        if not job:
            job = _env("LOCALSGD_JOB")
            if job is None:
                raise ValueError("no job: pass job= or set the environment "
                                 "variable LOCALSGD_JOB")

        def pick(value, name, default):
            return value if value is not None else _env(name, default)

        def pick_number(value, name):
            return value if value is not None else \
                _env_number(name, float, 0.0)
        return Client(
            target=coordinator or "", job=job,
            member_name=pick(member_name, "LOCALSGD_MEMBER_NAME", ""),
            replicas=list(replicas or []),
            local_sgd_steps=self.local_sgd_steps,
            wire_dtype=pick(wire_dtype, "LOCALSGD_WIRE_DTYPE", "float32"),
            averaging=pick(averaging, "LOCALSGD_AVERAGING", "mean"),
            outer_lr=pick_number(outer_lr, "LOCALSGD_OUTER_LR"),
            outer_momentum=pick_number(outer_momentum,
                                       "LOCALSGD_OUTER_MOMENTUM"),
            rendezvous=_rendezvous_members(rendezvous, self._size),
            tls_ca=pick(tls_ca, "LOCALSGD_TLS_CA", ""),
            tls_cert=pick(tls_cert, "LOCALSGD_CLIENT_TLS_CERT", ""),
            tls_key=pick(tls_key, "LOCALSGD_CLIENT_TLS_KEY", ""),
            tls_server_name=pick(tls_server_name, "LOCALSGD_TLS_SERVER_NAME",
                                 ""),
            token=pick(token, "LOCALSGD_JOB_TOKEN", ""),
            token_file=pick(token_file, "LOCALSGD_JOB_TOKEN_FILE", ""),
            deadline_mode=pick(deadline_mode, "LOCALSGD_DEADLINE_MODE", ""),
            mean_encoding=pick(mean_encoding, "LOCALSGD_MEAN_ENCODING", ""),
            max_staleness=str(pick(max_staleness, "LOCALSGD_MAX_STALENESS",
                                   "")),
            step_budget=pick(step_budget, "LOCALSGD_STEP_BUDGET", ""),
            sparse_keep=sparse_keep if sparse_keep is not None else
            _env_number("LOCALSGD_SPARSE_KEEP", int, 0),
            sparse_result_keep=sparse_result_keep
            if sparse_result_keep is not None else
            _env_number("LOCALSGD_SPARSE_RESULT_KEEP", int, 0),
            error_reset=_error_reset(error_reset),
            **rest)

    @property
    def state_round(self):
        """The round of the job's state the parameters hold (0 when
        disabled; on a node group's other ranks, the last sync's round)."""
        if self._client is not None:
            return self._client.state_round
        return self._round

    # --- accelerate's interface -----------------------------------------
    def __enter__(self):
        # A DistributedDataParallel model does not all-reduce gradients
        # inside the block (accelerate's LocalSGD does the same).
        if self.enabled and self._no_sync is None and \
                hasattr(self.model, "no_sync"):
            self._no_sync = self.model.no_sync()
            self._no_sync.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                self.close()
            else:
                self.abandon()
        finally:
            if self._no_sync is not None:
                no_sync, self._no_sync = self._no_sync, None
                no_sync.__exit__(exc_type, exc, tb)
        return False

    def step(self):
        """Call once after every optimizer step; every local_sgd_steps-th
        call syncs (sync_now) when enabled."""
        if self._closed:
            raise _error("FAILED_PRECONDITION", "step() after close()")
        self.num_steps += 1
        if not self.enabled:
            return
        # One table with the C++ LocalSGD (client/sync_schedule.h).
        in_flight = bool(self._group is None and self.overlap
                         and self._client.sync_in_flight)
        action = decide_step(
            self.num_steps, self.local_sgd_steps, bool(self.overlap),
            self._group is not None, in_flight,
            bool(in_flight and self._client.sync_ready),
            since_sync=self._steps_since_contribution(),
            budget=self._budget())
        if action in ("merge", "merge_then_start"):
            self._merge()
        if action in ("start", "merge_then_start"):
            self._flatten_into(self._host)
            self._start_sync()
        elif action == "node_sync_point":
            self._node_sync_point(start_next=True)
        elif action == "sync":
            self.sync_now()

    def sync_now(self):
        """Averages the parameters with the job now (blocks until the round
        closes); on an error the parameters are left as they were."""
        self._sync(last=False)

    def _sync(self, last):
        """sync_now(); `last`: close()'s final sync (with error_reset, the
        parameters get the global state alone)."""
        if not self.enabled or self._closed:
            raise _error("FAILED_PRECONDITION",
                         "sync_now() when disabled or closed")
        if self.overlap and self._group is not None:
            if self._node_in_flight:
                self._node_sync_point(start_next=False)
        elif self.overlap and self._client.sync_in_flight:
            self._merge()
        start = time.monotonic()
        try:
            if self._group is None:
                self._flatten_into(self._host)
                outcome = self._client_sync(last)
                if outcome is not None:
                    self._write_back(self._host)
                return
            # The node mean, then the leader's sync, then its result.
            self._node_mean()
            kind, error, outcome = _OK, None, None
            if self._rank == 0:
                if self._node is not self._host:
                    self._host.copy_(self._node)
                try:
                    outcome = self._client_sync(last)
                    kind = _OK if outcome is not None else _SKIPPED
                except Exception as e:  # noqa: B902 - shared, re-raised
                    kind, error = _FAILED, e
                if kind == _OK and self._node is not self._host:
                    self._node.copy_(self._host, non_blocking=False)
            self._share(kind, error,
                        outcome["round"] if outcome else 0,
                        outcome["contributors"] if outcome else 0)
        finally:
            self.sync_seconds_total += time.monotonic() - start

    def close(self):
        """The final sync (accelerate's __exit__), then leaves the job (if
        this LocalSGD created the client). Idempotent."""
        if self._closed:
            return
        try:
            if self.enabled:
                self._sync(last=True)
        finally:
            self._closed = True
            self._leave()

    def abandon(self):
        """Leaves at once, without the final sync (for error paths, where
        the other members may be gone). Later close() calls do nothing."""
        self._closed = True
        self._leave()

    # --- internals -------------------------------------------------------
    def _merge(self):
        """Overlap: waits for the background sync and merges its result
        into the parameters as they are now."""
        start = time.monotonic()
        try:
            self._flatten_into(self._host)
            try:
                outcome = self._client.finish_sync(self._host_np)
            except Error as e:
                if self.keep_training_when_unavailable and \
                        e.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
                    self.num_skipped_syncs += 1
                    return
                raise
            self._write_back(self._host)
            self.num_merges += 1
            self._count(outcome)
        finally:
            self.sync_seconds_total += time.monotonic() - start

    def _node_sync_point(self, start_next):
        """Overlap with a process_group, in lockstep on every rank: the
        node mean; the leader merges the round in flight into it and, if
        start_next, starts the next round from the result; then the
        leader's status and (if it merged) the merged values to every
        rank."""
        start = time.monotonic()
        try:
            self._node_mean()
            kind, error, outcome, started = _OK, None, None, False
            if self._rank == 0:
                if self._node is not self._host:
                    self._host.copy_(self._node)
                try:
                    if self._client.sync_in_flight:
                        try:
                            outcome = self._client.finish_sync(self._host_np)
                        except Error as e:
                            if not (self.keep_training_when_unavailable and
                                    e.code in ("UNAVAILABLE",
                                               "DEADLINE_EXCEEDED")):
                                raise
                            kind = _SKIPPED
                    if outcome is not None and self._node is not self._host:
                        self._node.copy_(self._host)
                    if start_next:
                        self._start_sync()
                except Exception as e:  # noqa: B902 - shared, re-raised
                    kind, error = _FAILED, e
                # What is in flight now, whatever failed (every rank must
                # know it to merge it later).
                started = self._client.sync_in_flight
            flags = (_MERGED if outcome is not None else 0) | \
                (_STARTED if started else 0)
            self._share(kind, error, outcome["round"] if outcome else 0,
                        outcome["contributors"] if outcome else 0,
                        flags=flags)
            # The leader counts once the node has the result (_share raises
            # on every rank when the leader failed).
            if self._rank == 0:
                if outcome is not None:
                    self.num_merges += 1
                    self._count(outcome)
                elif kind == _SKIPPED:
                    self.num_skipped_syncs += 1
        finally:
            self.sync_seconds_total += time.monotonic() - start

    def _node_mean(self):
        """The parameters, all-reduced to the node mean, into self._node."""
        self._flatten_into(self._node)
        try:
            dist.all_reduce(self._node, group=self._group)
        except RuntimeError as e:
            raise _error("ABORTED", f"the node's all-reduce failed (a "
                         f"process of the node died?): {e}") from e
        self._node.div_(self._size)

    def _steps_since_contribution(self):
        """The local steps the next contribution holds (SyncHeader
        local_steps: the coordinator counts them for the job's goodput)."""
        return max(0, self.num_steps - self._contributed_at)

    def _budget(self):
        """The coordinator's step budget for the next contribution (adaptive
        step budgets; 0: every local_sgd_steps)."""
        last = self.last_outcome
        return int(last.get("local_steps_budget", 0)) if last else 0

    def _start_sync(self):
        """start_sync of self._host, saying the local steps it holds."""
        self._client.start_sync(
            self._host_np, local_steps=self._steps_since_contribution())
        self._contributed_at = self.num_steps

    def _count(self, outcome):
        """A successful sync's outcome (the leader's, or a member's own)."""
        self.num_syncs += 1
        self.last_outcome = outcome
        self.bytes_sent_total += outcome["bytes_sent"]
        self.bytes_received_total += outcome["bytes_received"]

    def _client_sync(self, last=False):
        """The leader's sync into self._host; the outcome, or None when
        skipped (coordinator unreachable). `last`: the final sync."""
        try:
            outcome = self._client.sync(
                self._host_np, local_steps=self._steps_since_contribution(),
                last=last)
            self._contributed_at = self.num_steps
        except Error as e:
            if self.keep_training_when_unavailable and \
                    e.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
                self.num_skipped_syncs += 1
                return None
            raise
        self._count(outcome)
        return outcome

    def _share(self, kind, error, round_, contributors, initial=False,
               flags=None):
        """Rank 0's status to the group; then, if ok, its values; raises
        the leader's error on every rank. `initial`: the state adopted at
        construction (not a sync). `flags` (overlap's sync point): the
        values go out only if the leader merged a round (_MERGED); every
        rank holds the node mean otherwise, and goes on from it."""
        overlap = flags is not None
        if self._rank == 0:
            code = getattr(error, "code", "UNKNOWN")
            code = _CODES.index(code) if code in _CODES else 2
            self._status.copy_(torch.tensor([kind, code, round_,
                                             contributors, flags or 0]))
        try:
            dist.broadcast(self._status, src=self._leader_global_rank(),
                           group=self._group)
            kind, code, round_, contributors, flags = self._status.tolist()
            merged = bool(flags & _MERGED)
            if overlap:
                self._node_in_flight = bool(flags & _STARTED)
            if (merged if overlap else kind == _OK):
                dist.broadcast(self._node, src=self._leader_global_rank(),
                               group=self._group)
        except RuntimeError as e:
            raise _error("ABORTED", f"the node's broadcast failed (a process "
                         f"of the node died?): {e}") from e
        if kind == _FAILED:
            if error is not None:
                raise error
            raise _error(_CODES[code] if code < len(_CODES) else "UNKNOWN",
                         "the node's leader (rank 0 of the process group) "
                         "failed to sync with the coordinator")
        synced = merged if overlap else kind == _OK
        if synced:
            self._round = round_
            if self._rank != 0 and not initial:
                self.num_syncs += 1
                self.num_merges += 1 if overlap else 0
                self.last_outcome = {"round": round_,
                                     "contributors": contributors}
        elif kind == _SKIPPED and self._rank != 0:
            self.num_skipped_syncs += 1
        if kind == _OK or overlap:
            self._write_back(self._node)

    def _leader_global_rank(self):
        # torch >= 2.0 has dist.get_global_rank; 1.13 the private one.
        get = getattr(dist, "get_global_rank", None) or \
            dist.distributed_c10d._get_global_rank
        return get(self._group, 0)

    def _check_group(self, device, client_off_leader):
        facts = torch.tensor([self._numel, -self._numel,
                              int(client_off_leader)], dtype=torch.int64,
                             device=device)
        dist.all_reduce(facts, op=dist.ReduceOp.MAX, group=self._group)
        if facts[0].item() != self._numel or -facts[1].item() != self._numel:
            raise ValueError("the ranks of the process group have models of "
                             "different sizes")
        if facts[2].item():
            raise ValueError("only rank 0 of the process group may be given "
                             "a client")

    def _flatten_into(self, flat):
        offset = 0
        with torch.no_grad():
            for p in self._params:
                n = p.numel()
                flat[offset:offset + n].copy_(p.detach().reshape(-1))
                offset += n

    def _write_back(self, flat):
        offset = 0
        with torch.no_grad():
            for p in self._params:
                n = p.numel()
                p.copy_(flat[offset:offset + n].view(p.shape))
                offset += n

    def _leave(self):
        if self._client is None or not self._owns_client:
            return
        client, self._client = self._client, None
        try:
            client.leave()
        except Error:
            pass  # the coordinator drops the member when its lease expires
        finally:
            client.close()
