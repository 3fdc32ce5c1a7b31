"""The container images of deploy/Dockerfile, built and run here as the
Kubernetes manifests run them (podman + runc; no registry).

 1. scripts/images.sh builds localsgd/coordinator and localsgd/worker from a
    base made from Debian's archive (cached; podman's layer cache kept).
 2. The coordinator container as deploy/k8s runs it: uid 65532, read-only
    root filesystem, no capabilities, no new privileges, the state volume
    at /var/lib/localsgd (owned by the pod's fsGroup), the ConfigMap's
    environment (deploy/k8s/base/coordinator.env) with only the two listen
    ports moved to free ones (host networking). From outside: grpc.health.v1
    SERVING for readiness and liveness (a client that is not ours),
    /metrics answers; the time from `podman run` to SERVING is reported.
 3. Two worker containers (uid 65532, read-only root, an emptyDir-like
    /tmp, as the example Job) train Fashion-MNIST against it to the demo's
    accuracy band (>= 0.80).
 4. SIGTERM to the coordinator container (podman kill, as the kubelet
    does): readiness NOT_SERVING (or the port closed) right away, exit 0
    within the pod's terminationGracePeriodSeconds (45 s); a new container
    on the same volume restores the job at the round it had reached. (The
    drain with a round still open, liveness SERVING throughout, is
    deploy_health_drain's, on the binary.)
 5. The same coordinator with TLS and per-job tokens mounted where the
    manifests' Secrets go (/etc/localsgd/tls, /etc/localsgd/tokens; mode
    0440, group 65532): health over TLS; a worker container with the CA
    and its token trains; a client without the token is refused.
 6. deploy/k8s/overlays/ha as `kubectl kustomize` renders it, played by
    `podman kube play` (the conversions podman 4.3 needs: ha_kube.py): an
    etcd cluster of three from the localsgd/etcd image and two
    coordinators; one is ready (the primary), the other is a live standby;
    the primary's container SIGKILLed (as a node losing it): the standby
    is ready within the lease and some, the killed one comes back
    (restartPolicy) as a live standby in sync. Skipped without kubectl.

usage: images_test.py --source=DIR [--no_build]
Exit status 77 (skipped) where podman cannot run a container here (not
root, podman/runc/mmdebstrap missing, or the engine fails), or with
LOCALSGD_IMAGES=0 in the environment; the reason is printed.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deploy_lib  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--source", required=True)
parser.add_argument("--no_build", action="store_true")
parser.add_argument("--tag", default="0.1.0")
ARGS = parser.parse_args()
# scripts/images.sh picks the storage driver (--driver prints it); set in
# main() before any podman call.
PODMAN = []
STORAGE_ROOT = "/var/lib/containers/storage"
# Disk a build from scratch takes in podman's storage, with a margin of a
# quarter. Measured 2026-12-01 on this project's machine: overlay, 3.4 GB
# stored after both images (`du -sx` of the storage) and about 2.5 GB more
# at the peak (free disk read during the build: the build containers'
# writable layers): 6 GB. vfs
# stores every image of the build (25, intermediate ones included) as a
# full copy: the sum of their sizes is 23.4 GB, plus the same peak.
BUILD_BYTES = {"overlay": 7.5e9, "vfs": 32e9}
ULIMITS = ["--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096"]
HARDENING = ["--user", "65532:65532", "--read-only", "--cap-drop", "ALL",
             "--security-opt", "no-new-privileges", "--network", "host"]
TMP = tempfile.mkdtemp(prefix="localsgd-images.")
CONTAINERS = []
KUBE_PLAYED = []  # YAML files played (taken down by cleanup)
GRACE_SECONDS = 45  # terminationGracePeriodSeconds in the pod template


def log(msg):
    print(f"[images] {msg}", flush=True)


def skip(msg):
    log(f"SKIP: {msg}")
    shutil.rmtree(TMP, ignore_errors=True)
    sys.exit(77)


def cleanup():
    for name in CONTAINERS:
        subprocess.run(PODMAN + ["rm", "-f", "-t", "0", name],
                       capture_output=True)
    for path, volumes in KUBE_PLAYED:
        subprocess.run(PODMAN + ["kube", "play", "--down", path],
                       capture_output=True)
        for v in volumes:
            subprocess.run(PODMAN + ["volume", "rm", "-f", v],
                           capture_output=True)
    KUBE_PLAYED.clear()


def fail(msg):
    log(f"FAIL: {msg}")
    for name in CONTAINERS:
        r = subprocess.run(PODMAN + ["logs", "--tail", "30", name],
                           capture_output=True, text=True)
        print(f"----- {name}\n{r.stdout}{r.stderr}")
    cleanup()
    log(f"files kept in {TMP}")
    sys.exit(1)


def du_bytes(path):
    """Bytes stored under `path`, as `du -sx` counts them: a running
    container's overlay mount is not storage of its own."""
    total = 0
    for root, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if not os.path.ismount(os.path.join(root, d))]
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def check_disk(driver):
    """Skips, saying what and where, when the disk cannot hold a build from
    scratch: a full disk fails the build ten minutes in with podman's
    ENOSPC, and takes the rest of the machine's tests with it. What storage
    already holds counts as cache the build reuses."""
    parent = STORAGE_ROOT
    while not os.path.isdir(parent):
        parent = os.path.dirname(parent)
    st = os.statvfs(parent)
    free = st.f_bavail * st.f_frsize
    held = du_bytes(STORAGE_ROOT) if os.path.isdir(STORAGE_ROOT) else 0
    need = max(0, BUILD_BYTES[driver] - held)
    gb = 1e9
    log(f"disk: {free / gb:.1f} GB free at {parent}, storage holds "
        f"{held / gb:.1f} GB, a build from scratch takes "
        f"{BUILD_BYTES[driver] / gb:.1f} GB ({driver} driver)")
    if free < need:
        skip(f"{free / gb:.1f} GB free at {parent}, the images need about "
             f"{need / gb:.1f} GB more in podman's {driver} storage "
             f"({STORAGE_ROOT})")


