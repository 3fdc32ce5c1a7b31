"""localsgd for Python: Local SGD with a localsgd coordinator.

Switching from Hugging Face accelerate's LocalSGD is a change of import and
of where the averaging happens (a coordinator instead of an all-reduce):

    # from accelerate.local_sgd import LocalSGD
    from localsgd import LocalSGD

    with LocalSGD(model, coordinator="host:50051", job="run1",
                  local_sgd_steps=16) as local_sgd:
        for batch in loader:
            ...; optimizer.step(); local_sgd.step()

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
