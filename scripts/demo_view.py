#!/usr/bin/python3
"""The compact view of a local run (scripts/run-demo.sh, scripts/run-nodes.sh).

While the workers train it shows, from their logs (the example worker's
"rank=R ..." lines) and the coordinator's /api/v1/status:
  - a progress bar per worker: epoch, step, recent training loss, rounds;
  - a line per closed round: round, contributors, round time, bytes moved
    (what the workers sent and received for it), the latest test accuracy.
On a terminal the view is redrawn in place and fits one screen; otherwise
it prints plain lines (one per round, and the workers' progress every 10
rounds). When every worker process is gone it prints a summary table (per
worker: steps, rounds, late / dropped / timed out, sync time, bytes) and
writes a PNG of training loss and test accuracy against steps with the
sync rounds marked (python3-matplotlib), next to the logs.

Exit status: 0 once the workers are gone and the summary is printed (the
launcher reports the workers' own exit statuses).

usage: demo_view.py --log_dir DIR --workers N --pids PID,... --status URL
                    [--labels L,...] [--title TEXT] [--plot FILE]
"""
import argparse
import json
import os
import re
import shutil
import sys
import time
import urllib.error
import urllib.request

KV = re.compile(r"(\w+)=(\S+)")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--log_dir", required=True)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--pids", required=True,
                   help="comma-separated pids of the worker processes")
    p.add_argument("--status", required=True,
                   help="the coordinator's /api/v1/status URL")
    p.add_argument("--labels", default="",
                   help="comma-separated worker labels (default: worker R)")
    p.add_argument("--title", default="localsgd")
    p.add_argument("--plot", default="")
    p.add_argument("--interval", type=float, default=0.5)
    return p.parse_args()


class Worker:
    """What one worker's log says so far (read incrementally)."""

    def __init__(self, rank, label, path):
        self.rank, self.label, self.path = rank, label, path
        self.offset = 0
        self.partial = ""
        self.total_steps = 0
        self.epochs = 0
        self.step = 0
        self.epoch = 0
        self.loss = None
        self.losses = []   # (step, mean loss over the last log_every steps)
        self.syncs = []    # dicts of the sync lines
        self.evals = []    # (step, round, accuracy)
        self.final = None
        self.error = None
        self.late = 0

    def poll(self):
        try:
            with open(self.path, errors="replace") as f:
                f.seek(self.offset)
                data = f.read()
                self.offset = f.tell()
        except OSError:
            return
        lines = (self.partial + data).split("\n")
        self.partial = lines.pop()
        for line in lines:
            self.parse(line)

    def parse(self, line):
        if "error:" in line and "localsgd-fashion-mnist" in line:
            self.error = line.strip()
        if not line.startswith(f"rank={self.rank} "):
            return
        rest = line[len(f"rank={self.rank} "):]
        word = rest.split(" ", 1)[0]
        kv = dict(KV.findall(rest))
        if word == "start":
            self.total_steps = int(kv.get("steps", 0))
        elif word.startswith("step="):
            self.step = int(kv["step"])
            self.epoch = int(kv.get("epoch", 0))
            self.loss = float(kv["loss"])
            self.losses.append((self.step, self.loss))
        elif word == "sync" and "round" in kv:
            self.syncs.append(kv)
            self.step = max(self.step, int(kv.get("step", 0)))
            if kv.get("late") == "1":
                self.late += 1
        elif word == "eval":
            self.evals.append((int(kv["step"]), int(kv["round"]),
                               float(kv["test_accuracy"])))
        elif word == "final":
            self.final = kv
            self.step = int(kv.get("step", self.step))

    def bytes_at(self, round_):
        """Cumulative bytes (sent + received) after its sync of `round_`."""
        for s in self.syncs:
            if int(s["round"]) == round_ and "bytes_sent" in s:
                return int(s["bytes_sent"]) + int(s["bytes_received"])
        return None


def fmt_bytes(n):
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000.0
    return ""


def fmt_secs(s):
    s = int(s)
    return f"{s // 60}:{s % 60:02d}"


def alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class View:
    def __init__(self, args):
        self.args = args
        labels = [x for x in args.labels.split(",") if x] or \
            [f"worker {r}" for r in range(args.workers)]
        self.workers = [Worker(r, labels[r], os.path.join(
            args.log_dir, f"worker{r}.log")) for r in range(args.workers)]
        self.pids = [int(p) for p in args.pids.split(",") if p]
        self.rounds = {}          # round -> RoundStatus (from the coordinator)
        self.status_error = ""
        self.printed = set()      # rounds printed (plain mode)
        self.start = time.monotonic()
        self.tty = sys.stdout.isatty()
        self.job = None

    def poll_status(self):
        try:
            with urllib.request.urlopen(self.args.status, timeout=2) as r:
                body = json.loads(r.read())
            self.status_error = ""
        except urllib.error.HTTPError as e:
            self.status_error = ("waiting for the first member to create the "
                                 "job" if e.code == 404 else str(e))
            return
        except (OSError, ValueError) as e:
            self.status_error = str(e)
            return
        for job in body.get("jobs", []):
            self.job = job
            for rs in job.get("recent_rounds", []):
                self.rounds[int(rs["round"])] = rs

    def member_worker(self, name):
        """The worker rank a member name belongs to (rank3, node-rank2x2)."""
        m = re.search(r"rank(\d+)", name)
        return int(m.group(1)) if m else None

    def round_row(self, r):
        """(round, contributors, seconds, bytes, accuracy) of round r."""
        rs = self.rounds[r]
        contributors = f"{len(rs['contributors'])}/{len(rs['participants'])}"
        seconds = int(rs["duration_ms"]) / 1000.0
        moved = 0
        for w in self.workers:
            now, before = w.bytes_at(r), None
            if now is None:
                continue
            for s in w.syncs:
                if int(s["round"]) < r and "bytes_sent" in s:
                    before = int(s["bytes_sent"]) + int(s["bytes_received"])
            moved += now - (before or 0)
        accuracy = None
        for w in self.workers:
            for step, round_, acc in w.evals:
                if round_ <= r:
                    accuracy = acc
        return r, contributors, seconds, moved, accuracy, rs

    def round_text(self, row):
        r, contributors, seconds, moved, accuracy, rs = row
        extra = []
        for what in ("late", "dropped", "timed_out"):
            if rs.get(what):
                extra.append(f"{what.replace('_', ' ')}: {','.join(rs[what])}")
        acc = f"{accuracy:.4f}" if accuracy is not None else "-"
        reason = rs["close_reason"].replace("CLOSE_REASON_", "").lower()
        return (f"{r:>5}  {contributors:>5}  {seconds:>7.2f} s  "
                f"{fmt_bytes(moved):>9}  {acc:>8}  {reason}"
                + ("  " + "; ".join(extra) if extra else ""))

    def bar(self, w, width):
        frac = min(1.0, w.step / w.total_steps) if w.total_steps else 0.0
        filled = int(round(frac * width))
        loss = f"{w.loss:.4f}" if w.loss is not None else "-"
        state = "done" if w.final else ("FAILED" if w.error else
                                        f"{frac * 100:3.0f}%")
        return (f"{w.label:<10} [{'#' * filled}{'.' * (width - filled)}] "
                f"{state:>4}  epoch {w.epoch + 1}  step {w.step}/"
                f"{w.total_steps or '?'}  loss {loss}  rounds {len(w.syncs)}")

    def closed_rounds(self):
        return sorted(r for r, rs in self.rounds.items()
                      if rs["close_reason"] != "CLOSE_REASON_SEED")

    def frame(self):
        cols, rows = shutil.get_terminal_size((100, 30))
        page = self.args.status.split("/api/")[0] + "/"
        lines = [f"{self.args.title}  ·  {fmt_secs(time.monotonic() - self.start)}",
                 f"logs {self.args.log_dir}/  ·  status page {page}"]
        for w in self.workers:
            lines.append(self.bar(w, 20))
        if self.status_error:
            lines.append(f"(coordinator status: {self.status_error})")
        lines.append("")
        lines.append("round  contr.     time      bytes  test acc  close")
        room = max(3, rows - len(lines) - 2)
        for r in self.closed_rounds()[-room:]:
            lines.append(self.round_text(self.round_row(r)))
        return [line[:cols] for line in lines]

    def draw(self):
        lines = self.frame()
        out = "\x1b[H" + "".join(line + "\x1b[K\n" for line in lines) + "\x1b[J"
        sys.stdout.write(out)
        sys.stdout.flush()

    def plain(self):
        for r in self.closed_rounds():
            if r in self.printed:
                continue
            # A round is printed once every worker that took part has logged
            # its sync (its bytes are known), or once later rounds closed.
            rs = self.rounds[r]
            ranks = {self.member_worker(n) for n in rs["participants"]}
            logged = all(w.bytes_at(r) is not None for w in self.workers
                         if w.rank in ranks)
            if not logged and r + 1 not in self.rounds:
                continue
            self.printed.add(r)
            print("round " + self.round_text(self.round_row(r)).strip(),
                  flush=True)
            if r % 10 == 0:
                for w in self.workers:
                    print("  " + self.bar(w, 20), flush=True)

    def refresh(self):
        for w in self.workers:
            w.poll()
        self.poll_status()
        if self.tty:
            self.draw()
        else:
            self.plain()

    def run(self):
        if self.tty:
            sys.stdout.write("\x1b[?25l\x1b[2J")
        else:
            print(f"{self.args.title}; logs in {self.args.log_dir}/; "
                  "one line per closed round: round, contributors, round "
                  "time, bytes moved, latest test accuracy, close reason",
                  flush=True)
        try:
            while True:
                # Whether they were gone before this last look at the logs.
                done = not any(alive(p) for p in self.pids)
                self.refresh()
                if done:
                    break
                time.sleep(self.args.interval)
        finally:
            if self.tty:
                sys.stdout.write("\x1b[?25h\n")
                sys.stdout.flush()
        self.summary()
        if self.args.plot:
            self.plot(self.args.plot)

    def summary(self):
        per = {w.rank: {"late": w.late, "dropped": 0, "timed_out": 0}
               for w in self.workers}
        for rs in self.rounds.values():
            for what in ("dropped", "timed_out"):
                for name in rs.get(what, []):
                    r = self.member_worker(name)
                    if r in per:
                        per[r][what] += 1
        header = ["worker", "steps", "rounds", "late", "dropped", "timed out",
                  "sync time", "sent", "received", "last loss"]
        rows = []
        for w in self.workers:
            f = w.final or {}
            rows.append([w.label, str(w.step), str(len(w.syncs)),
                         str(per[w.rank]["late"]), str(per[w.rank]["dropped"]),
                         str(per[w.rank]["timed_out"]),
                         f"{float(f['sync_seconds_total']):.1f} s"
                         if "sync_seconds_total" in f else "-",
                         fmt_bytes(int(f["bytes_sent"])) if "bytes_sent" in f
                         else "-",
                         fmt_bytes(int(f["bytes_received"]))
                         if "bytes_received" in f else "-",
                         f.get("last_loss", "-") if w.final else
                         ("FAILED" if w.error else "-")])
        widths = [max(len(r[i]) for r in rows + [header])
                  for i in range(len(header))]
        print("\nsummary")
        for row in [header] + rows:
            print("  " + "  ".join(c.rjust(widths[i]) if i else c.ljust(widths[i])
                                   for i, c in enumerate(row)))
        closed = self.closed_rounds()
        accuracy = next((w.final["test_accuracy"] for w in self.workers
                         if w.final and "test_accuracy" in w.final), None)
        mean_round = (sum(int(self.rounds[r]["duration_ms"]) for r in closed)
                      / len(closed) / 1000.0) if closed else 0.0
        print(f"  {len(closed)} rounds, mean round time {mean_round:.2f} s; "
              f"wall time {fmt_secs(time.monotonic() - self.start)}"
              + (f"; test accuracy {accuracy} (after the final sync)"
                 if accuracy else ""))
        for w in self.workers:
            if w.error:
                print(f"  {w.label}: {w.error}")

    def plot(self, path):
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("  (no plot: python3-matplotlib is not installed; "
                  "scripts/install-deps.sh installs it)")
            return
        fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 6.5),
                                          gridspec_kw={"height_ratios": [3, 2]})
        for w in self.workers:
            if w.losses:
                top.plot([s for s, _ in w.losses], [l for _, l in w.losses],
                         linewidth=1, label=w.label)
        evals = max((w.evals for w in self.workers), key=len)
        if evals:
            bottom.plot([s for s, _, _ in evals], [a for _, _, a in evals],
                        marker="o", markersize=3, color="tab:green",
                        label="test accuracy")
        finals = [w for w in self.workers if w.final and
                  "test_accuracy" in w.final]
        if finals:
            bottom.plot([finals[0].step], [float(finals[0].final["test_accuracy"])],
                        marker="*", markersize=10, color="tab:red",
                        linestyle="none", label="after the final sync")
        lead = max(self.workers, key=lambda w: len(w.syncs))
        for i, s in enumerate(lead.syncs):
            for ax in (top, bottom):
                ax.axvline(int(s["step"]), color="grey", alpha=0.25,
                           linewidth=0.8, label="sync round" if
                           (i == 0 and ax is top) else None)
        top.set_ylabel("training loss")
        top.set_title(self.args.title)
        top.legend(loc="upper right", fontsize=8)
        top.grid(alpha=0.3)
        bottom.set_ylabel("test accuracy")
        bottom.set_xlabel("local step")
        bottom.legend(loc="lower right", fontsize=8)
        bottom.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        print(f"  plot: {path}")


def main():
    View(parse_args()).run()


if __name__ == "__main__":
    main()
