"""Fixtures of the Python package's tests (run by ctest: tests/CMakeLists.txt
sets PYTHONPATH to the build tree's python/ and the binaries' paths).

coordinator(*flags): the real coordinator binary on loopback, stopped at
the end of the test. cpp_member(coordinator, job, name): a C++ member
(tests/deploy/scripted_member, on the C++ client library) driven line by
line. Every wait is for a condition, bounded.
"""
import os
import select
import signal
import subprocess
import sys
import tempfile

import pytest

# The process helpers of tests/deploy (poll_until, free_port).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "deploy"))
import deploy_lib  # noqa: E402

COORDINATOR = os.environ.get("LOCALSGD_COORDINATOR_BINARY", "")
SCRIPTED_MEMBER = os.environ.get("LOCALSGD_SCRIPTED_MEMBER", "")
CPP_WORKER = os.environ.get("LOCALSGD_CPP_WORKER", "")
SOURCE_DIR = os.environ.get("LOCALSGD_SOURCE_DIR", "")


def wait_for(what, predicate, timeout=30.0, interval=0.02):
    value = deploy_lib.poll_until(predicate, timeout, interval)
    assert value, f"timed out after {timeout}s waiting for {what}"
    return value


free_port = deploy_lib.free_port


class Coordinator:
    def __init__(self, tmp, flags):
        self.dir = tempfile.mkdtemp(dir=tmp, prefix="coordinator.")
        port_file = os.path.join(self.dir, "port")
        self.log_path = os.path.join(self.dir, "log")
        self.proc = subprocess.Popen(
            [COORDINATOR, "--listen=127.0.0.1:0", f"--port_file={port_file}",
             *flags], stdout=subprocess.DEVNULL,
            stderr=open(self.log_path, "w"))

        def port():
            assert self.proc.poll() is None, \
                f"coordinator exited: {open(self.log_path).read()[-2000:]}"
            try:
                with open(port_file) as f:
                    return int(f.read().strip())
            except (OSError, ValueError):
                return None
        self.port = wait_for("the coordinator's port", port)
        self.target = f"127.0.0.1:{self.port}"

    def log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class CppMember:
    """scripted_member: one command in, one line out ("ok ..." or
    "error <command> <CODE> <message>")."""

    def __init__(self, coordinator, job, name, weight=1.0, elements=1000,
                 extra=()):
        self.name = name
        self.proc = subprocess.Popen(
            [SCRIPTED_MEMBER, f"--target={coordinator.target}", f"--job={job}",
             f"--name={name}", f"--elements={elements}", f"--weight={weight}",
             "--max_retry_time=5s", *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True, bufsize=1)

    def send(self, command):
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def reply(self, timeout=60.0):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"{self.name}: no reply within {timeout}s"
        line = self.proc.stdout.readline().strip()
        assert line, f"{self.name} exited ({self.proc.poll()})"
        return line

    def do(self, command):
        self.send(command)
        line = self.reply()
        assert line.startswith("ok "), f"{self.name}: {command} -> {line}"
        return dict(f.split("=", 1) for f in line.split()[2:] if "=" in f)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def coordinator(tmp_path):
    if not COORDINATOR:
        pytest.fail("LOCALSGD_COORDINATOR_BINARY is not set (run through "
                    "ctest)")
    started = []

    def start(*flags):
        c = Coordinator(str(tmp_path), flags)
        started.append(c)
        return c
    yield start
    for c in started:
        c.stop()


@pytest.fixture
def cpp_member():
    if not SCRIPTED_MEMBER:
        pytest.fail("LOCALSGD_SCRIPTED_MEMBER is not set (run through ctest)")
    started = []

    def start(*args, **kwargs):
        m = CppMember(*args, **kwargs)
        started.append(m)
        return m
    yield start
    for m in started:
        m.close()
