"""The deployment agrees with the coordinator it deploys.

Reads the coordinator's flags from its --help (names and defaults) and the
manifests as `kubectl kustomize` renders them, and checks for each overlay:
 - every LOCALSGD_* variable the pod gets names a flag (--foo_bar is
   LOCALSGD_FOO_BAR), and the effective --listen / --metrics_listen ports are
   the container ports named grpc / metrics, the ports of the gRPC health
   probes (readiness on service "", liveness and startup on the service the
   server keeps SERVING while draining), the Service ports and the
   Prometheus annotation; they listen on all addresses;
 - --state_dir is a mounted volume "state" backed by a PersistentVolumeClaim
   (single) or a volumeClaimTemplate (sharded, ha);
 - ha: the coordinators elect through the rendered etcd cluster of three
   (every member in LOCALSGD_HA_ETCD), advertise their pod names under a
   headless Service that publishes not-ready pods, the workers' Service
   routes to ready pods only (the primary), the token comes from a Secret,
   etcd has its PodDisruptionBudget, pods spread over nodes;
 - terminationGracePeriodSeconds exceeds --shutdown_grace plus what the
   server needs after it (results in flight, checkpoints, metrics server);
 - security settings (non-root uid of the image, read-only root filesystem,
   no privilege escalation, all capabilities dropped), resources, the
   PodDisruptionBudget's and Services' selectors, the headless Service;
 - the example worker Job is an elastic Indexed Job that reaches the single
   overlay's Service by its DNS name and port, with rank = completion index
   and every argument a flag of the worker (if its binary is given);
and that deploy/Dockerfile exposes the same ports and runs as that uid, and
docs/deployment.md names every LOCALSGD_* variable and every metric.

usage: consistency_test.py --coordinator=BIN --source_dir=DIR [--worker=BIN]
Exit 77 (skipped) if kubectl is missing.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys

import yaml

FAILURES = []


def check(ok, msg):
    if not ok:
        FAILURES.append(msg)
        print(f"FAIL: {msg}")
    return ok


def help_flags(binary, own_file):
    """{flag: default string} of the flags `binary --help` lists for files
    ending in own_file."""
    r = subprocess.run([binary, "--help"], capture_output=True, text=True)
    text = r.stdout + r.stderr
    flags = {}
    for section in re.split(r"\n  Flags from ", text)[1:]:
        file_name, _, body = section.partition(":\n")
        if not file_name.endswith(own_file):
            continue
        for m in re.finditer(r"--(\w+) \((.*?)\);\s+default: (.*?);\n", body,
                             re.S):
            flags[m.group(1)] = m.group(3).strip().strip('"')
    return flags, text


def parse_duration(text):
    """Seconds of an absl duration such as 30s, 1m30s, 1.5s, 250ms."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
    total, pos = 0.0, 0
    for m in re.finditer(r"(\d+(?:\.\d*)?)(h|ms|us|ns|m|s)", text):
        if m.start() != pos:
            raise ValueError(text)
        total += float(m.group(1)) * units[m.group(2)]
        pos = m.end()
    if pos != len(text) or not text:
        raise ValueError(text)
    return total


def port_of(address):
    return int(address.rsplit(":", 1)[1])


