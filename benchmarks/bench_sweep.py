"""A sweep of 2-rank trials: ``sparkgpu.sweep`` against Ray Tune driving Ray Train, and against
Optuna's own parallel loop driving sparkgpu jobs by hand.

Every side runs the same trials of the same function body (a small transformer classifier, DDP
over gloo, ``EPOCHS`` epochs of ``STEPS`` steps, the validation loss all-reduced after each epoch)
with the same search space, sampled by Optuna's TPE sampler with the same seed, ``MAX_CONCURRENT``
trials at once, each of ``RANKS`` ranks, on the same cores:

* ``sparkgpu``: ``sparkgpu.sweep(..., pruner=SuccessiveHalvingPruner(min_resource=1,
  reduction_factor=2))``, its defaults otherwise (local backend, trials forked from the warm pool,
  MLflow tracking as configured);
* ``ray_tune``: ``tune.Tuner`` over a driver function that runs a ``TorchTrainer`` per trial, as
  Ray Train V2's "Hyperparameter Tuning with Ray Tune" guide writes it (``TuneReportCallback``),
  with ``OptunaSearch`` (the same TPE sampler and seed) and ``ASHAScheduler(grace_period=1,
  reduction_factor=2)``: the same rungs (1, 2, 4, 8 epochs), ``max_concurrent_trials=MAX_CONCURRENT``.
  Ray is given ``RAY_LOGICAL_CPUS`` logical CPUs (see there why); Ray does not pin processes, so
  its ``MAX_CONCURRENT * RANKS`` workers share the cores as sparkgpu's ranks do;
* ``optuna_loop``: ``study.optimize(objective, n_jobs=MAX_CONCURRENT)`` whose objective runs one
  sparkgpu job and returns its value. It cannot prune: a rank calling ``trial.should_prune()``
  alone would leave its peers in the next all-reduce. It shows what the sweep's pruning under DDP
  saves, not a speed of its own.

Each repeat starts cold for every side: a fresh sparkgpu home (no warm pool yet: the first trial
starts it) and a fresh ``ray.init`` inside the timed span. Timed per side: the call, from before
it to its return. Per trial, from what rank 0 writes at its first and last step and the study's
own times: ``start_s`` (the trial sampled -> its first step), ``stop_s`` (its last step -> the
trial recorded ended, its ranks gone) and ``overhead_s`` (the two added). ``slot_idle_s`` is the
time a concurrency slot held no training step, per trial: ``(wall * MAX_CONCURRENT - sum of
trials' training time) / trials``. ``rank_seconds`` are the trials' training time times their
ranks (the GPU-seconds the sweep spent); ``best_value`` the lowest validation loss it found.

    python benchmarks/bench_sweep.py [--trials 32] [--repeats 3]
    python benchmarks/bench_sweep.py --sides sparkgpu,sparkgpu_untracked --out sweep-tracking.json

Writes benchmarks/results/sweep.json (or ``--out``). ``sparkgpu_untracked`` is the sweep with
``SPARKGPU_TRACKING=0``: no MLflow run per trial.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import load_seen, machine, method, separated, spread

RESULTS = Path(__file__).parent / "results"

RANKS, MAX_CONCURRENT, EPOCHS, STEPS, BATCH, SEQ, VOCAB = 2, 2, 8, 6, 16, 16, 32
SEED = 0
#: Ray's logical CPUs. With exactly MAX_CONCURRENT * (RANKS + 1), the count a GPU node's trials
#: would need, a pruned trial's worker placement group was not released before the next trial
#: asked for its own, and the sweep stalled ("worker group startup timed out"): a logical count
#: large enough that only max_concurrent_trials limits the trials.
RAY_LOGICAL_CPUS = 64


# ---- the trial's body, the same on every side ---------------------------------------------------


def _key(lr: float, wd: float) -> str:
    return f"{lr:.12g}-{wd:.12g}"


def train_body(lr: float, wd: float, marks: str, report) -> float:
    """Trains a small transformer classifier under DDP; ``report(epoch, val_loss)`` -> stop now."""
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    rank, world = dist.get_rank(), dist.get_world_size()

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, 32)
            layer = nn.TransformerEncoderLayer(32, 2, dim_feedforward=64, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2)
            self.head = nn.Linear(32, 2)

        def forward(self, ids):
            return self.head(self.encoder(self.embed(ids)).mean(dim=1))

    data = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, VOCAB, (BATCH * STEPS * world + 256, SEQ), generator=data)
    labels = ((ids < VOCAB // 2).sum(dim=1) > SEQ // 2).long()  # more small tokens than large ones
    train_ids, train_labels = ids[:-256][rank::world], labels[:-256][rank::world]
    val_ids, val_labels = ids[-256:][rank::world], labels[-256:][rank::world]

    model = nn.parallel.DistributedDataParallel(Classifier())
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)
    loss_fn = nn.CrossEntropyLoss()
    marks_file, first, val = os.path.join(marks, _key(lr, wd) + ".json"), time.time(), float("nan")
    for epoch in range(1, EPOCHS + 1):
        for step in range(STEPS):
            batch = slice(step * BATCH, (step + 1) * BATCH)
            optimizer.zero_grad()
            loss_fn(model(train_ids[batch]), train_labels[batch]).backward()
            optimizer.step()
        with torch.no_grad():
            loss = loss_fn(model(val_ids), val_labels).detach()
        dist.all_reduce(loss)
        val = float(loss) / world
        if rank == 0:
            with open(marks_file + ".tmp", "w") as f:
                json.dump({"first_step": first, "last_step": time.time(), "epochs": epoch, "value": val}, f)
            os.replace(marks_file + ".tmp", marks_file)
        if report(epoch, val):
            break
    return val


def suggest(trial, sampled: dict) -> dict:
    """The search space, as a function of an Optuna trial; notes when each point was sampled."""
    lr = trial.suggest_float("lr", 1e-4, 3e-2, log=True)
    wd = trial.suggest_float("wd", 1e-6, 1e-1, log=True)
    sampled[_key(lr, wd)] = time.time()
    return {"lr": lr, "wd": wd}


# ---- the three sides ---------------------------------------------------------------------------


def sparkgpu_trial(marks: str, lr: float = 1e-3, wd: float = 1e-4) -> float:
    from sparkgpu import runtime

    return train_body(lr, wd, marks, runtime.report)


def sparkgpu_job(marks: str, lr: float, wd: float) -> float:
    return train_body(lr, wd, marks, lambda epoch, value: False)


def run_sparkgpu(trials: int, marks: str, sampled: dict) -> dict:
    import optuna

    import sparkgpu

    started = time.time()
    result = sparkgpu.sweep(
        sparkgpu_trial,
        space=lambda trial: suggest(trial, sampled),
        direction="minimize",
        sampler=optuna.samplers.TPESampler(seed=SEED),
        pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2),
        n_trials=trials,
        max_concurrent=MAX_CONCURRENT,
        gpus=RANKS,
        gpu_type="cpu",
        kwargs={"marks": marks},
    )
    wall = time.time() - started
    return {"wall_s": wall, "trials": _optuna_trials(result.study)}


def run_optuna_loop(trials: int, marks: str, sampled: dict) -> dict:
    import optuna

    from sparkgpu import distributed

    job = distributed(gpus=RANKS, gpu_type="cpu", log_ranks=None)(sparkgpu_job)

    def objective(trial):
        params = suggest(trial, sampled)
        return job.distributed(marks, **params)[0]  # one value per rank: rank 0's is the trial's

    started = time.time()
    study = optuna.create_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=SEED))
    study.optimize(objective, n_trials=trials, n_jobs=MAX_CONCURRENT)
    wall = time.time() - started
    return {"wall_s": wall, "trials": _optuna_trials(study)}


def ray_worker(config: dict) -> None:
    import ray.train

    def report(epoch, value):
        ray.train.report({"loss": value, "epoch": epoch})
        return False  # ASHA stops the trial from outside

    train_body(config["lr"], config["wd"], config["marks"], report)


def run_ray_tune(trials: int, marks: str, sampled: dict, storage: str) -> dict:
    os.environ["RAY_TRAIN_V2_ENABLED"] = "1"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import optuna
    import ray
    import ray.train
    import ray.train.torch
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search.optuna import OptunaSearch

    def driver(config):
        trainer = ray.train.torch.TorchTrainer(
            ray_worker,
            train_loop_config=config,
            scaling_config=ray.train.ScalingConfig(num_workers=RANKS, use_gpu=False),
            run_config=ray.train.RunConfig(
                name=f"trial-{_key(config['lr'], config['wd'])}",
                storage_path=storage,
                callbacks=[TuneReportCallback()],
            ),
        )
        trainer.fit()

    started = time.time()
    ray.init(num_cpus=RAY_LOGICAL_CPUS, include_dashboard=False, _node_ip_address="127.0.0.1")
    initialised = time.time() - started
    search = OptunaSearch(
        space=RaySpace(marks, sampled), metric="loss", mode="min", sampler=optuna.samplers.TPESampler(seed=SEED)
    )
    tuner = tune.Tuner(
        driver,
        tune_config=tune.TuneConfig(
            num_samples=trials,
            max_concurrent_trials=MAX_CONCURRENT,
            search_alg=search,
            scheduler=ASHAScheduler(
                time_attr="epoch", metric="loss", mode="min", max_t=EPOCHS, grace_period=1, reduction_factor=2
            ),
        ),
        run_config=tune.RunConfig(storage_path=storage, name="sweep", verbose=0),
    )
    tuner.fit()
    wall = time.time() - started
    study = search._ot_study  # OptunaSearch's own study: its trials' start and end times
    ray.shutdown()
    return {"wall_s": wall, "ray_init_s": initialised, "trials": _optuna_trials(study)}


class RaySpace:
    """OptunaSearch's define-by-run space (a module-level class: Ray pickles its searcher's state)."""

    def __init__(self, marks: str, sampled: dict):
        self.marks, self.sampled = marks, sampled

    def __call__(self, trial) -> dict:
        suggest(trial, self.sampled)
        return {"marks": self.marks}  # a constant of every trial's config


def _optuna_trials(study) -> list[dict]:
    return [
        {
            "key": _key(t.params["lr"], t.params["wd"]),
            "state": t.state.name,
            "completed": t.datetime_complete.timestamp() if t.datetime_complete else None,
        }
        for t in study.trials
        if "lr" in t.params
    ]


# ---- reading a run back ------------------------------------------------------------------------


def summarise(run: dict, marks: Path, sampled: dict) -> dict:
    starts, stops, trained, values, epochs = [], [], 0.0, [], 0
    for trial in run["trials"]:
        mark_file = marks / (trial["key"] + ".json")
        if not mark_file.exists():
            continue  # stopped before its first epoch ended
        mark = json.loads(mark_file.read_text())
        starts.append(mark["first_step"] - sampled[trial["key"]])
        if trial["completed"] is not None:
            stops.append(trial["completed"] - mark["last_step"])
        trained += mark["last_step"] - mark["first_step"]
        values.append(mark["value"])
        epochs += mark["epochs"]
    trials = len(run["trials"])
    return {
        "wall_s": run["wall_s"],
        **({"ray_init_s": run["ray_init_s"]} if "ray_init_s" in run else {}),
        "trials": trials,
        "states": {s: sum(t["state"] == s for t in run["trials"]) for s in {t["state"] for t in run["trials"]}},
        "epochs_trained": epochs,
        "start_s": statistics.median(starts) if starts else None,
        "stop_s": statistics.median(stops) if stops else None,
        "overhead_s": (statistics.median(starts) + statistics.median(stops)) if starts and stops else None,
        "slot_idle_s": (run["wall_s"] * MAX_CONCURRENT - trained) / max(trials, 1),
        "rank_seconds": trained * RANKS,
        "best_value": min(values) if values else None,
    }


def one(side: str, trials: int, root: Path) -> dict:
    where = Path(tempfile.mkdtemp(prefix=f"{side}-", dir=root))
    marks, sampled = where / "marks", {}
    marks.mkdir()
    os.environ["SPARKGPU_HOME"] = str(where / "home")  # cold: no warm pool, no runs yet
    from sparkgpu.config import reset_settings

    reset_settings()
    if side == "sparkgpu_untracked":  # what a trial's MLflow run costs its start
        os.environ["SPARKGPU_TRACKING"] = "0"
    else:
        os.environ.pop("SPARKGPU_TRACKING", None)  # sparkgpu's default
    if side == "ray_tune":
        run = run_ray_tune(trials, str(marks), sampled, str(where / "ray"))
    else:
        from sparkgpu.launch.backends.local.zygote_client import stop_warm_zygote

        try:
            run = (run_optuna_loop if side == "optuna_loop" else run_sparkgpu)(trials, str(marks), sampled)
        finally:
            stop_warm_zygote()
    return summarise(run, marks, sampled)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sides", default="sparkgpu,ray_tune,optuna_loop", help="also: sparkgpu_untracked")
    parser.add_argument("--out", default="sweep.json", help="the results file, in benchmarks/results")
    args = parser.parse_args()
    sides = args.sides.split(",")
    facts = machine()
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.chdir(root)  # MLflow's default store and Ray's files land here, not in the checkout
        for repeat in range(args.repeats):
            for side in sides if repeat % 2 == 0 else reversed(sides):
                print(f"repeat {repeat + 1}/{args.repeats}: {side}", flush=True)
                runs[side].append(one(side, args.trials, root))
                print(f"  {json.dumps(runs[side][-1])}", flush=True)
    result = {
        "question": "a sweep of 2-rank trials: total wall time, per-trial overhead and the best value, "
        "sparkgpu.sweep against Ray Tune + Ray Train and Optuna's own loop",
        "machine": load_seen(facts),
        "setup": {
            "trials": args.trials,
            "ranks_per_trial": RANKS,
            "max_concurrent": MAX_CONCURRENT,
            "epochs": EPOCHS,
            "steps_per_epoch": STEPS,
            "rungs": "successive halving, min resource 1 epoch, reduction factor 2 (ASHA on Ray)",
            "sampler": f"optuna TPESampler(seed={SEED}) on every side",
            "ray_logical_cpus": RAY_LOGICAL_CPUS,
        },
        "method": method(
            "each side's sweep call, from before it to its return",
            startup="inside, cold for every side: a fresh sparkgpu home (the first trial starts the warm pool), ray.init",
            repeats=args.repeats,
            order="the sides alternate order from one repeat to the next",
        ),
    }
    for side, side_runs in runs.items():
        result[side] = {
            name: spread([r[name] for r in side_runs])
            for name in ("wall_s", "start_s", "stop_s", "overhead_s", "slot_idle_s", "rank_seconds", "best_value")
            if all(r.get(name) is not None for r in side_runs)
        }
        result[side]["states"] = side_runs[-1]["states"]
        result[side]["epochs_trained"] = spread([r["epochs_trained"] for r in side_runs])
        if side == "ray_tune":
            result[side]["ray_init_s"] = spread([r["ray_init_s"] for r in side_runs])
    if "sparkgpu" in runs and "sparkgpu_untracked" in runs:
        result["tracked_over_untracked_start"] = round(
            result["sparkgpu"]["start_s"]["median"] / result["sparkgpu_untracked"]["start_s"]["median"], 2
        )
    if "sparkgpu" in runs and "ray_tune" in runs:
        ours, theirs = result["sparkgpu"]["wall_s"], result["ray_tune"]["wall_s"]
        result["wall_ratio_to_ray_tune"] = round(ours["median"] / theirs["median"], 2)
        result["wall_separated_from_ray_tune"] = separated(ours, theirs)
        result["goals"] = {
            "overhead_s_at_most": 0.5,
            "overhead_met": result["sparkgpu"]["overhead_s"]["median"] <= 0.5,
            "wall_ratio_at_most": 0.8,
            "wall_met": result["wall_ratio_to_ray_tune"] <= 0.8,
            "best_value_no_worse": result["sparkgpu"]["best_value"]["median"]
            <= result["ray_tune"]["best_value"]["median"],
        }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in result if k not in ("machine",)}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