def podman(*args, check=True, timeout=120):
    r = subprocess.run(PODMAN + list(args), capture_output=True, text=True,
                       timeout=timeout)
    if check and r.returncode != 0:
        fail(f"podman {' '.join(args[:3])}...: {r.stderr[-1500:]}")
    return r


def wait_for(what, predicate, timeout=60.0, interval=0.1):
    value = deploy_lib.poll_until(predicate, timeout, interval)
    if not value:
        fail(f"timed out after {timeout}s waiting for {what}")
    return value


def manifest_env():
    """The ConfigMap's LOCALSGD_* values (deploy/k8s/base/coordinator.env)."""
    env = {}
    with open(os.path.join(ARGS.source, "deploy/k8s/base/coordinator.env")) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                k, v = line.split("=", 1)
                env[k] = v
    return env


def state_volume(name):
    """A host folder for the state volume, owned as the pod's fsGroup makes
    it (65532)."""
    path = os.path.join(TMP, name)
    os.makedirs(path)
    os.chown(path, 65532, 65532)
    return path


class Coordinator:
    def __init__(self, name, state, extra_env=None, mounts=(), tls=None):
        import grpc_health
        self.health_mod = grpc_health
        self.name = f"localsgd-test-{name}-{os.getpid()}"
        self.port, self.metrics_port = deploy_lib.free_port(), deploy_lib.free_port()
        env = manifest_env()
        env["LOCALSGD_LISTEN"] = f"127.0.0.1:{self.port}"
        env["LOCALSGD_METRICS_LISTEN"] = f"127.0.0.1:{self.metrics_port}"
        env.update(extra_env or {})
        self.tls = tls
        args = ["run", "-d", "--name", self.name, *HARDENING, *ULIMITS,
                "-v", f"{state}:/var/lib/localsgd:Z"]
        for m in mounts:
            args += ["-v", m]
        for k, v in sorted(env.items()):
            args += ["--env", f"{k}={v}"]
        start = time.monotonic()
        podman(*args, f"localsgd/coordinator:{ARGS.tag}")
        CONTAINERS.append(self.name)
        self.target = f"127.0.0.1:{self.port}"
        wait_for(f"{self.name} SERVING",
                 lambda: self.running() and self.health("") == "SERVING",
                 timeout=60)
        self.startup_seconds = time.monotonic() - start

    def running(self):
        r = podman("inspect", "--format", "{{.State.Status}}", self.name,
                   check=False)
        if r.stdout.strip() in ("exited", "stopped"):
            fail(f"{self.name} exited: {podman('logs', self.name).stderr[-2000:]}")
        return r.stdout.strip() == "running"

    def health(self, service):
        return self.health_mod.check(self.target, service, timeout=2.0,
                                     root_cert=self.tls)

    def metrics(self):
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.read().decode()

    def exit_code(self, timeout):
        r = podman("wait", self.name, timeout=timeout + 10)
        return int(r.stdout.strip().splitlines()[-1])