def render(kustomization):
    out = subprocess.run(["kubectl", "kustomize", kustomization],
                         capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def by_kind(objects, kind):
    return [o for o in objects if o["kind"] == kind]


def labels_match(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


def check_coordinator_overlay(name, objects, flags, liveness_service,
                              image_uid):
    print(f"--- overlays/{name}")
    workloads = [o for o in objects if o["kind"] in
                 ("Deployment", "StatefulSet") and
                 o["metadata"]["name"] == "localsgd-coordinator"]
    if not check(len(workloads) == 1,
                 f"{name}: expected one coordinator workload"):
        return
    workload = workloads[0]
    pod = workload["spec"]["template"]
    spec = pod["spec"]
    containers = [c for c in spec["containers"] if c["name"] == "coordinator"]
    if not check(len(containers) == 1, f"{name}: no coordinator container"):
        return
    c = containers[0]
    check(c["image"].startswith("localsgd/coordinator"),
          f"{name}: image {c['image']}")

    # The environment: ConfigMaps by envFrom, then explicit env.
    env = {}
    configmaps = {o["metadata"]["name"]: o for o in by_kind(objects,
                                                            "ConfigMap")}
    for source in c.get("envFrom", []):
        ref = source.get("configMapRef", {}).get("name")
        if check(ref in configmaps, f"{name}: envFrom names a ConfigMap "
                 f"({ref}) that the overlay does not render"):
            env.update(configmaps[ref].get("data", {}))
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
    env_flags = {f"LOCALSGD_{f.upper()}": f for f in flags}
    for key in sorted(env):
        if key.startswith("LOCALSGD_"):
            check(key in env_flags, f"{name}: {key} names no coordinator "
                  "flag (see localsgd-coordinator --help)")
    settings = dict(flags)
    for key, value in env.items():
        if key in env_flags:
            settings[env_flags[key]] = value
    check(spec.get("enableServiceLinks") is False,
          f"{name}: enableServiceLinks must be false (service links inject "
          "LOCALSGD_COORDINATOR_* variables that name no flag)")

    # Ports.
    listen, metrics = settings["listen"], settings["metrics_listen"]
    if not check(metrics, f"{name}: --metrics_listen is empty: no metrics"):
        return None
    grpc_port, metrics_port = port_of(listen), port_of(metrics)
    for what, address in (("listen", listen), ("metrics_listen", metrics)):
        check(address.rsplit(":", 1)[0] in ("0.0.0.0", "[::]", ""),
              f"{name}: --{what}={address} is not reachable from outside "
              "the pod")
    ports = {p["name"]: p for p in c.get("ports", [])}
    check(ports.get("grpc", {}).get("containerPort") == grpc_port,
          f"{name}: container port 'grpc' is not --listen's {grpc_port}")
    check(ports.get("metrics", {}).get("containerPort") == metrics_port,
          f"{name}: container port 'metrics' is not --metrics_listen's "
          f"{metrics_port}")
    probes = {k: c.get(k) for k in ("readinessProbe", "livenessProbe",
                                    "startupProbe")}
    for kind, probe in probes.items():
        if not check(probe and "grpc" in probe,
                     f"{name}: {kind} is not a gRPC health probe"):
            continue
        check(probe["grpc"].get("port") == grpc_port,
              f"{name}: {kind} port {probe['grpc'].get('port')} is not "
              f"--listen's {grpc_port}")
        service = probe["grpc"].get("service", "")
        want = "" if kind == "readinessProbe" else liveness_service
        check(service == want, f"{name}: {kind} asks about service "
              f"'{service}', expected '{want}' (readiness goes NOT_SERVING "
              "on SIGTERM, liveness stays SERVING while draining)")
    annotations = pod["metadata"].get("annotations", {})
    check(annotations.get("prometheus.io/port") == str(metrics_port),
          f"{name}: prometheus.io/port annotation is not {metrics_port}")
    pod_labels = pod["metadata"].get("labels", {})
    # The coordinator's Services (the ha overlay also has etcd's).
    services = [s for s in by_kind(objects, "Service")
                if s["metadata"].get("labels", {}).get(
                    "app.kubernetes.io/component") == "coordinator"]
    check(services, f"{name}: no Service")
    for svc in services:
        s = svc["spec"]
        check(labels_match(s["selector"], pod_labels),
              f"{name}: Service {svc['metadata']['name']} selects no "
              "coordinator pod")
        for p in s["ports"]:
            target = p.get("targetPort", p["port"])
            if isinstance(target, str):
                check(target in ports, f"{name}: Service port {p['name']} "
                      f"targets a container port named {target} that does "
                      "not exist")
                target = ports.get(target, {}).get("containerPort")
            check(p["port"] == target, f"{name}: Service port {p['name']} "
                  f"is {p['port']} but reaches container port {target}")
        named = {p["name"]: p["port"] for p in s["ports"]}
        check(named.get("grpc") == grpc_port and
              named.get("metrics") == metrics_port,
              f"{name}: Service ports {named} differ from the flags")

    # --state_dir on a persistent volume.
    state_dir = settings.get("state_dir", "")
    mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
    check(state_dir and mounts.get("state") == state_dir,
          f"{name}: --state_dir '{state_dir}' is not the mount of volume "
          f"'state' ({mounts.get('state')})")
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    if workload["kind"] == "StatefulSet":
        templates = [t["metadata"]["name"] for t in
                     workload["spec"].get("volumeClaimTemplates", [])]
        check("state" in templates and "state" not in volumes,
              f"{name}: the StatefulSet's state volume is not a "
              "volumeClaimTemplate")
        svc_name = workload["spec"]["serviceName"]
        headless = [s for s in services if s["metadata"]["name"] == svc_name]
        check(headless and headless[0]["spec"].get("clusterIP") == "None",
              f"{name}: serviceName {svc_name} is not a headless Service")
    else:
        claim = volumes.get("state", {}).get("persistentVolumeClaim", {})
        pvcs = [p["metadata"]["name"] for p in
                by_kind(objects, "PersistentVolumeClaim")]
        check(claim.get("claimName") in pvcs,
              f"{name}: volume 'state' is not one of the rendered PVCs "
              f"{pvcs}")
        check(workload["spec"].get("strategy", {}).get("type") == "Recreate",
              f"{name}: a Deployment on a ReadWriteOnce volume must use the "
              "Recreate strategy")
        check(workload["spec"].get("replicas") == 1,
              f"{name}: the single overlay runs one replica")

    # Drain time.
    grace = parse_duration(settings["shutdown_grace"])
    period = spec.get("terminationGracePeriodSeconds", 30)
    # After the grace: >= 2 s for results in flight, ~2 s to stop the
    # metrics server, checkpoints to write.
    check(grace + 5 <= period <= grace + 120,
          f"{name}: terminationGracePeriodSeconds {period} does not fit "
          f"--shutdown_grace {settings['shutdown_grace']} (want grace + 5 s "
          "to grace + 120 s)")

    # Security and resources.
    psc, csc = spec.get("securityContext", {}), c.get("securityContext", {})
    check(psc.get("runAsNonRoot") is True, f"{name}: runAsNonRoot")
    check(psc.get("runAsUser") == image_uid,
          f"{name}: runAsUser {psc.get('runAsUser')} is not the image's "
          f"uid {image_uid}")
    check(psc.get("fsGroup") == image_uid,
          f"{name}: fsGroup must let uid {image_uid} write the state volume")
    check(csc.get("readOnlyRootFilesystem") is True,
          f"{name}: readOnlyRootFilesystem")
    check(csc.get("allowPrivilegeEscalation") is False,
          f"{name}: allowPrivilegeEscalation")
    check(csc.get("capabilities", {}).get("drop") == ["ALL"],
          f"{name}: capabilities must drop ALL")
    resources = c.get("resources", {})
    for kind in ("requests", "limits"):
        for r in ("cpu", "memory"):
            check(r in resources.get(kind, {}), f"{name}: no {kind}.{r}")
    pdbs = [p for p in by_kind(objects, "PodDisruptionBudget")
            if p["metadata"].get("labels", {}).get(
                "app.kubernetes.io/component") == "coordinator"]
    check(len(pdbs) == 1 and labels_match(
        pdbs[0]["spec"]["selector"]["matchLabels"], pod_labels),
        f"{name}: no PodDisruptionBudget selecting the coordinator pods")
    check(labels_match(workload["spec"]["selector"]["matchLabels"],
                       pod_labels), f"{name}: the workload's selector does "
          "not match its pod template")
    return {"grpc_port": grpc_port, "metrics_port": metrics_port,
            "services": {s["metadata"]["name"]: s for s in services},
            "env": env, "workload": workload, "container": c}


def check_ha_overlay(objects, coordinator):
    """The standby coordinators' overlay: the coordinators elect through
    the rendered etcd cluster, advertise themselves by their pod names under
    a headless Service that publishes not-ready pods, the workers' Service
    routes by readiness (the primary alone), and etcd is a quorum of three
    with its own PodDisruptionBudget; pods spread over nodes."""
    name = "ha"
    env, workload = coordinator["env"], coordinator["workload"]
    c = coordinator["container"]
    check(workload["kind"] == "StatefulSet" and
          workload["spec"].get("replicas", 1) >= 2,
          f"{name}: a shard needs a primary and a standby (replicas >= 2)")
    etcds = [o for o in by_kind(objects, "StatefulSet")
             if o["metadata"]["name"] == "localsgd-etcd"]
    if not check(len(etcds) == 1, f"{name}: no etcd StatefulSet"):
        return
    etcd = etcds[0]
    replicas = etcd["spec"].get("replicas", 1)
    check(replicas == 3, f"{name}: etcd runs {replicas} members, not 3")
    etcd_service = etcd["spec"]["serviceName"]
    services = {s["metadata"]["name"]: s for s in by_kind(objects, "Service")}
    es = services.get(etcd_service, {}).get("spec", {})
    check(es.get("clusterIP") == "None" and
          es.get("publishNotReadyAddresses") is True,
          f"{name}: etcd's Service {etcd_service} must be headless and "
          "publish members before they are ready (they find each other "
          "through it)")
    client_port = [p["containerPort"] for p in
                   etcd["spec"]["template"]["spec"]["containers"][0]["ports"]
                   if p["name"] == "client"]
    want = ",".join(f"localsgd-etcd-{i}.{etcd_service}:{client_port[0]}"
                    for i in range(replicas)) if client_port else None
    check(env.get("LOCALSGD_HA_ETCD") == want,
          f"{name}: LOCALSGD_HA_ETCD is {env.get('LOCALSGD_HA_ETCD')!r}, "
          f"not every etcd member ({want!r})")
    peers = workload["spec"]["serviceName"]
    ps = services.get(peers, {}).get("spec", {})
    check(ps.get("publishNotReadyAddresses") is True,
          f"{name}: {peers} must publish not-ready pods: a standby is never "
          "ready, yet its primary and workers reach it by name")
    check(env.get("LOCALSGD_HA_ADVERTISE") ==
          f"$(POD_NAME).{peers}:{coordinator['grpc_port']}",
          f"{name}: LOCALSGD_HA_ADVERTISE is "
          f"{env.get('LOCALSGD_HA_ADVERTISE')!r}, not the pod's name under "
          f"{peers} with the gRPC port")
    pod_name = [e for e in c.get("env", []) if e["name"] == "POD_NAME"]
    check(pod_name and pod_name[0].get("valueFrom", {}).get(
        "fieldRef", {}).get("fieldPath") == "metadata.name",
        f"{name}: POD_NAME is not the downward API's metadata.name")
    token = [e for e in c.get("env", []) if e["name"] == "LOCALSGD_HA_TOKEN"]
    check(token and "secretKeyRef" in token[0].get("valueFrom", {}),
          f"{name}: LOCALSGD_HA_TOKEN does not come from a Secret")
    routed = [s for s in services.values()
              if s["metadata"]["name"] != peers and
              s["metadata"].get("labels", {}).get(
                  "app.kubernetes.io/component") == "coordinator"]
    check(routed and all(s["spec"].get("clusterIP") != "None" and
                         not s["spec"].get("publishNotReadyAddresses")
                         for s in routed),
          f"{name}: the workers' Service must route to ready pods only (the "
          "primary)")
    etcd_pdbs = [p for p in by_kind(objects, "PodDisruptionBudget")
                 if labels_match(p["spec"]["selector"]["matchLabels"],
                                 etcd["spec"]["template"]["metadata"]
                                 ["labels"])]
    check(etcd_pdbs and etcd_pdbs[0]["spec"].get("maxUnavailable") == 1,
          f"{name}: no PodDisruptionBudget keeping etcd's quorum "
          "(maxUnavailable 1)")
    for what, w in (("coordinator", workload), ("etcd", etcd)):
        anti = w["spec"]["template"]["spec"].get("affinity", {}).get(
            "podAntiAffinity", {})
        terms = anti.get("preferredDuringSchedulingIgnoredDuringExecution",
                         []) + anti.get(
            "requiredDuringSchedulingIgnoredDuringExecution", [])
        check(any(t.get("podAffinityTerm", t).get("topologyKey") ==
                  "kubernetes.io/hostname" for t in terms),
              f"{name}: the {what} pods are not spread over nodes "
              "(podAntiAffinity on kubernetes.io/hostname)")
    esc = etcd["spec"]["template"]["spec"]
    check(esc.get("securityContext", {}).get("runAsNonRoot") is True and
          esc["containers"][0].get("securityContext", {}).get(
              "readOnlyRootFilesystem") is True,
          f"{name}: etcd runs as root or with a writable root filesystem")


def check_worker_job(objects, single, worker_flags):
    print("--- examples/fashion-mnist-worker")
    jobs = by_kind(objects, "Job")
    if not check(len(jobs) == 1, "worker example: expected one Job"):
        return
    job = jobs[0]
    spec = job["spec"]
    check(spec.get("completionMode") == "Indexed",
          "worker Job must be Indexed (index = rank)")
    check(spec.get("completions") == spec.get("parallelism"),
          "worker Job: completions == parallelism keeps it elastic")
    c = spec["template"]["spec"]["containers"][0]
    args = {}
    for a in c.get("args", []):
        key, _, value = a.partition("=")
        args[key.lstrip("-")] = value
    m = re.fullmatch(r"(?:dns:///)?([a-z0-9.-]+):(\d+)",
                     args.get("coordinator", ""))
    if check(m, f"worker --coordinator={args.get('coordinator')} is not "
             "host:port"):
        host, port = m.group(1), int(m.group(2))
        service = single["services"].get(host.split(".")[0])
        check(service is not None, f"worker: --coordinator host {host} is "
              "not the single overlay's Service")
        if service:
            named = {p["name"]: p["port"] for p in service["spec"]["ports"]}
            check(named.get("grpc") == port, f"worker: port {port} is not "
                  f"the Service's grpc port {named.get('grpc')}")
    env = {e["name"]: e for e in c.get("env", [])}
    rank = args.get("rank", "")
    ref = re.fullmatch(r"\$\((\w+)\)", rank)
    check(ref and "job-completion-index" in str(env.get(ref.group(1), {})),
          f"worker: --rank={rank} is not the Job's completion index")
    check(int(args.get("world", 0)) >= spec.get("parallelism", 0),
          "worker: --world must cover every rank")
    if worker_flags is not None:
        for key in args:
            check(key in worker_flags, f"worker: --{key} is not a flag of "
                  "localsgd-fashion-mnist")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--source_dir", required=True)
    ap.add_argument("--worker")
    args = ap.parse_args()
    if not shutil.which("kubectl"):
        print("SKIP: kubectl is not installed; cannot render the manifests")
        sys.exit(77)
    src = args.source_dir
    flags, help_text = help_flags(args.coordinator, "server/main.cc")
    check(len(flags) >= 15, f"found only {len(flags)} flags in --help")
    for f in ("listen", "metrics_listen", "state_dir", "shutdown_grace"):
        check(f in flags, f"--help lists no --{f}")
    check("LOCALSGD_" in help_text and "environment" in help_text,
          "--help does not explain the LOCALSGD_* environment variables")
    if FAILURES:
        sys.exit(1)
    print(f"coordinator flags: {', '.join(sorted(flags))}")

    # The health service that stays SERVING while draining, from the source.
    with open(os.path.join(src, "server", "server.h")) as f:
        m = re.search(r'kLivenessService\[\] = "([^"]+)"', f.read())
    liveness = m.group(1) if m else None
    check(liveness, "cannot find kLivenessService in server/server.h")

    # The image's uid, environment (the container's defaults) and ports.
    with open(os.path.join(src, "deploy", "Dockerfile")) as f:
        dockerfile = f.read()
    stage = dockerfile.split("AS coordinator", 1)[1].split("\nFROM ", 1)[0]
    uid = int(re.search(r"^USER (\d+)", stage, re.M).group(1))
    env_flags = {f"LOCALSGD_{f.upper()}": f for f in flags}
    for key, value in re.findall(r"^ENV (\w+)=(\S*)$", stage, re.M):
        if check(key in env_flags, f"Dockerfile: ENV {key} names no flag"):
            flags[env_flags[key]] = value
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.*)$", stage, re.M)
               for p in line.split()}
    check(flags["metrics_listen"] and exposed == {
        port_of(flags["listen"]), port_of(flags["metrics_listen"])},
        f"Dockerfile EXPOSE {sorted(exposed)} differs from the image's "
        f"--listen ({flags['listen']}) and --metrics_listen "
        f"({flags['metrics_listen']})")

    k8s = os.path.join(src, "deploy", "k8s")
    results = {}
    rendered = {}
    for overlay in ("single", "sharded", "ha"):
        rendered[overlay] = render(os.path.join(k8s, "overlays", overlay))
        results[overlay] = check_coordinator_overlay(
            overlay, rendered[overlay], flags, liveness, uid)
    if results["ha"]:
        check_ha_overlay(rendered["ha"], results["ha"])
    worker_flags = None
    if args.worker and os.path.exists(args.worker):
        worker_flags, _ = help_flags(args.worker, "fashion_mnist_worker.cc")
    if results["single"]:
        check_worker_job(
            render(os.path.join(k8s, "examples", "fashion-mnist-worker")),
            results["single"], worker_flags)

    # The documentation names every variable and every metric.
    print("--- docs/deployment.md")
    with open(os.path.join(src, "docs", "deployment.md")) as f:
        docs = f.read()
    for flag in sorted(flags):
        check(f"LOCALSGD_{flag.upper()}" in docs,
              f"docs/deployment.md does not list LOCALSGD_{flag.upper()}")
    with open(os.path.join(src, "server", "metrics.cc")) as f:
        metrics_source = f.read()
    metric_names = set(re.findall(r'"(localsgd_[a-z_]+)"', metrics_source))
    check(len(metric_names) >= 10, f"found only {metric_names} in metrics.cc")
    for metric in sorted(metric_names):
        check(metric in docs, f"docs/deployment.md does not describe {metric}")

    if FAILURES:
        print(f"{len(FAILURES)} failures")
        sys.exit(1)
    print("OK")


if __name__ == "__main__":
    main()
