"""A DDP training script written against Databricks' ``databricks.air`` API as its documentation
shows it. tests/integration/test_dropin_air.py runs it with only its import lines changed.
"""

import json
import time

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from databricks.air import distributed
from databricks.air.exceptions import LocalExecutionTimeoutError
from databricks.air.runtime import get_global_rank, get_local_rank, get_world_size


@distributed(num_accelerators=2, timeout=600)
def train(epochs, lr):
    rank, world_size = get_global_rank(), get_world_size()
    device = torch.device(f"cuda:{get_local_rank()}") if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 1).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(rank), device=device)
    y = x.sum(dim=1, keepdim=True)
    for _ in range(epochs):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
    return {
        "rank": rank,
        "world_size": world_size,
        "loss": loss.item(),
        "weights": model.module.weight.detach().cpu().flatten().tolist(),
    }


@distributed(num_accelerators=2, timeout=2)
def too_slow():
    time.sleep(300)


if __name__ == "__main__":
    report = {"ranks": train.distributed(epochs=30, lr=0.05)}
    one_rank = train.with_overrides(num_accelerators=1)
    report["one_rank"] = one_rank.distributed(epochs=1, lr=0.05)
    report["num_accelerators"] = [train.num_accelerators, one_rank.num_accelerators]
    report["func"] = train.func.__name__
    try:
        too_slow.distributed()
    except LocalExecutionTimeoutError as exc:
        report["timeout"] = str(exc)
    print("REPORT " + json.dumps(report))
