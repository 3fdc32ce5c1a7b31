"""scripts/run-demo.sh as a person sees it (scripts/demo_view.py).

 1. On a terminal (a pty of 24 rows x 100 columns): the view is redrawn in
    place, every frame fits the screen (at most 24 lines of at most 100
    columns), the last one shows every worker done; then the summary table
    (one row per worker, the test accuracy) and the plot's path; exit 0.
 2. Not on a terminal: plain lines, one per closed round (as many as the
    coordinator's log closed), the summary, the OK line; the whole output
    stays short; the logs and training.png are in LOG_DIR.

usage: demo_view_test.py SOURCE_DIR BUILD_DIR
"""
import fcntl
import os
import pty
import re
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import termios
import time

SOURCE, BUILD = sys.argv[1], sys.argv[2]
ROWS, COLS = 24, 100
TMP = tempfile.mkdtemp(prefix="localsgd-demo-view.")
ESC = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")


def log(msg):
    print(f"[demo_view] {msg}", flush=True)


def fail(msg, output=b""):
    log(f"FAIL: {msg}")
    if output:
        print(ESC.sub(b"", output[-4000:]).decode(errors="replace"))
    log(f"logs kept in {TMP}")
    sys.exit(1)


def env_for(log_dir):
    env = dict(os.environ, BUILD_DIR=BUILD, LOG_DIR=log_dir, EPOCHS="1",
               WORKERS="3", K="16", EVAL_EVERY_SYNC="2", TERM="xterm")
    env.pop("VIEW", None)
    return env


DEMO = [os.path.join(SOURCE, "scripts", "run-demo.sh"), "--max_steps=64"]


def check_png(path):
    with open(path, "rb") as f:
        head = f.read(24)
    if head[:8] != b"\x89PNG\r\n\x1a\n":
        fail(f"{path} is not a PNG")
    width, height = struct.unpack(">II", head[16:24])
    if width < 400 or height < 300:
        fail(f"{path}: {width}x{height}")


def coordinator_rounds(log_dir):
    with open(os.path.join(log_dir, "coordinator.log"), errors="replace") as f:
        return len(re.findall(r"round \d+ closed \((?!seed)", f.read()))


def on_terminal():
    log_dir = os.path.join(TMP, "tty")
    pid, fd = pty.fork()
    if pid == 0:
        os.chdir(SOURCE)
        os.execve(DEMO[0], DEMO, env_for(log_dir))
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLS, 0, 0))
    out = b""
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 5)
        if not ready:
            continue
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    else:
        os.kill(pid, 9)
        fail("the demo did not finish within 400 s", out)
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    if not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
        fail(f"run-demo.sh on a terminal: wait status {status}", out)
    parts = out.split(b"\x1b[H")
    frames = [p.split(b"\x1b[J")[0] for p in parts[1:]]
    if len(frames) < 2:
        fail(f"{len(frames)} frames: the view was not redrawn", out)
    for i, frame in enumerate(frames):
        lines = ESC.sub(b"", frame).decode(errors="replace").split("\r\n")
        if lines and lines[-1] == "":
            lines.pop()
        if len(lines) > ROWS or any(len(line) > COLS for line in lines):
            fail(f"frame {i}: {len(lines)} lines, widest "
                 f"{max(len(line) for line in lines)} (screen {ROWS}x{COLS})",
                 frame)
    last = ESC.sub(b"", frames[-1]).decode(errors="replace")
    if last.count(" done ") != 3:
        fail("the last frame does not show 3 workers done", frames[-1])
    tail = ESC.sub(b"", parts[-1].split(b"\x1b[J", 1)[-1]).decode(
        errors="replace")
    rows = re.findall(r"^  worker \d +64 +\d+ ", tail, re.M)
    if len(rows) != 3 or "test accuracy 0." not in tail or \
            "plot: " not in tail:
        fail("no summary of 3 workers with the test accuracy and the plot",
             out)
    check_png(os.path.join(log_dir, "training.png"))
    log(f"terminal: {len(frames)} frames, each within {ROWS}x{COLS}; summary "
        "and plot")


def not_on_terminal():
    log_dir = os.path.join(TMP, "plain")
    r = subprocess.run(DEMO, cwd=SOURCE, env=env_for(log_dir),
                       capture_output=True, text=True, timeout=400,
                       stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        fail(f"run-demo.sh: exit {r.returncode}", (r.stdout + r.stderr).encode())
    lines = r.stdout.splitlines()
    if "\x1b[" in r.stdout:
        fail("terminal escapes in plain output", r.stdout.encode())
    rounds = [line for line in lines if re.match(r"round \d+ +\d+/\d+ ", line)]
    closed = coordinator_rounds(log_dir)
    if len(rounds) != closed or closed < 4:
        fail(f"{len(rounds)} round lines, the coordinator closed {closed}",
             r.stdout.encode())
    if len(lines) > closed + 25:
        fail(f"{len(lines)} lines of output for {closed} rounds",
             r.stdout.encode())
    if not any(line.startswith("[demo] OK") for line in lines) or \
            "summary" not in lines:
        fail("no summary or OK line", r.stdout.encode())
    for w in range(3):
        with open(os.path.join(log_dir, f"worker{w}.log")) as f:
            if f"rank={w} final " not in f.read():
                fail(f"worker{w}.log has no final line")
    check_png(os.path.join(log_dir, "training.png"))
    log(f"plain: {len(lines)} lines, {closed} round lines; logs and plot in "
        "LOG_DIR")


def main():
    on_terminal()
    not_on_terminal()
    shutil.rmtree(TMP, ignore_errors=True)
    log("OK")


if __name__ == "__main__":
    main()
