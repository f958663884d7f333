"""The trial function the sweep tests run: 2 gloo ranks train a tiny transformer and report its loss.

Every rank records what it did into ``where`` (one JSON line per event: start, each step, the
stop, the end), so a test reads from the ranks themselves which step each stopped at and when
each trial ran. ``offset`` is added to the reported loss (a pruner's threshold then decides);
``fail`` makes rank 1 raise at step 1; ``return_model`` returns ``{"value": ..., "model": ...}``; a
trial whose offset is above ``prune_above`` runs until it is pruned (no clock decides).
"""

from __future__ import annotations

import json
import os
import time


def _record(where: str, number, rank: int, **event) -> None:
    with open(os.path.join(where, f"trial-{number}-rank-{rank}.jsonl"), "a") as f:
        f.write(json.dumps({"time": time.time(), **event}) + "\n")


#: Steps of a trial that waits to be pruned: its stop must come from the prune, long before these run out.
UNTIL_PRUNED = 20_000


def train(
    where: str,
    steps: int = 300,
    lr: float = 0.05,
    offset: float = 0.0,
    fail: bool = False,
    return_model: bool = False,
    prune_above: float | None = None,
):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from sparkgpu import runtime
    from sparkgpu.sweeps.reports import trial_number
    from tests.fakes.tiny_models import tiny_transformer

    params = runtime.trial({"offset": offset, "fail": fail})
    number = trial_number()
    rank = runtime.get_global_rank()
    _record(where, number, rank, event="start", attempt=runtime.attempt(), params=params, lr=lr)
    model = DistributedDataParallel(tiny_transformer(seed=0))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(rank)
    value = float("nan")
    if prune_above is not None and float(params["offset"]) > prune_above:
        steps = UNTIL_PRUNED  # runs until the sweep prunes it, however long the prune takes to arrive
    for step in range(steps):
        tokens = torch.randint(0, 16, (4, 8), generator=generator)
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 16), tokens.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        value = mean.item() / dist.get_world_size() + float(params["offset"])
        if params["fail"] and rank == 1 and step == 1:
            raise RuntimeError("trial asked to fail at step 1")
        _record(where, number, rank, event="step", step=step)
        if runtime.report(step, value):
            _record(where, number, rank, event="stopped", step=step)
            break
        time.sleep(0.01)  # the workload's pace
    _record(where, number, rank, event="end")
    return {"value": value, "model": model.module} if return_model else value


def events(where, number: int, rank: int) -> list[dict]:
    path = os.path.join(str(where), f"trial-{number}-rank-{rank}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