def run_worker(coordinator, job, rank, world, extra=(), mounts=()):
    name = f"localsgd-test-worker{rank}-{job}-{os.getpid()}-{len(CONTAINERS)}"
    args = ["run", "-d", "--name", name, *HARDENING, *ULIMITS,
            "--tmpfs", "/tmp:rw,size=64m"]
    for m in mounts:
        args += ["-v", m]
    podman(*args, f"localsgd/worker:{ARGS.tag}",
           f"--coordinator={coordinator.target}", f"--job={job}",
           f"--rank={rank}", f"--world={world}", "--k=16", "--threads=1",
           "--eval_every_sync=0", *extra)
    CONTAINERS.append(name)
    return name


def wait_workers(names, timeout):
    finals = []
    for name in names:
        r = podman("wait", name, timeout=timeout)
        code = int(r.stdout.strip().splitlines()[-1])
        out = podman("logs", name).stdout
        if code != 0:
            fail(f"{name} exited {code}: {out[-2000:]}")
        line = next((x for x in out.splitlines() if " final " in x), None)
        if line is None:
            fail(f"{name}: no final line")
        finals.append(dict(f.split("=", 1) for f in line.split()[2:]))
    return finals


def ctl_status(coordinator, job, extra=()):
    ctl = os.environ.get("LOCALSGDCTL")
    cmd = PODMAN + ["run", "--rm", *HARDENING, *ULIMITS, *extra,
                    "--entrypoint", "/usr/local/bin/localsgdctl",
                    f"localsgd/coordinator:{ARGS.tag}",
                    f"--target={coordinator.target}", "status", f"--job={job}",
                    "--json"] if not ctl else \
        [ctl, f"--target={coordinator.target}", "status", f"--job={job}",
         "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        fail(f"localsgdctl status: {r.stderr[-1000:]}")
    return json.loads(r.stdout)["jobs"][0]


def certificates():
    """A CA and a server certificate for 127.0.0.1, with the openssl CLI."""
    d = os.path.join(TMP, "pki")
    os.makedirs(d)
    script = """
set -e
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1.key" 2>/dev/null; }
key ca
openssl req -x509 -new -key ca.key -out ca.crt -days 2 -subj /CN=localsgd-test-ca \
  -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign 2>/dev/null
key tls
openssl req -new -key tls.key -out tls.csr -subj /CN=localsgd-coordinator 2>/dev/null
printf 'basicConstraints=CA:FALSE\\nkeyUsage=digitalSignature\\nextendedKeyUsage=serverAuth\\nsubjectAltName=DNS:localhost,IP:127.0.0.1\\n' > tls.ext
openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out tls.crt -days 2 -extfile tls.ext 2>/dev/null
"""
    subprocess.run(["bash", "-c", script], cwd=d, check=True)
    return d


def secret_dir(name, files):
    """Files as a Secret volume mounts them: root:65532, mode 0440."""
    d = os.path.join(TMP, name)
    os.makedirs(d)
    for fname, content in files.items():
        p = os.path.join(d, fname)
        with open(p, "wb") as f:
            f.write(content)
        os.chown(p, 0, 65532)
        os.chmod(p, 0o440)
    os.chmod(d, 0o755)
    return d


def check_ha_overlay():
    """6: the ha overlay's pods as podman plays them; a failover."""
    import grpc_health
    import ha_kube
    import yaml
    if shutil.which("kubectl") is None:
        log("SKIP 6: no kubectl to render deploy/k8s/overlays/ha")
        return
    rendered = subprocess.run(
        ["kubectl", "kustomize",
         os.path.join(ARGS.source, "deploy/k8s/overlays/ha")],
        capture_output=True, text=True, timeout=120)
    if rendered.returncode != 0:
        fail(f"kubectl kustomize overlays/ha: {rendered.stderr[-1000:]}")
    objects = [o for o in yaml.safe_load_all(rendered.stdout) if o]
    pods, volumes, ports = ha_kube.convert(objects, deploy_lib.free_port)
    for pod in pods:
        for c in pod["spec"]["containers"]:
            c["image"] = c["image"].rsplit(":", 1)[0] + f":{ARGS.tag}"
    path = os.path.join(TMP, "ha-pods.yaml")
    with open(path, "w") as f:
        f.write(ha_kube.dump(pods))
    KUBE_PLAYED.append((path, volumes))
    for v in volumes:
        podman("volume", "rm", "-f", v, check=False)
        podman("volume", "create", v)
        mount = podman("volume", "inspect", "--format", "{{.Mountpoint}}",
                       v).stdout.strip()
        os.chown(mount, 65532, 65532)  # the pods' fsGroup
    # The limits this machine's runc can set (as ULIMITS for podman run).
    conf = os.path.join(TMP, "containers.conf")
    with open(conf, "w") as f:
        f.write('[containers]\ndefault_ulimits = ["nofile=4096:4096", '
                '"nproc=4096:4096"]\n')
    r = subprocess.run(PODMAN + ["kube", "play", path], capture_output=True,
                       text=True, timeout=300,
                       env={**os.environ, "CONTAINERS_CONF": conf})
    if r.returncode != 0:
        fail(f"podman kube play overlays/ha: {r.stderr[-2000:]}")
    log(f"podman kube play overlays/ha: {len(pods)} pods "
        f"({', '.join(p['metadata']['name'] for p in pods)})")
    etcds = [p for p in ports if p.startswith("localsgd-etcd-")]

    def etcd_healthy(pod):
        url = f"http://127.0.0.1:{ports[pod]['client'][1]}/health"
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return json.loads(resp.read()).get("health") == "true"
        except (OSError, ValueError):
            return False
    wait_for("etcd's three members healthy",
             lambda: all(etcd_healthy(p) for p in etcds), timeout=120)
    coordinators = sorted(p for p in ports if p.startswith(
        "localsgd-coordinator-"))
    target = {p: f"127.0.0.1:{ports[p]['grpc'][1]}" for p in coordinators}

    def health(pod, service):
        return grpc_health.check(target[pod], service, timeout=2.0)

    def one_primary():
        ready = [p for p in coordinators if health(p, "") == "SERVING"]
        live = all(health(p, "liveness") == "SERVING" for p in coordinators)
        return ready[0] if len(ready) == 1 and live else None
    primary = wait_for("one coordinator ready (the primary), both live",
                       one_primary, timeout=120)
    standby = [p for p in coordinators if p != primary][0]
    def standby_in_sync():
        r = podman("exec", f"{primary}-coordinator", "localsgdctl",
                   f"--target={target[primary]}", "status", "--json",
                   check=False)
        if r.returncode != 0:
            return False
        standbys = json.loads(r.stdout).get("standbys", [])
        return any(s.get("in_sync") for s in standbys)
    wait_for(f"{standby} in sync with {primary}", standby_in_sync,
             timeout=60)
    log(f"{primary} is the primary (ready), {standby} its standby (live, "
        "not ready, in sync)")
    container = f"{primary}-coordinator"
    pid = int(podman("inspect", "--format", "{{.State.Pid}}",
                     container).stdout.strip())
    # Its log survives the restart: count what comes after.
    caught_up = podman("logs", container).stderr.count("caught up with")
    start = time.monotonic()
    os.kill(pid, 9)
    wait_for(f"{standby} ready after the primary's SIGKILL",
             lambda: health(standby, "") == "SERVING", timeout=60)
    took = time.monotonic() - start
    # The killed one: restarted by its pod (restartPolicy Always), a
    # standby of the new primary.
    wait_for(f"{primary} back as a live standby",
             lambda: health(primary, "liveness") == "SERVING" and
             health(primary, "") == "NOT_SERVING" and
             podman("logs", container).stderr.count("caught up with") >
             caught_up,
             timeout=120)
    log(f"failover: {standby} ready {took:.2f} s after {primary}'s SIGKILL; "
        f"{primary} restarted as its standby")
    cleanup()


def main():
    if os.environ.get("LOCALSGD_IMAGES") == "0":
        skip("LOCALSGD_IMAGES=0")
    for tool in ("podman", "runc", "mmdebstrap"):
        if shutil.which(tool) is None:
            skip(f"{tool} is not installed (scripts/install-deps.sh)")
    if os.getuid() != 0:
        skip("needs root (rootful podman)")
    driver = subprocess.run(
        ["bash", os.path.join(ARGS.source, "scripts/images.sh"), "--driver"],
        capture_output=True, text=True, check=True).stdout.strip()
    PODMAN[:] = ["podman", "--storage-driver", driver, "--runtime", "runc",
                 "--cgroup-manager", "cgroupfs"]
    if not ARGS.no_build:
        check_disk(driver)
        start = time.monotonic()
        r = subprocess.run(["bash", os.path.join(ARGS.source,
                                                 "scripts/images.sh")],
                           cwd=ARGS.source, capture_output=True, text=True,
                           timeout=3600)
        sizes = [x for x in r.stdout.splitlines()
                 if " MB, built in " in x or "storage now holds" in x]
        if r.returncode != 0:
            tail = (r.stdout + r.stderr)[-3000:]
            if "cannot" in tail and "runtime" in tail:
                skip(f"podman cannot run containers here: {tail[-500:]}")
            fail(f"scripts/images.sh failed:\n{tail}")
        for line in sizes:
            log(line.replace("[images] ", ""))
        log(f"images ready in {time.monotonic() - start:.0f} s")
    probe = podman("run", "--rm", *ULIMITS, "--network", "host",
                   "--entrypoint", "/bin/true",
                   f"localsgd/coordinator:{ARGS.tag}", check=False)
    if probe.returncode != 0:
        skip(f"podman cannot run a container here: {probe.stderr[-500:]}")

    # --- 2-4: plaintext, as the base manifests.
    state = state_volume("state")
    c = Coordinator("plain", state)
    log(f"coordinator container SERVING {c.startup_seconds:.1f} s after "
        "podman run")
    if c.health("liveness") != "SERVING":
        fail("liveness is not SERVING")
    if "localsgd_jobs" not in c.metrics():
        fail("/metrics has no localsgd_jobs")
    workers = [run_worker(c, "images", r, 2, ["--epochs=1"]) for r in (0, 1)]
    finals = wait_workers(workers, timeout=900)
    accuracy = float(finals[0]["test_accuracy"])
    rounds = int(finals[0]["rounds"])
    log(f"2 worker containers trained 1 epoch: test accuracy {accuracy:.4f}, "
        f"{rounds} rounds")
    if accuracy < 0.80:
        fail(f"test accuracy {accuracy} below the demo's band (0.80)")
    state_round = int(ctl_status(c, "images")["state_round"])
    podman("kill", "--signal", "TERM", c.name)
    t0 = time.monotonic()
    wait_for("readiness NOT_SERVING after SIGTERM",
             lambda: c.health("") in ("NOT_SERVING", "UNAVAILABLE"),
             timeout=10, interval=0.02)
    code = c.exit_code(GRACE_SECONDS)
    took = time.monotonic() - t0
    if code != 0 or took > GRACE_SECONDS:
        fail(f"after SIGTERM: exit {code} after {took:.1f} s "
             f"(grace {GRACE_SECONDS} s)")
    log(f"SIGTERM: NOT_SERVING, exit 0 after {took:.1f} s")
    c2 = Coordinator("restarted", state)
    restored = int(ctl_status(c2, "images")["state_round"])
    if restored != state_round:
        fail(f"restarted on the volume at round {restored}, want "
             f"{state_round}")
    log(f"a new container on the volume restored the job at round {restored}")
    podman("kill", "--signal", "TERM", c2.name)
    c2.exit_code(GRACE_SECONDS)

    # --- 5: TLS and tokens where the Secrets are mounted.
    pki = certificates()
    read = lambda p: open(os.path.join(pki, p), "rb").read()  # noqa: E731
    tls_dir = secret_dir("tls-secret", {"tls.crt": read("tls.crt"),
                                        "tls.key": read("tls.key"),
                                        "ca.crt": read("ca.crt")})
    token = "images-test-token-0123456789"
    tokens_dir = secret_dir("tokens-secret",
                            {"tokens": f"secure {token}\n".encode()})
    worker_secret = secret_dir("worker-secret",
                               {"ca.crt": read("ca.crt"),
                                "token": f"{token}\n".encode()})
    c3 = Coordinator(
        "tls", state_volume("state-tls"),
        extra_env={"LOCALSGD_TLS_CERT": "/etc/localsgd/tls/tls.crt",
                   "LOCALSGD_TLS_KEY": "/etc/localsgd/tls/tls.key",
                   "LOCALSGD_TOKEN_FILE": "/etc/localsgd/tokens/tokens"},
        mounts=[f"{tls_dir}:/etc/localsgd/tls:ro,Z",
                f"{tokens_dir}:/etc/localsgd/tokens:ro,Z"],
        tls=read("ca.crt"))
    log(f"TLS coordinator container SERVING over TLS {c3.startup_seconds:.1f} "
        "s after podman run")
    w = [run_worker(c3, "secure", r, 2, ["--max_steps=64",
                                         "--tls_ca=/run/worker/ca.crt",
                                         "--token_file=/run/worker/token"],
                    mounts=[f"{worker_secret}:/run/worker:ro,Z"])
         for r in (0, 1)]
    finals = wait_workers(w, timeout=600)
    log(f"2 worker containers with the CA and the token: {finals[0]['rounds']}"
        " rounds over TLS")
    name = run_worker(c3, "secure", 0, 2, ["--max_steps=16",
                                           "--tls_ca=/run/worker/ca.crt"],
                      mounts=[f"{worker_secret}:/run/worker:ro,Z"])
    code = int(podman("wait", name, timeout=120).stdout.strip().splitlines()[-1])
    out = podman("logs", name)
    if code == 0 or "UNAUTHENTICATED" not in out.stdout + out.stderr:
        fail(f"a worker without the token: exit {code}, "
             f"{(out.stdout + out.stderr)[-500:]}")
    log("a worker without the token is refused (UNAUTHENTICATED)")
    podman("kill", "--signal", "TERM", c3.name)
    if c3.exit_code(GRACE_SECONDS) != 0:
        fail("the TLS coordinator did not exit 0 after SIGTERM")
    cleanup()

    # --- 6: the ha overlay, played.
    check_ha_overlay()
    shutil.rmtree(TMP, ignore_errors=True)
    log("OK")


if __name__ == "__main__":
    main()
