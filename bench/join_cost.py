#!/usr/bin/python3
"""What a Join's layout costs the coordinator (its tensor count).

Starts a real localsgd-coordinator, then, as a foreign client of
proto/localsgd/v1/coordinator.proto (Python stubs made here with protoc and
grpc_python_plugin), sends Joins with many tensors and prints the
coordinator's resident memory (VmRSS) after each:

  1. 10^6 empty-named tensors of shape [1] (~14 MB): refused with
     RESOURCE_EXHAUSTED by --max_tensors before the layout is decoded;
  2. the same again;
  3. --max_tensors tensors (the most a job may have), accepted: a job.

Usage: bench/join_cost.py [BUILD_DIR]   (default: build)
Environment: COORD_FLAGS, more coordinator flags (e.g.
--keep_freed_memory=false, to see the transient parse memory go back).
Needs Debian's python3-grpcio and protobuf-compiler-grpc (grpc_python_plugin).
"""
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build")


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def main():
    tmp = tempfile.mkdtemp(prefix="join-cost-")
    subprocess.run(
        ["protoc", f"-I{ROOT}/proto", f"--python_out={tmp}",
         f"--grpc_python_out={tmp}",
         "--plugin=protoc-gen-grpc_python=/usr/bin/grpc_python_plugin",
         "localsgd/v1/coordinator.proto"], check=True)
    sys.path.insert(0, tmp)
    import grpc  # noqa: E402
    from localsgd.v1 import coordinator_pb2 as pb  # noqa: E402
    from localsgd.v1 import coordinator_pb2_grpc as pbg  # noqa: E402

    port_file = os.path.join(tmp, "port")
    coordinator = subprocess.Popen(
        [os.path.join(BUILD, "server", "localsgd-coordinator"),
         "--listen=127.0.0.1:0", f"--port_file={port_file}",
         "--max_join_rate=0"] + os.environ.get("COORD_FLAGS", "").split(),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 30
        while not (os.path.exists(port_file) and open(port_file).read()):
            if time.time() > deadline or coordinator.poll() is not None:
                sys.exit("the coordinator did not start")
            time.sleep(0.05)
        port = int(open(port_file).read())
        channel = grpc.insecure_channel(
            f"127.0.0.1:{port}",
            options=[("grpc.max_send_message_length", 64 << 20)])
        stub = pbg.CoordinatorStub(channel)

        def join(job, n, incarnation):
            r = pb.JoinRequest(job_id=job, member_name="m", weight=1,
                               incarnation=incarnation)
            for i in range(n):
                r.layout.tensors.add(name=f"x{i}", shape=[1],
                                     dtype=pb.DTYPE_FLOAT32)
            # Fingerprint left 0: the count is checked first.
            size = r.ByteSize()
            try:
                stub.Join(r, timeout=120)
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
            return size, code

        rows = [("start", 0, "-", rss_kib(coordinator.pid))]
        for label, job, n in [("10^6 tensors", "big", 10**6),
                              ("10^6 tensors again", "big", 10**6)]:
            size, code = join(job, n, len(rows))
            rows.append((label, size, code, rss_kib(coordinator.pid)))
        print("| Join | request bytes | status | coordinator VmRSS MiB |")
        print("|---|---:|---|---:|")
        for label, size, code, rss in rows:
            print(f"| {label} | {size} | {code} | {rss / 1024:.1f} |")
        print("\nThe 65536-tensor layout a job may have (names of 5-6 bytes) "
              "is refused here only for its fingerprint (left 0 by this "
              "script); its decoded form costs about 65536 x (name + shape + "
              "~100 B).")
    finally:
        coordinator.terminate()
        coordinator.wait(timeout=30)


if __name__ == "__main__":
    main()
