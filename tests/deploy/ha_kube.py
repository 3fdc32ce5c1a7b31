"""deploy/k8s/overlays/ha as podman plays Kubernetes YAML (`podman kube
play`), for the image test: the rendered overlay's pods, their specs as
written, on one machine without a cluster.

podman 4.3 plays Pods, Deployments, PersistentVolumeClaims and ConfigMaps;
what the overlay has beyond that is converted here, and only that:
 - each StatefulSet becomes its pods (<name>-<ordinal>, the hostname set),
   each volumeClaimTemplate a PersistentVolumeClaim volume of a podman
   volume named <template>-<pod>, made beforehand and owned by the pod's
   fsGroup (podman applies no fsGroup);
 - Services and PodDisruptionBudgets are not played: no cluster DNS, so
   the pods share the host's network and every <pod>.<service>:<port> and
   0.0.0.0:<port> of a pod becomes 127.0.0.1 with a port of its own (named
   ports in probes too); containerPorts are dropped (podman refuses port
   mappings on the host's network);
 - what the kubelet resolves is resolved here: $(VAR) references, the
   downward API's metadata.name, the ConfigMap of envFrom (inlined, the
   container's own env winning as in Kubernetes), and the optional Secret
   of the replication token (a test token; absent optional Secret volumes
   are dropped);
 - probes are kept in the YAML; podman 4.3 runs none of the gRPC ones, so
   the test asks what the kubelet would ask (grpc.health.v1 on readiness's
   service "") from outside.
"""
import copy
import re

import yaml

HA_TOKEN = "ha-test-token"


def _expand(value, env):
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)),
                  value)


def convert(objects, free_port):
    """(pods, volumes, ports): the Pod objects to play, the podman volumes
    they claim, and {pod: {port name: host port}}."""
    configmaps = {o["metadata"]["name"]: o.get("data", {})
                  for o in objects if o["kind"] == "ConfigMap"}
    sets = [o for o in objects if o["kind"] == "StatefulSet"]
    ports = {}
    for s in sets:
        for i in range(s["spec"].get("replicas", 1)):
            pod = f"{s['metadata']['name']}-{i}"
            ports[pod] = {}
            for c in s["spec"]["template"]["spec"]["containers"]:
                for p in c.get("ports", []):
                    ports[pod][p["name"]] = (p["containerPort"], free_port())
    # <pod>.<service>:<port> -> 127.0.0.1:<its port>, for every pod.
    addresses = {}
    for s in sets:
        service = s["spec"]["serviceName"]
        for i in range(s["spec"].get("replicas", 1)):
            pod = f"{s['metadata']['name']}-{i}"
            for old, new in ports[pod].values():
                addresses[f"{pod}.{service}:{old}"] = f"127.0.0.1:{new}"

    def rewrite(value, pod):
        for old, new in addresses.items():
            value = value.replace(old, new)
        for old, new in ports[pod].values():
            value = value.replace(f"0.0.0.0:{old}", f"127.0.0.1:{new}")
        return value

    pods, volumes = [], []
    for s in sets:
        for i in range(s["spec"].get("replicas", 1)):
            name = f"{s['metadata']['name']}-{i}"
            spec = copy.deepcopy(s["spec"]["template"]["spec"])
            spec["hostNetwork"] = True
            spec["hostname"] = name
            present = []
            for v in spec.get("volumes", []):
                if v.get("secret", {}).get("optional"):
                    continue  # an optional Secret that does not exist
                present.append(v)
            for t in s["spec"].get("volumeClaimTemplates", []):
                claim = f"{t['metadata']['name']}-{name}"
                volumes.append(claim)
                present.append({"name": t["metadata"]["name"],
                                "persistentVolumeClaim": {
                                    "claimName": claim}})
            spec["volumes"] = present
            kept = {v["name"] for v in present}
            for c in spec["containers"]:
                c["volumeMounts"] = [m for m in c.get("volumeMounts", [])
                                     if m["name"] in kept]
                env = {}
                for source in c.pop("envFrom", []):
                    env.update(configmaps[source["configMapRef"]["name"]])
                for e in c.get("env", []):
                    if "value" in e:
                        env[e["name"]] = e["value"]
                    elif e.get("valueFrom", {}).get("fieldRef", {}).get(
                            "fieldPath") == "metadata.name":
                        env[e["name"]] = name
                    elif "secretKeyRef" in e.get("valueFrom", {}):
                        env[e["name"]] = HA_TOKEN
                env = {k: rewrite(_expand(v, env), name)
                       for k, v in env.items()}
                c["env"] = [{"name": k, "value": v}
                            for k, v in sorted(env.items())]
                c["args"] = [rewrite(_expand(a, env), name)
                             for a in c.get("args", [])]
                if not c["args"]:
                    del c["args"]
                # On the host's network podman refuses port mappings, and
                # containerPort maps: the ports are the flags' alone.
                c.pop("ports", None)
                for kind in ("readinessProbe", "livenessProbe",
                             "startupProbe"):
                    probe = c.get(kind, {})
                    for handler in probe.values():
                        if isinstance(handler, dict) and "port" in handler:
                            port = handler["port"]
                            if isinstance(port, str):
                                handler["port"] = ports[name][port][1]
                            else:
                                handler["port"] = {
                                    old: new for old, new in
                                    ports[name].values()}.get(port, port)
            pods.append({"apiVersion": "v1", "kind": "Pod",
                         "metadata": {"name": name, "labels": copy.deepcopy(
                             s["spec"]["template"]["metadata"]["labels"])},
                         "spec": spec})
    return pods, volumes, ports


def dump(pods):
    return yaml.safe_dump_all(pods, sort_keys=False)
