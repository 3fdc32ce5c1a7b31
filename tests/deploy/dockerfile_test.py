"""What can be checked of deploy/Dockerfile without a container engine.

 - The stages exist: builder, coordinator, worker-builder, worker, etcd; the
   runtime stages start from Debian 12 (bookworm), not from a build stage.
 - The coordinator stage installs no compiler, build tool, -dev package or
   LibTorch, runs as uid 65532, exposes the gRPC and metrics ports and runs
   the coordinator.
 - Every shared library that the built binaries load (ldd on this tree's
   build) belongs to a Debian package (dpkg -S) that the stage installs,
   directly or as a dependency (apt-cache depends --recurse), or to the base
   image's essential set.
 - Every package the Dockerfile names exists in Debian 12 (apt-cache show);
   the build stages have every build package of scripts/install-deps.sh that
   their targets need.
 - Every path the build stages COPY exists in the repository.

usage: dockerfile_test.py --dockerfile=PATH --coordinator=BIN
                          --localsgdctl=BIN [--worker=BIN]
"""
import argparse
import os
import re
import shutil
import subprocess
import sys

FAILURES = []


def check(ok, msg):
    if not ok:
        FAILURES.append(msg)
        print(f"FAIL: {msg}")
    return ok


def parse_dockerfile(path):
    """Stages in order: {name, base, instructions [(op, args)]}."""
    with open(path) as f:
        text = f.read()
    text = re.sub(r"\\\n", " ", text)  # line continuations
    stages = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        op, _, args = line.partition(" ")
        op = op.upper()
        if op == "FROM":
            m = re.match(r"(\S+)(?:\s+AS\s+(\S+))?", args.strip(), re.I)
            stages.append({"name": m.group(2), "base": m.group(1),
                           "instructions": []})
        elif stages:
            stages[-1]["instructions"].append((op, args.strip()))
    return stages


def apt_packages(stage):
    """Packages that `apt-get install` lines of a stage name."""
    pkgs = []
    for op, args in stage["instructions"]:
        if op != "RUN":
            continue
        for command in re.split(r"&&|;", args):
            words = command.split()
            if "apt-get" in words and "install" in words:
                after = words[words.index("install") + 1:]
                pkgs += [w for w in after if not w.startswith("-")]
    return pkgs


def ldd_packages(binary):
    """{package: [libraries]} of the shared libraries `binary` loads."""
    out = subprocess.run(["ldd", binary], capture_output=True, text=True,
                         check=True).stdout
    libs = {}  # library -> the spellings of its path dpkg may know
    for line in out.splitlines():
        m = re.search(r"=>\s+(/\S+)", line)
        if not m:
            continue
        lib = m.group(1)
        candidates = {lib, os.path.realpath(lib)}
        for p in list(candidates):  # merged /usr: /lib and /usr/lib
            if p.startswith("/usr/lib/"):
                candidates.add(p[len("/usr"):])
            elif p.startswith("/lib/"):
                candidates.add("/usr" + p)
        libs[lib] = candidates
    # One dpkg -S for all (each call reads the whole package database).
    everything = sorted(set().union(*libs.values())) if libs else []
    r = subprocess.run(["dpkg", "-S", *everything], capture_output=True,
                       text=True)
    owner_of = {}
    for line in r.stdout.splitlines():
        pkgs, _, path = line.partition(": ")
        owner_of[path.strip()] = pkgs.split(",")[0].split(":")[0].strip()
    result = {}
    for lib, candidates in sorted(libs.items()):
        owners = [owner_of[c] for c in candidates if c in owner_of]
        if not check(owners, f"{binary}: no Debian package owns {lib}"):
            continue
        result.setdefault(owners[0], []).append(os.path.basename(lib))
    return result


def dependency_closure(pkgs):
    """The packages `pkgs` pull in (Depends and PreDepends, recursively)."""
    r = subprocess.run(
        ["apt-cache", "depends", "--recurse", "--no-recommends",
         "--no-suggests", "--no-conflicts", "--no-breaks", "--no-replaces",
         "--no-enhances", *pkgs], capture_output=True, text=True)
    if not check(r.returncode == 0, f"apt-cache depends failed: {r.stderr}"):
        return set(pkgs)
    closure = set()
    for line in r.stdout.splitlines():
        name = line.strip()
        if ":" in name:  # "Depends: libfoo" / "PreDepends: ..."
            name = name.split(":", 1)[1].strip()
        name = name.strip("<>|").split(":")[0]
        if name:
            closure.add(name)
    return closure


def check_runtime_stage(stage, binaries, what):
    pkgs = apt_packages(stage)
    print(f"{what} stage installs: {' '.join(pkgs)}")
    closure = dependency_closure(pkgs)
    # What the base image has: the C library (and its own dependencies).
    closure |= dependency_closure(["libc6"])
    for binary in binaries:
        for owner, libs in sorted(ldd_packages(binary).items()):
            check(owner in closure,
                  f"{what}: {os.path.basename(binary)} loads {libs} from "
                  f"package {owner}, which the stage does not install")
    return pkgs, closure


def install_deps_packages(source_dir):
    with open(os.path.join(source_dir, "scripts", "install-deps.sh")) as f:
        text = f.read()
    m = re.search(r"PKGS=\((.*?)\)", text, re.S)
    return set(m.group(1).split()) if m else set()


