#!/usr/bin/python3
"""bench/cost_model.py against what it was built from: `validate` within
15% of every recorded point, and the calibration fit (fit_cpu) on the
recorded calibration runs (cost_model_calibration.tsv, sync_round.sh's
raw.tsv rows at 10M) giving back the CPU_NS and BUSY the model holds.

Usage: cost_model_check.py REPO_ROOT"""

import contextlib
import importlib.util
import io
import os
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

    fitted, busy, _ = model.fit_cpu(
        [os.path.join(os.path.dirname(__file__), "cost_model_calibration.tsv")],
        params=1e7, cores=2)
    if fitted != model.CPU_NS:
        sys.exit(f"the fit gives {fitted}, the model holds {model.CPU_NS}")
    if busy != model.BUSY:
        sys.exit(f"the fit gives BUSY {busy}, the model holds {model.BUSY}")
    print(f"cost model: within {100 * worst:.1f}% of every point; "
          f"CPU_NS and BUSY as calibrated ({len(fitted)} wires)")


if __name__ == "__main__":
    main()
