"""Training code written for torchrun and the Databricks docs runs unchanged inside a job's ranks."""

from __future__ import annotations

import os

import pytest

from sparkgpu import WorkerFailedError, distributed, runtime
from sparkgpu.config import settings
from sparkgpu.launch.rank.entrypoint import NODE_DEVICES_ENV

pytestmark = pytest.mark.integration


# --- The Databricks docs' multi-GPU DDP example; only the import line differs ----------------
# from serverless_gpu import distributed
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402


def setup():
    dist.init_process_group("nccl")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))


def cleanup():
    dist.destroy_process_group()


class SimpleMLP(nn.Module):
    def __init__(self, input_dim=10, hidden_dim=64, output_dim=1):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(input_dim, hidden_dim),
            nn.ReLU(),
            nn.Linear(hidden_dim, output_dim),
        )

    def forward(self, x):
        return self.net(x)


@distributed(gpus=2, gpu_type="cpu")
def run_train(num_epochs: int = 5, batch_size: int = 16):
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    setup()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    x, y = torch.randn(256, 10), torch.randn(256, 1)
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    model = SimpleMLP().to(device)
    ddp_model = DDP(model, device_ids=[local_rank] if torch.cuda.is_available() else None)
    optimizer = torch.optim.Adam(ddp_model.parameters(), lr=1e-3)
    loss_fn = nn.MSELoss()
    for epoch in range(num_epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = loss_fn(ddp_model(xb.to(device)), yb.to(device))
            loss.backward()
            optimizer.step()
    weights = [p.detach().clone() for p in ddp_model.module.parameters()]
    cleanup()
    return dist.get_rank(), loss.item(), weights


# -----------------------------------------------------------------------------------------------


def test_the_databricks_ddp_example_trains_on_two_cpu_ranks():
    results = run_train.distributed(num_epochs=2)
    assert [r[0] for r in results] == [0, 1]
    (_, loss0, w0), (_, loss1, w1) = results
    assert loss0 == loss0 and loss1 == loss1  # not NaN
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))  # DDP kept the replicas in step
    log = settings().staging_root / run_train.last_job_id / "attempts" / "0" / "logs"
    assert any("'gloo'" in p.read_text() and "init_process_group('nccl')" in p.read_text() for p in log.glob("rank-*"))


def test_the_docs_device_selection_on_simulated_gpus(monkeypatch):
    monkeypatch.setenv("SPARKGPU_SIMULATE_GPUS", "H100:4")
    settings.cache_clear()

    @distributed(gpus=2, gpu_type="H100")
    def devices():
        setup()
        local_rank = int(os.environ["LOCAL_RANK"])  # what the docs pass to torch.cuda.set_device
        visible = os.environ[NODE_DEVICES_ENV].split(",")
        out = (
            local_rank,
            visible,
            visible[local_rank],
            runtime.gpu_address(),
            os.environ["CUDA_VISIBLE_DEVICES"],
            str(runtime.device()),
            dist.get_backend(),
        )
        cleanup()
        return out

    assert devices.distributed() == [
        (0, ["0", "1"], "0", "0", "", "cpu", "gloo"),
        (1, ["0", "1"], "1", "1", "", "cpu", "gloo"),
    ]


class _PatchLog:
    """The debug lines sparkgpu's process-group replacements write in a rank, collected there.

    They are the evidence that a framework's call reached the replacement rather than torch's own
    ``init_process_group`` / ``destroy_process_group``.
    """

    def __init__(self):
        import logging

        self.lines = []
        handler = logging.Handler(logging.DEBUG)
        handler.emit = lambda record: self.lines.append(record.getMessage())
        logger = logging.getLogger("sparkgpu.launch.rank.process_group")
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)

    def saw(self, start: str) -> bool:
        return any(line.startswith(start) for line in self.lines)


