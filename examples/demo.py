"""End-to-end demo on embedded defaults: trains a small model on 2 CPU ranks.

Run with `make demo`. Everything is local: the ranks are real processes started by torch's
elastic agent and joined by a gloo process group; the run directory lives under
``$SPARKGPU_HOME`` (``~/.local/share/sparkgpu`` by default).
"""

from __future__ import annotations

import time

from sparkgpu import distributed, runtime

FEATURES = 32


def make_data(n: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    true_w = torch.linspace(-1, 1, FEATURES)
    y = (x @ true_w + 0.1 * torch.randn(n, generator=g) > 0).float()
    return x, y


@distributed(gpus=2, gpu_type="cpu")
def train(epochs: int, lr: float, batch_size: int):
    """A plain PyTorch loop; DDP averages gradients across the ranks."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    x, y = make_data(20_000)
    rank, world = runtime.get_global_rank(), runtime.get_world_size()
    x, y = x[rank::world], y[rank::world]  # each rank trains on its own slice
    model = DDP(torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for epoch in range(epochs):
        perm = torch.randperm(len(x))
        total = 0.0
        for i in range(0, len(x), batch_size):
            idx = perm[i:i + batch_size]
            loss = F.binary_cross_entropy_with_logits(model(x[idx]).squeeze(1), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        if runtime.is_main_process():
            print(f"epoch {epoch}: loss {total / len(x):.4f}", flush=True)
    with torch.no_grad():
        xe, ye = make_data(4_000, seed=1)
        accuracy = ((model(xe).squeeze(1) > 0).float() == ye).float().mean().item()
    return {"rank": rank, "loss": total / len(x), "accuracy": accuracy}


def main() -> None:
    started = time.time()
    results = train.distributed(epochs=3, lr=3e-3, batch_size=256)
    print()
    print(f"sparkgpu demo: trained on {len(results)} ranks in {time.time() - started:.1f}s "
          f"(job {train.last_job_id})")
    for r in results:
        print(f"  rank {r['rank']}: final loss {r['loss']:.4f}, held-out accuracy {r['accuracy']:.3f}")
    print(f"  run dir with every rank's log: {train.last_run_dir}")


if __name__ == "__main__":
    main()
