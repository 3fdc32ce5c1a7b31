#!/usr/bin/python3
"""bench/cost_model.py against what it was built from: `validate` within
15% of every recorded point, and `calibrate` on the recorded calibration
runs (cost_model_calibration.tsv, sync_round.sh's raw.tsv rows at 10M)
giving back the CPU_NS and BUSY the model holds.

Usage: cost_model_check.py REPO_ROOT"""

import contextlib
import importlib.util
import io
import os
import re
import sys


def main():
    root = sys.argv[1]
    spec = importlib.util.spec_from_file_location(
        "cost_model", os.path.join(root, "bench", "cost_model.py"))
    model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(model)

    with contextlib.redirect_stdout(io.StringIO()):
        worst = model.validate()
    if worst > 0.15:
        sys.exit(f"validate: the largest error is {100 * worst:.1f}% (> 15%)")

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        model.calibrate([os.path.join(os.path.dirname(__file__),
                                      "cost_model_calibration.tsv")],
                        params=1e7, cores=2)
    text = out.getvalue()
    fitted = {w: dict(member=float(a), per_member=float(b), step=float(c))
              for w, a, b, c in re.findall(
                  r'"(\w+)": dict\(member=([\d.]+), per_member=([\d.-]+), '
                  r'step=([\d.-]+)\)', text)}
    if fitted != model.CPU_NS:
        sys.exit(f"calibrate gives {fitted}, the model holds {model.CPU_NS}")
    busy = float(re.search(r"BUSY = ([\d.]+)", text).group(1))
    if busy != model.BUSY:
        sys.exit(f"calibrate gives BUSY {busy}, the model holds {model.BUSY}")
    print(f"cost model: within {100 * worst:.1f}% of every point; "
          f"CPU_NS and BUSY as calibrated ({len(fitted)} wires)")


if __name__ == "__main__":
    main()
