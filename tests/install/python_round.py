"""An installed localsgd Python package, used as a user would: imported from
`site` (not the build tree), two members average one round exactly against
the coordinator at `target`.

usage: python_round.py TARGET SITE JOB
"""
import sys
import threading

import numpy as np

import localsgd

target, site, job = sys.argv[1:4]
assert localsgd.__file__.startswith(site), \
    f"imported {localsgd.__file__}, not from {site}"
clients = [localsgd.Client(target=target, job=job, member_name=f"py{i}")
           for i in range(2)]
arrays = [np.full(10, float(i), np.float32) for i in range(2)]
for c in clients:
    c.join([("w", [10], "float32")])
for c, a in zip(clients, arrays):
    c.initialize(a)
arrays[0][:] = 2.0
arrays[1][:] = 6.0
threads = [threading.Thread(target=c.sync, args=(a,))
           for c, a in zip(clients, arrays)]
for t in threads:
    t.start()
for t in threads:
    t.join(60)
assert all(np.all(a == 4.0) for a in arrays), arrays
for c in clients:
    c.leave()
print("python ok", localsgd.__file__)
