"""localsgd for Python: Local SGD with a localsgd coordinator.

Switching from Hugging Face accelerate's LocalSGD is a change of import; the
averaging happens through a coordinator instead of an all-reduce, named by
the environment (LOCALSGD_COORDINATOR=host:port, LOCALSGD_JOB=run1) or the
arguments:

    # from accelerate.local_sgd import LocalSGD
    from localsgd import LocalSGD

    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=16,
                  enabled=True) as local_sgd:
        for batch in loader:
            ...; optimizer.step(); local_sgd.step()

    # or: LocalSGD(model, coordinator="host:50051", job="run1",
    #              local_sgd_steps=16)

Under a launcher (torchrun, `accelerate launch`: WORLD_SIZE in the
environment) the job's first rounds wait for the launched world's members;
help(localsgd.local_sgd) has the details and every LOCALSGD_* variable.

Client is the lower-level member of a job (the C++ client, over gRPC) that
LocalSGD uses; Error is what it raises (.code: the gRPC status code name,
.message). Only localsgd.local_sgd imports torch.
"""
from localsgd._localsgd import Client, Error

__all__ = ["Client", "Error", "LocalSGD"]


def __getattr__(name):
    # LocalSGD needs torch; importing localsgd alone does not.
    if name == "LocalSGD":
        from localsgd.local_sgd import LocalSGD
        return LocalSGD
    raise AttributeError(f"module 'localsgd' has no attribute {name!r}")
