#!/usr/bin/python3
"""Replays outer_rule_dump's rounds with torch.optim.SGD and compares.

For every round: the outer gradient is g = -(weighted mean of the round's
deltas), computed here in float64 and rounded to float32 (the coordinator
sums in float32: the two means differ by summation-order rounding), set as
the parameter's .grad, and torch.optim.SGD(lr, momentum, nesterov=True) (or
plain SGD) steps. The coordinator's state must equal torch's parameter to
within a few float32 ulps at every round.

  outer_rule_check.py DUMP_BINARY RULE LR MOMENTUM
Exit 77 (skip) without python3-torch.
"""
import json
import subprocess
import sys

try:
    import torch
except ImportError:
    print("skipped: python3-torch is not installed")
    sys.exit(77)


def main():
    binary, rule, lr, mu = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
    out = subprocess.run([binary, rule, sys.argv[3], sys.argv[4]], check=True,
                         capture_output=True, text=True).stdout
    lines = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    param = torch.nn.Parameter(torch.tensor(lines[0]["seed"], dtype=torch.float32))
    if rule == "outer_nesterov":
        opt = torch.optim.SGD([param], lr=lr, momentum=mu, nesterov=True)
    else:
        opt = torch.optim.SGD([param], lr=lr)
    worst = 0.0
    for rec in lines[1:]:
        contributions = rec["contributions"]
        total = sum(c["weight"] for c in contributions)
        mean = torch.zeros(len(rec["state"]), dtype=torch.float64)
        for c in contributions:
            mean += c["weight"] * torch.tensor(c["delta"], dtype=torch.float64)
        mean /= total
        param.grad = (-mean).to(torch.float32)
        opt.step()
        state = torch.tensor(rec["state"], dtype=torch.float32)
        err = (state - param.detach()).abs()
        # A few ulps of the values involved (the state and lr * update).
        tol = 8 * torch.finfo(torch.float32).eps * (param.detach().abs() + 1e-3)
        worst = max(worst, float((err / tol).max()))
        if not bool((err <= tol).all()):
            i = int((err - tol).argmax())
            print(f"FAIL round {rec['round']}: element {i} is {float(state[i])!r}, "
                  f"torch.optim.SGD gives {float(param[i])!r}")
            sys.exit(1)
    print(f"OK: {len(lines) - 1} rounds of {rule} (lr {lr}, momentum {mu}) equal "
          f"torch.optim.SGD {torch.__version__} to within {worst:.2f} of the "
          f"8-ulp tolerance")


if __name__ == "__main__":
    main()
