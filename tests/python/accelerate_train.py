"""A training script written for Hugging Face accelerate's LocalSGD, with
only its import changed (accelerate is not installed here: Accelerator below
is what accelerate's LocalSGD uses of accelerate.Accelerator, for a single
process). The coordinator and the job come from the environment
(LOCALSGD_COORDINATOR, LOCALSGD_JOB), the launch from a launcher's (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE).

usage: accelerate_train.py OUT STEPS K

Writes OUT (JSON, atomically) at the end: every sync's outcome (round,
contributors, contributor_weight) and the final parameters.
"""
import json
import os
import sys

import torch

# from accelerate.local_sgd import LocalSGD
from localsgd import LocalSGD


class Accelerator:
    """accelerate.Accelerator as its LocalSGD sees it, for one process."""
    distributed_type = "NO"
    num_processes = 1
    process_index = 0
    local_process_index = 0

    def wait_for_everyone(self):
        pass


def main():
    out, steps, k = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rank = int(os.environ["RANK"])
    torch.manual_seed(rank)  # every worker starts from other parameters
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    accelerator = Accelerator()
    data = torch.Generator().manual_seed(100 + rank)
    syncs = []

    def record(local_sgd):
        if local_sgd.num_syncs > len(syncs):
            o = local_sgd.last_outcome
            syncs.append({k: o[k] for k in ("round", "contributors",
                                            "contributor_weight")})

    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=k,
                  enabled=True) as local_sgd:
        for _ in range(steps):
            x = torch.randn(32, 8, generator=data)
            loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            local_sgd.step()
            record(local_sgd)
    record(local_sgd)  # the final sync, on leaving the block
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    with open(out + ".tmp", "w") as f:
        json.dump({"syncs": syncs, "params": params.tolist()}, f)
    os.rename(out + ".tmp", out)


if __name__ == "__main__":
    main()