def test_hf_accelerate_sets_up_inside_the_jobs_group_and_end_training_leaves_it_to_the_job():
    pytest.importorskip("accelerate")

    @distributed(gpus=2, gpu_type="cpu")
    def with_accelerate():
        from accelerate import Accelerator

        log = _PatchLog()
        job_group = dist.group.WORLD
        dist.init_process_group("gloo", init_method="env://")  # a torchrun script's setup() before Accelerator()
        accelerator = Accelerator(cpu=True)
        model = accelerator.prepare(nn.Linear(4, 1))
        t = accelerator.reduce(torch.tensor([float(accelerator.process_index + 1)], device=accelerator.device))
        accelerator.end_training()  # accelerate calls torch.distributed.destroy_process_group() here
        kept = dist.is_initialized() and dist.group.WORLD is job_group
        after = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(after)  # the job's group still serves collectives (sparkgpu's teardown uses it too)
        return (
            accelerator.num_processes,
            accelerator.process_index,
            type(model).__name__,
            t.item(),
            kept,
            dist.group.WORLD is job_group,
            after.item(),
            log.saw("init_process_group('gloo')"),
            log.saw("destroy_process_group()"),
        )

    assert with_accelerate.distributed() == [
        (2, 0, "DistributedDataParallel", 3.0, True, True, 3.0, True, True),
        (2, 1, "DistributedDataParallel", 3.0, True, True, 3.0, True, True),
    ]


def test_lightning_ddp_trainer_fits_twice_inside_the_jobs_group_after_the_script_destroys_it():
    pytest.importorskip("lightning")

    @distributed(gpus=2, gpu_type="cpu")
    def with_lightning():
        import lightning as L
        from torch.utils.data import DataLoader, TensorDataset

        class Regressor(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.layer = nn.Linear(4, 1)

            def training_step(self, batch, batch_idx):
                x, y = batch
                return nn.functional.mse_loss(self.layer(x), y)

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        def fit(model):
            trainer = L.Trainer(
                accelerator="cpu",
                devices=2,
                strategy="ddp",
                max_epochs=1,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
            )
            trainer.fit(model, data)
            return trainer

        log = _PatchLog()
        job_group = dist.group.WORLD
        torch.manual_seed(0)
        data = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
        model = Regressor()
        trainer = fit(model)
        # The end of a Lightning script on GPUs, as Lightning's own atexit hook does for nccl:
        dist.destroy_process_group()
        kept = dist.is_initialized() and dist.group.WORLD is job_group
        # A second fit (fine-tuning after pre-training): Lightning's DDP setup calls
        # init_process_group itself unless a group exists; it must find the job's.
        fit(model)
        return (
            trainer.world_size,
            trainer.global_rank,
            [p.detach().clone() for p in model.parameters()],
            kept,
            dist.group.WORLD is job_group,
            log.saw("destroy_process_group()"),
        )

    (w0, r0, p0, *checks0), (w1, r1, p1, *checks1) = with_lightning.distributed()
    assert (w0, r0, w1, r1) == (2, 0, 2, 1)
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    assert checks0 == checks1 == [True, True, True]


def test_a_rank_that_exits_quietly_is_named_as_the_first_failure():
    # Stuck in the collective, the job would end at its timeout (JobTimeoutError), not as below.
    @distributed(gpus=2, gpu_type="cpu", timeout=240)
    def leaves_early():
        if int(os.environ["RANK"]) == 1:
            os._exit(0)
        t = torch.ones(1)
        dist.all_reduce(t)  # rank 0 waits for rank 1, which is gone
        return t.item()

    with pytest.raises(WorkerFailedError) as err:
        leaves_early.distributed()
    first = err.value.first_failure
    assert (first.rank, first.exc_type, first.exitcode) == (1, None, 0)
    assert "First to fail: rank 1" in str(err.value) or err.value.ranks == [1]
    assert "rank 1: the process exited with code 0 without returning a result" in str(err.value)
    assert "launcher failed" not in str(err.value)


def test_a_rank_that_exits_quietly_without_a_collective_is_named():
    @distributed(gpus=2, gpu_type="cpu")
    def leaves_early():
        if int(os.environ["RANK"]) == 1:
            os._exit(0)
        return "done"

    with pytest.raises(WorkerFailedError, match="rank 1: the process exited with code 0 without") as err:
        leaves_early.distributed()
    assert err.value.ranks == [1] and err.value.failures[0].exitcode == 0


def test_except_clauses_written_for_the_remote_exception_still_catch_it():
    @distributed(gpus=2, gpu_type="cpu")
    def validate():
        raise ValueError(f"rank {os.environ['RANK']}: label column has NaN")

    try:
        validate.distributed()
    except ValueError as exc:  # as under serverless_gpu, which raises the remote exception
        assert isinstance(exc, WorkerFailedError) and exc.ranks == [0, 1]
        assert "label column has NaN" in str(exc)
    else:
        pytest.fail("no error")
