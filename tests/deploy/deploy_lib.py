"""Processes for the process-level tests of tests/deploy: the coordinator
binary, scripted members (scripted_member.cc, one command in, one line out),
HTTP requests, and waits on conditions (never a sleep as synchronisation).

Used by dashboard_test.py, grafana_test.py, images_test.py and the Python
package's tests (tests/python/conftest.py); run on /usr/bin/python3.
"""
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def poll_until(predicate, timeout, interval=0.05):
    """Calls `predicate` until it returns a true value (returned) or
    `timeout` seconds pass (its last value is returned)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def free_port():
    """A TCP port of 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Env:
    """A scratch directory and every process started in it; close() stops
    them and, on success, removes the directory."""

    def __init__(self, tag):
        self.tag = tag
        self.tmp = tempfile.mkdtemp(prefix=f"localsgd-{tag}.")
        self.procs = []

    def log(self, msg):
        print(f"[{self.tag}] {msg}", flush=True)

    def fail(self, msg):
        self.log(f"FAIL: {msg}")
        for name in sorted(os.listdir(self.tmp)):
            if name.endswith(".log"):
                with open(os.path.join(self.tmp, name), errors="replace") as f:
                    print(f"----- {name} (last 40 lines)")
                    print("".join(f.readlines()[-40:]), end="")
        self.close(keep=True)
        sys.exit(1)

    def check(self, condition, msg):
        if not condition:
            self.fail(msg)

    def wait_for(self, what, predicate, timeout=30.0, interval=0.05):
        """Polls `predicate` until it returns a true value; fails after
        `timeout` seconds."""
        value = poll_until(predicate, timeout, interval)
        if not value:
            self.fail(f"timed out after {timeout}s waiting for {what}")
        return value

    def spawn(self, args, log_name, **kwargs):
        proc = subprocess.Popen(
            args, stderr=open(os.path.join(self.tmp, log_name), "w"),
            **kwargs)
        self.procs.append(proc)
        return proc

    def close(self, keep=False):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.procs = []
        if keep:
            self.log(f"logs kept in {self.tmp}")
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)


class Coordinator:
    """The coordinator binary on loopback. `ports` names the extra port
    files to wait for (e.g. "http" for --http_listen/--http_port_file)."""

    def __init__(self, env, binary, tag, args, ports=()):
        self.env = env
        files = {"": os.path.join(env.tmp, f"{tag}.port")}
        flags = [f"--port_file={files['']}"]
        for p in ports:
            files[p] = os.path.join(env.tmp, f"{tag}.{p}_port")
            flags.append(f"--{p}_port_file={files[p]}")
        self.proc = env.spawn([binary, "--listen=127.0.0.1:0", *flags, *args],
                              f"coordinator-{tag}.log",
                              stdout=subprocess.DEVNULL)
        self.ports = {}
        for key, path in files.items():
            def read(path=path):
                if self.proc.poll() is not None:
                    env.fail(f"coordinator exited with {self.proc.returncode} "
                             "before serving")
                try:
                    with open(path) as f:
                        return int(f.read().strip())
                except (OSError, ValueError):
                    return None
            self.ports[key] = env.wait_for(f"port file {path}", read)
        self.target = f"127.0.0.1:{self.ports['']}"

    def url(self, port_key, path):
        return f"http://127.0.0.1:{self.ports[port_key]}{path}"

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.env.fail("coordinator still running 60 s after SIGTERM")


class Member:
    """A scripted_member process: one command in, one line out."""

    def __init__(self, env, binary, coordinator, job, name, extra=()):
        self.env = env
        self.name = name
        self.proc = env.spawn(
            [binary, f"--target={coordinator.target}", f"--job={job}",
             f"--name={name}", "--elements=1000", "--chunk_elements=256",
             "--max_retry_time=0s", *extra],
            f"member-{job}-{len(env.procs)}.log",
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            bufsize=1)

    def send(self, command):
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def reply(self, timeout=30.0):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.env.fail(f"member {self.name}: no reply within {timeout}s")
        line = self.proc.stdout.readline().strip()
        if not line:
            self.env.fail(f"member {self.name} exited ({self.proc.poll()})")
        return line

    def do(self, command):
        self.send(command)
        line = self.reply()
        if not line.startswith("ok "):
            self.env.fail(f"member {self.name}: '{command}' -> {line}")
        return line


def http(url, method="GET", headers=None):
    """(status, headers, body bytes); HTTP errors are returned, not raised."""
    request = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def http_json(url, headers=None):
    status, _, body = http(url, headers=headers)
    return status, json.loads(body)


def prometheus_samples(text):
    """{(name, frozenset(labels.items())): value} of a /metrics text."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        name, labels = key, {}
        if "{" in key:
            name, rest = key.split("{", 1)
            for part in rest.rstrip("}").split('",'):
                if part:
                    k, v = part.split('="', 1)
                    labels[k] = v.rstrip('"')
        samples[(name, frozenset(labels.items()))] = float(value)
    return samples