def check_image_stage(name, stage, entrypoint, ports=None):
    """A runtime stage runs as uid 65532, its ENTRYPOINT names
    `entrypoint`, and (if `ports` is given) it exposes exactly those."""
    ops = stage["instructions"]
    users = [a for op, a in ops if op == "USER"]
    check(users and users[-1] in ("65532", "65532:65532"),
          f"{name} stage USER is {users}, expected 65532:65532")
    entry = [a for op, a in ops if op == "ENTRYPOINT"]
    check(entry and entrypoint in entry[-1],
          f"{name} ENTRYPOINT is {entry}")
    if ports is not None:
        exposed = {p.split("/")[0] for op, a in ops if op == "EXPOSE"
                   for p in a.split()}
        check(exposed == ports, f"{name} stage exposes {sorted(exposed)}, "
              f"expected {', '.join(sorted(ports))}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dockerfile", required=True)
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--localsgdctl", required=True)
    ap.add_argument("--worker")
    args = ap.parse_args()
    source_dir = os.path.dirname(os.path.dirname(os.path.abspath(
        args.dockerfile)))
    for tool in ["ldd", "dpkg", "apt-cache"]:
        if not shutil.which(tool):
            print(f"SKIP: {tool} is missing (not a Debian system?)")
            sys.exit(77)

    stages = {s["name"]: s for s in parse_dockerfile(args.dockerfile)}
    for name in ["builder", "coordinator", "worker-builder", "worker"]:
        check(name in stages, f"no stage named {name}")
    if FAILURES:
        sys.exit(1)
    for name in ["builder", "coordinator", "worker"]:
        check(stages[name]["base"].startswith("debian:bookworm") or
              stages[name]["base"].startswith("debian:12"),
              f"stage {name} is not based on Debian 12: "
              f"{stages[name]['base']}")

    # The coordinator image.
    coord = stages["coordinator"]
    pkgs, closure = check_runtime_stage(
        coord, [args.coordinator, args.localsgdctl], "coordinator")
    build_tools = {"build-essential", "gcc", "g++", "cpp", "cmake",
                   "ninja-build", "make", "clang", "protobuf-compiler",
                   "protobuf-compiler-grpc", "pkg-config"}
    for p in sorted(closure):
        check(not p.endswith("-dev") and p not in build_tools,
              f"coordinator image would contain {p} (a build package)")
        check("torch" not in p, f"coordinator image would contain {p}")
    for binary in (args.coordinator, args.localsgdctl):
        owners = ldd_packages(binary)
        check(not any("torch" in o for o in owners),
              f"{binary} links LibTorch")
    ops = [(op, a) for op, a in coord["instructions"]]
    check_image_stage("coordinator", coord, "localsgd-coordinator",
                      {"50051", "9090"})
    copies = [a for op, a in ops if op == "COPY"]
    check(all(a.startswith("--from=builder") for a in copies),
          f"coordinator stage copies from outside the builder: {copies}")

    # The worker image.
    worker = stages["worker"]
    binaries = [args.worker] if args.worker and os.path.exists(
        args.worker) else []
    if not binaries:
        print("note: no worker binary (not a LibTorch build): the worker "
              "stage's packages are checked by name only")
    check_runtime_stage(worker, binaries, "worker")
    check_image_stage("worker", worker, "localsgd-fashion-mnist")
    check("dataset-fashion-mnist" in apt_packages(worker),
          "the worker image lacks the data set (dataset-fashion-mnist)")

    # The etcd image (deploy/k8s/overlays/ha): Debian's etcd-server, as
    # the coordinator's uid, its data directory the pod's volume.
    if check("etcd" in stages, "no stage named etcd"):
        etcd = stages["etcd"]
        check(etcd["base"].startswith("debian:bookworm"),
              f"stage etcd is not based on Debian 12: {etcd['base']}")
        check("etcd-server" in apt_packages(etcd),
              "the etcd stage does not install Debian's etcd-server")
        check_image_stage("etcd", etcd, "/usr/bin/etcd", {"2379", "2380"})

    # Build stages against scripts/install-deps.sh.
    deps = install_deps_packages(source_dir)
    check(deps, "cannot read the package list of scripts/install-deps.sh")
    builder = set(apt_packages(stages["builder"]))
    worker_builder = builder | set(apt_packages(stages["worker-builder"]))
    test_only = {"libgtest-dev", "libgmock-dev", "libbenchmark-dev"}
    torch_only = {"libtorch-dev", "libgloo-dev", "zlib1g-dev"}
    for p in sorted(deps):
        if not p.endswith("-dev") or p in test_only:
            continue
        if p in torch_only:
            check(p in worker_builder,
                  f"worker-builder lacks {p} (scripts/install-deps.sh)")
        else:
            check(p in builder, f"builder lacks {p} (scripts/install-deps.sh)")
    for name in ["builder", "worker-builder"]:
        for op, a in stages[name]["instructions"]:
            if op == "COPY" and not a.startswith("--from"):
                for src in a.split()[:-1]:
                    check(os.path.exists(os.path.join(source_dir, src)),
                          f"stage {name} copies {src}, which does not exist")

    # Every package named exists in Debian 12 (from the local apt lists).
    names = sorted({p for s in stages.values() for p in apt_packages(s)})
    r = subprocess.run(["apt-cache", "show", "--no-all-versions", *names],
                       capture_output=True, text=True)
    known = set(re.findall(r"^Package: (\S+)", r.stdout, re.M))
    missing = [p for p in names if p not in known]
    if len(known) == 0:
        print("note: apt lists are empty (no apt-get update): package names "
              "not checked")
    else:
        check(not missing, f"packages unknown to apt: {missing}")

    if FAILURES:
        print(f"{len(FAILURES)} failures")
        sys.exit(1)
    print("OK")


if __name__ == "__main__":
    main()
