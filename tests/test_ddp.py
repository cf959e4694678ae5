"""DDP with the privacy guarantee of one process.

Two CPU processes (gloo, dpl's ``DPDDPStrategy`` with ``start_method="fork"``: the forked ranks share this process's
imports, so a run costs about a second) against one process on the same data, seed and global batch: the same parameters (to
float tolerance) for the default mechanism and each installed plugin, the same global batches, the same epsilon,
the single-process noise std, no DDP gradient hook firing, identical ranks without a seed, secure noise,
checkpoint/resume under DDP. FSDP: tests/test_fsdp.py.
"""

from __future__ import annotations

import functools
from collections import Counter
import os
import stat
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import SaveAndStopAt
from torch import nn
from torch.utils.data import Dataset

from dpl.lightning.checkpoint import secret_path
from dpl.lightning.data import DPDataModule
from dpl.lightning.ddp import DPDDPStrategy
from dpl.lightning.samplers import ShardedBatchSampler, ShardSampler
from dpl.errors import ConfigError
from dpl.lightning.module import DPModule
from dpl.core.plugin_manager import installed_plugins
from dpl.core.privacy import PrivacyConfig
from dpl.core.sampling import PoissonBatchSampler

DIM = 6
pytestmark = pytest.mark.filterwarnings("ignore::dpl.errors.PrivacyWarning")


# ---------------------------------------------------------------------------------------------------------
# a tiny float-feature task whose batches carry their example indices


class IndexedVectors(Dataset):
    def __init__(self, n: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, DIM, generator=gen)
        self.y = (self.x[:, 0] > 0).long()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i], "idx": torch.tensor(i)}


class IndexedData(DPDataModule):
    def __init__(self, n: int = 64, n_val: int = 21) -> None:
        super().__init__(eval_batch_size=8)
        self.n, self.n_val = n, n_val

    def setup(self, stage: str | None = None) -> None:
        self.train_set, self.val_set = IndexedVectors(self.n), IndexedVectors(self.n_val, seed=1)

    def collate(self, examples):
        if not examples:
            return {"x": torch.zeros(0, DIM), "labels": torch.zeros(0, dtype=torch.long),
                    "idx": torch.zeros(0, dtype=torch.long)}
        return {k: torch.stack([e[k] for e in examples]) for k in ("x", "labels", "idx")}


class WithTable(nn.Module):
    """The vector model plus an embedding table looked up by example index (each rank reads other rows)."""

    def __init__(self, width: int, rows: int = 40) -> None:
        super().__init__()
        self.rows = rows
        self.body = nn.Sequential(nn.Linear(DIM, width), nn.Tanh(), nn.Linear(width, 2))
        self.table = nn.Embedding(rows, 2)

    def forward(self, x, idx):
        return self.body(x) + self.table(idx % self.rows)


class VectorModule(DPModule):
    def __init__(self, zero_loss: bool = False, width: int = 16, table: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.zero_loss, self.width, self.table = zero_loss, width, table
        self.val_seen: list[int] = []

    def build_model(self) -> nn.Module:
        torch.manual_seed(0)
        if self.table:
            return WithTable(self.width)
        return nn.Sequential(nn.Linear(DIM, self.width), nn.Tanh(), nn.Linear(self.width, 2))

    def per_example_loss(self, batch):
        out = self.model(batch["x"], batch["idx"]) if self.table else self.model(batch["x"])
        if self.zero_loss:  # zero gradients: the update is the noise alone
            return (out * 0.0).sum(-1)
        return F.cross_entropy(out, batch["labels"], reduction="none")

    def validation_step(self, batch, batch_idx):
        self.val_seen += batch["idx"].tolist()
        self.log("val_loss", self.per_example_loss(batch).mean(), sync_dist=True, batch_size=len(batch["idx"]))


def _full(param: torch.Tensor) -> torch.Tensor:
    """A parameter's full value (FSDP: gathered from the shards; a collective every rank runs)."""
    from dpl.core.sharding import is_sharded

    return param.full_tensor() if is_sharded(param) else param


class Recorder(L.Callback):
    """Writes what each rank saw and ended with to ``<out>/rank<r>.pt``."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.batches: list[list[int]] = []
        self.accumulated = 0

    def on_fit_start(self, trainer, pl_module):
        for p in pl_module.model.parameters():  # DDP's reducer hooks live on the gradient accumulators
            p.register_post_accumulate_grad_hook(self._count)

    def _count(self, _param):
        self.accumulated += 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(batch["idx"].tolist() if "idx" in batch else batch["labels"].tolist())

    def on_train_end(self, trainer, pl_module):
        from dpl.lightning.collectives import state_fingerprint

        self.out.mkdir(parents=True, exist_ok=True)
        wrapped = trainer.strategy.model
        torch.save({
            "params": {n: _full(p).detach().clone() for n, p in pl_module.model.named_parameters()},
            "epsilon": pl_module.engine.epsilon(pl_module.engine.steps_done), "steps": pl_module.engine.steps_done,
            "sigma": pl_module.engine.noise_multiplier, "rate": pl_module.engine.mechanism.state_dict().get("sample_rate"),
            "batches": self.batches, "accumulated": self.accumulated, "world": trainer.world_size,
            "ddp": type(wrapped).__name__,
            "fingerprint": state_fingerprint(pl_module.engine, pl_module.trainable), "val_seen": getattr(pl_module, "val_seen", None),
            "val_loss": float(trainer.callback_metrics["val_loss"]) if "val_loss" in trainer.callback_metrics
            else None, "noise": repr(pl_module.engine.noise_source),
        }, self.out / f"rank{trainer.global_rank}.pt")


@pytest.fixture(autouse=True)
def _fresh_port(monkeypatch):
    for var in ("MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def run(out: Path, devices: int, steps: int = 4, plugins=None, optimizer=None, ckpt_path=None, callbacks=(),
        n: int = 160, validate: bool = False, zero_loss: bool = False, width: int = 16, table: bool = False,
        precision: str = "64-true", **privacy) -> list[dict]:
    settings = dict(noise_multiplier=0.5, batch_size=16, physical_batch_size=5, seed=7, max_grad_norm=1.0)
    settings.update(privacy)
    module = VectorModule(privacy=PrivacyConfig(**settings), plugins=plugins, zero_loss=zero_loss, width=width,
                          table=table, optimizer=optimizer or functools.partial(torch.optim.SGD, lr=0.5))
    # one epoch of `steps` logical batches (n / batch_size = 10 per epoch)
    trainer = L.Trainer(max_epochs=1, limit_train_batches=steps, accelerator="cpu", devices=devices,
                        strategy=DPDDPStrategy(start_method="fork") if devices > 1 else "auto",
                        use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=None if validate else 0, default_root_dir=str(out), precision=precision,
                        callbacks=[Recorder(out / "ranks"), *callbacks])
    # Forking a process whose OpenMP pool has worker threads (earlier tests ran torch ops on 2 threads) makes the
    # children hang in their first parallel region: fork with one intra-op thread.
    threads = torch.get_num_threads()
    if devices > 1:
        torch.set_num_threads(1)
    try:
        trainer.fit(module, IndexedData(n), ckpt_path=ckpt_path)
    finally:
        torch.set_num_threads(threads)
    return [torch.load(out / "ranks" / f"rank{r}.pt", weights_only=False) for r in range(devices)]


def assert_same_params(a: dict, b: dict, atol: float = 1e-6) -> None:
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def summation_tolerance(result: dict, *, steps: int, lr: float, clip: float = 1.0, batch: int = 16,
                        amplification: float = 1.0) -> float:
    """The most the order of the clipped sum can move the parameters, from float32 arithmetic alone.

    One and two processes sum the same per-example values in other orders (the model runs in float64 here, so its
    per-example values agree to ~1e-16; dpl sums clipped gradients in float32). A float32 sum of n terms, each of
    magnitude <= C per coordinate, is within (n - 1) u sum|x| <= n^2 u C of the exact sum in any order (u = 2^-24),
    so two orders differ by at most 2 n^2 u C; an SGD step moves the parameters by lr / B times the release, times
    ``amplification`` for what the release hooks do with it (dpzero: |z|; adambc: 1 / sqrt(gamma)), over ``steps``
    steps. The same bound on every CPU, whatever its SIMD width."""
    n = max(len(b) for b in result["batches"])
    u = torch.finfo(torch.float32).eps / 2
    return steps * lr * amplification * 2 * n * n * u * clip / batch


# ---------------------------------------------------------------------------------------------------------
# samplers (no processes)


def test_sharded_batches_partition_the_global_batch():
    global_batches = list(PoissonBatchSampler(50, 0.3, 6, torch.Generator().manual_seed(1)))
    shards = [list(ShardedBatchSampler(PoissonBatchSampler(50, 0.3, 6, torch.Generator().manual_seed(1)), r, 3))
              for r in range(3)]
    for step, batch in enumerate(global_batches):
        parts = [set(s[step]) for s in shards]
        assert sorted(set().union(*parts)) == sorted(batch)
        assert sum(len(p) for p in parts) == len(batch)  # disjoint
    assert all(len(s) == 6 for s in shards)
    assert sorted(i for r in range(3) for i in ShardSampler(10, r, 3)) == list(range(10))


# ---------------------------------------------------------------------------------------------------------
# 2 processes == 1 process


# adambc: a floor gamma well above the default 1e-8, where this toy's v - Phi sits (the update divides by at least
# sqrt(gamma)); dpzero: (l(theta + mu z) - l(theta - mu z)) / 2 mu divides the rounding of the losses by 2 mu (the
# model runs in float64, so that rounding is ~1e-16)
OPTIONAL_PLUGINS = {"denoise": {"denoise": {}}, "adambc": {"adambc": {"gamma": 1e-3}},
                    "dpzero": {"dpzero": {"mu": 0.05}}, "ftrl": {"ftrl": {}}}
CASES = ["default", *OPTIONAL_PLUGINS]
#: what each case's release hooks can do to a difference in the clipped sum (see summation_tolerance): denoise's
#: shrinkage with norm correction at most doubles it; adambc divides by sqrt(max(v - Phi, gamma)) >= sqrt(1e-3)
#: (twice: the first and second moments); dpzero multiplies the scalar by z (|z| < 6 but with probability 2e-9)
AMPLIFICATION = {"default": 1.0, "denoise": 2.0, "adambc": 2 / 1e-3 ** 0.5, "dpzero": 6.0, "ftrl": 1.0}


@pytest.mark.parametrize("case", CASES)
def test_two_processes_equal_one(tmp_path, monkeypatch, case):
    plugins = None
    if case != "default":
        if case not in installed_plugins():
            pytest.skip(f"plugin {case} is not installed (dpl plugins)")
        plugins = OPTIONAL_PLUGINS[case]
    one = run(tmp_path / "one", 1, plugins=plugins)[0]
    two = run(tmp_path / "two", 2, plugins=plugins)
    # the two ranks saw disjoint shards whose union is the single process's batch, step by step
    assert len(one["batches"]) == 4 and any(one["batches"])
    for step, batch in enumerate(one["batches"]):
        shards = [set(r["batches"][step]) for r in two]
        assert not shards[0] & shards[1]
        assert sorted(shards[0] | shards[1]) == sorted(batch)
    for rank in two:
        assert rank["world"] == 2 and rank["ddp"] == "DistributedDataParallel"
        assert rank["accumulated"] == 0  # DDP's gradient hooks had nothing to reduce
        assert rank["epsilon"] == one["epsilon"] and rank["sigma"] == one["sigma"]
        assert rank["rate"] in (None, one["rate"])
        assert_same_params(rank["params"], one["params"], atol=summation_tolerance(
            one, steps=4, lr=0.5, amplification=AMPLIFICATION[case]))
    moved = max((two[0]["params"][n] - VectorModule().build_model().state_dict()[n]).abs().max().item()
                for n in one["params"])
    assert moved > 1e-3  # the runs did train
    assert torch.equal(two[0]["fingerprint"], two[1]["fingerprint"])


#: group-wise clipping: each rank clips its examples' groups in its one backward pass; the adaptive thresholds' counts
#: are summed over the ranks with the clipped sums, so the ranks release and update the same thresholds
PER_LAYER = {"fixed": dict(clipping="per_layer"),
             "adaptive": dict(clipping="per_layer", clipping_thresholds="adaptive")}


@pytest.mark.parametrize("thresholds", PER_LAYER)
def test_per_layer_clipping_two_processes_equal_one(tmp_path, thresholds):
    one = run(tmp_path / "one", 1, **PER_LAYER[thresholds])[0]
    two = run(tmp_path / "two", 2, **PER_LAYER[thresholds])
    for rank in two:
        assert rank["epsilon"] == one["epsilon"] and rank["sigma"] == one["sigma"]
        assert_same_params(rank["params"], one["params"], atol=summation_tolerance(one, steps=4, lr=0.5))
    assert torch.equal(two[0]["fingerprint"], two[1]["fingerprint"])
    start = VectorModule().build_model().state_dict()
    assert max((one["params"][n] - start[n]).abs().max().item() for n in start) > 1e-3  # it trained


def test_dpzero_embedding_rows_two_processes_equal_one(tmp_path):
    """dpzero moves an embedding table only in the rows each rank's batch looks up (different rows on each rank)
    and writes them back exactly before the update: the ranks stay bit-identical, and equal to one process."""
    if "dpzero" not in installed_plugins():
        pytest.skip("plugin dpzero is not installed (dpl plugins)")
    plugins = OPTIONAL_PLUGINS["dpzero"]
    one = run(tmp_path / "one", 1, plugins=plugins, table=True)[0]
    two = run(tmp_path / "two", 2, plugins=plugins, table=True)
    for rank in two:
        assert_same_params(rank["params"], one["params"], atol=summation_tolerance(
            one, steps=4, lr=0.5, amplification=AMPLIFICATION["dpzero"]))
    assert torch.equal(two[0]["params"]["table.weight"], two[1]["params"]["table.weight"])
    assert torch.equal(two[0]["fingerprint"], two[1]["fingerprint"])
    start = VectorModule(table=True).build_model().state_dict()["table.weight"]
    assert (two[0]["params"]["table.weight"] - start).abs().min() > 0  # every row moved, looked up or not


def test_noise_std_is_the_single_process_one(tmp_path):
    """Zero gradients: after T SGD steps, theta_T - theta_0 = -lr * sum of T noise draws / B, whose std is
    lr * sigma * C * sqrt(T) / B. Per-rank noise would give sqrt(2) times that, halved noise 1/2."""
    sigma, clip, batch, lr, steps = 2.0, 0.5, 16, 0.5, 9
    ranks = run(tmp_path, 2, steps=steps, zero_loss=True, width=256, noise_multiplier=sigma, max_grad_norm=clip,
                batch_size=batch, seed=None, optimizer=functools.partial(torch.optim.SGD, lr=lr))
    start = VectorModule(width=256).build_model().state_dict()
    delta = torch.cat([(ranks[0]["params"][n] - start[n]).flatten() for n in start])
    expected = lr * sigma * clip * steps ** 0.5 / batch
    ratio = delta.std().item() / expected
    # 2306 coordinates: the sample std has relative standard error 1/sqrt(2 * 2306) = 1.5%; +-8% is > 5 of
    # them, while per-rank noise (x sqrt(2) = 1.41) or split noise (x 1/sqrt(2), x 1/2) is far outside
    assert delta.numel() == 2306
    assert 0.92 < ratio < 1.08, ratio
    assert_same_params(ranks[0]["params"], ranks[1]["params"], atol=0)


def test_ranks_identical_without_seed_and_with_secure_noise(tmp_path):
    for secure in (False, True):
        ranks = run(tmp_path / str(secure), 2, steps=3, seed=None, secure_noise=secure)
        assert_same_params(ranks[0]["params"], ranks[1]["params"], atol=0)
        assert [len(b) for b in ranks[0]["batches"]] != [0, 0, 0]
        if secure:
            assert "RankZero" in ranks[0]["noise"]
    # and the seedless runs differ from each other (fresh OS entropy, broadcast from rank 0)
    a = run(tmp_path / "a", 2, steps=3, seed=None)[0]["params"]
    b = run(tmp_path / "b", 2, steps=3, seed=None)[0]["params"]
    assert any(not torch.equal(a[n], b[n]) for n in a)


class NudgeRankOne(L.Callback):
    """Moves rank 1's first weight by ``size`` before the first step: replicas that no longer agree."""

    def __init__(self, size: float) -> None:
        self.size = size

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == 1 and batch_idx == 0:
            with torch.no_grad():
                next(pl_module.model.parameters()).add_(self.size)


def test_replica_check_catches_diverged_ranks(tmp_path):
    """The check after the first step: a real divergence stops the run on every rank; a float-rounding drift
    (below 1e-5 relative) is removed by copying rank 0's parameters, so the ranks end bit-identical."""
    with pytest.raises(Exception, match="rank 1 diverged from rank 0 at step 1"):
        run(tmp_path / "diverged", 2, steps=2, callbacks=[NudgeRankOne(0.5)])
    drifted = run(tmp_path / "drift", 2, steps=2, callbacks=[NudgeRankOne(1e-9)])
    assert_same_params(drifted[0]["params"], drifted[1]["params"], atol=0)
    assert torch.equal(drifted[0]["fingerprint"], drifted[1]["fingerprint"])


def test_validation_is_sharded_and_synchronized(tmp_path):
    one = run(tmp_path / "one", 1, steps=2, validate=True)[0]
    two = run(tmp_path / "two", 2, steps=2, validate=True)
    assert sorted(two[0]["val_seen"] + two[1]["val_seen"]) == list(range(21))  # each example once, no padding
    assert not set(two[0]["val_seen"]) & set(two[1]["val_seen"])
    assert two[0]["val_loss"] == two[1]["val_loss"]
    assert abs(two[0]["val_loss"] - one["val_loss"]) < 0.05  # mean of the ranks' means (11 vs 10 examples)


def test_checkpoint_resume_under_ddp(tmp_path):
    straight = run(tmp_path / "straight", 2, steps=6)
    ckpt = tmp_path / "half.ckpt"
    run(tmp_path / "first", 2, steps=6, callbacks=[SaveAndStopAt(3, ckpt)])
    assert ckpt.is_file() and secret_path(ckpt).is_file()
    assert stat.S_IMODE(secret_path(ckpt).stat().st_mode) == 0o600
    assert "dpl_secret" not in torch.load(ckpt, weights_only=False)
    resumed = run(tmp_path / "resumed", 2, steps=6, ckpt_path=str(ckpt))
    for rank in (0, 1):
        assert resumed[rank]["steps"] == 6
        assert_same_params(resumed[rank]["params"], straight[0]["params"])
    assert torch.equal(resumed[0]["fingerprint"], resumed[1]["fingerprint"])
    # without privacy.seed the continuation draws fresh noise: rank 0's, the same on every rank
    branch = run(tmp_path / "branch", 2, steps=6, ckpt_path=str(ckpt), seed=None)
    assert torch.equal(branch[0]["fingerprint"], branch[1]["fingerprint"])
    assert_same_params(branch[0]["params"], branch[1]["params"], atol=0)
    assert any(not torch.equal(branch[0]["params"][n], straight[0]["params"][n]) for n in straight[0]["params"])
    # without the sidecar: fresh OS entropy, but still one generator state on every rank
    os.unlink(secret_path(ckpt))
    fresh = run(tmp_path / "fresh", 2, steps=6, ckpt_path=str(ckpt))
    assert torch.equal(fresh[0]["fingerprint"], fresh[1]["fingerprint"])
    assert any(not torch.equal(fresh[0]["params"][n], straight[0]["params"][n]) for n in straight[0]["params"])


def check_cli_run(tmp_path: Path, fragment: str, model: str) -> None:
    """``dpl fit --config configs/strategies/<fragment>`` on 2 CPU processes through Lightning's subprocess launcher
    (it re-launches the command for rank 1): one summary line (rank 0), the checkpoint and its owner-only sidecar."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    ckpt_dir = tmp_path / "ckpt"
    args = ["fit", "--config", str(root / "configs" / "strategies" / fragment),
            "--model", model, "--model.privacy.noise_multiplier", "0.5",
            "--model.privacy.batch_size", "16", "--data", "test_ddp.IndexedData", "--trainer.max_epochs", "1",
            "--trainer.limit_train_batches", "3", "--trainer.accelerator", "cpu", "--trainer.logger", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path),
            "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            "--trainer.callbacks.dirpath", str(ckpt_dir), "--trainer.callbacks.save_last", "true"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(root)]), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "dpl.cli", *args], env=env, capture_output=True, text=True,
                            timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("trained 3 private steps") == 1  # printed by rank 0 only
    assert "Starting with 2 processes" in result.stderr + result.stdout
    last = ckpt_dir / "last.ckpt"
    assert last.is_file() and stat.S_IMODE(secret_path(last).stat().st_mode) == 0o600
    assert torch.load(last, weights_only=False)["dpl"]["steps_done"] == 3
    [entry] = (tmp_path / "privacy_ledger.jsonl").read_text().splitlines()  # the run is recorded once, by rank 0
    assert '"steps":3,' in entry and '"status":"finished"' in entry


def test_cli_with_the_ddp_fragment(tmp_path):
    """The real path: ``dpl fit --config configs/strategies/ddp.yaml`` (plain ``ddp``, subprocess launcher)."""
    check_cli_run(tmp_path, "ddp.yaml", "test_ddp.VectorModule")


def test_unsupported_strategy_is_refused():
    from types import SimpleNamespace

    from dpl.lightning.strategy import SINGLE_PROCESS, dp_strategy

    class FSDPStrategy:  # stands in for Lightning's (which needs CUDA to construct)
        pass

    with pytest.raises(ConfigError, match="sharded parameters"):
        dp_strategy(SimpleNamespace(world_size=2, strategy=FSDPStrategy()))
    with pytest.raises(ConfigError, match="DPFSDPStrategy"):  # FSDP1 wraps the parameters even in one process
        dp_strategy(SimpleNamespace(world_size=1, strategy=FSDPStrategy()))
    assert dp_strategy(SimpleNamespace(world_size=1, strategy=object())) is SINGLE_PROCESS  # any one-process one
    assert dp_strategy(None) is SINGLE_PROCESS


@pytest.fixture
def _registry_restored():
    """Lightning's strategy registry as it was (the dpl command gives Lightning's DDP names dpl's strategy)."""
    from lightning.pytorch.strategies import StrategyRegistry

    saved = dict(StrategyRegistry)
    yield
    StrategyRegistry.clear()
    StrategyRegistry.update(saved)


def test_strategy_selection(_registry_restored):
    """dpl's DDP strategy by its own names and, once the dpl command mapped them, by Lightning's (``auto`` on
    several devices included); Lightning's plain DDP is refused in one line that names the strategy to use."""
    from lightning.pytorch.strategies import DDPStrategy

    from dpl.lightning.ddp import use_for_lightning_names
    from dpl.lightning.strategy import dp_strategy

    def trainer(strategy):
        return L.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)

    plain = trainer(DDPStrategy(start_method="fork"))
    with pytest.raises(ConfigError, match=r"DPDDPStrategy.*use_distributed_sampler=False") as refused:
        dp_strategy(plain)
    assert "\n" not in str(refused.value)
    for name in ("dpl_ddp", "dpl_ddp_spawn", "dpl_ddp_fork"):
        chosen = trainer(name)
        assert isinstance(chosen.strategy, DPDDPStrategy) and dp_strategy(chosen) is chosen.strategy
    use_for_lightning_names()
    for name in ("ddp", "ddp_spawn", "ddp_fork", "auto"):
        chosen = trainer(name)
        assert isinstance(chosen.strategy, DPDDPStrategy), name
        assert dp_strategy(chosen) is chosen.strategy


def test_cli_runs_lightning_ddp_as_dpl_strategy(tmp_path, _registry_restored):
    """The ``dpl`` command: ``--trainer.strategy ddp`` and a ``DDPStrategy`` class path become dpl's strategy (same
    options), and Lightning's distributed sampler is off whatever the config says."""
    from lightning.pytorch.strategies import DDPStrategy

    from dpl.cli_lightning import DPLightningCLI
    from dpl.lightning.data import DPDataModule

    common = ["--model", "test_ddp.VectorModule", "--data", "test_ddp.IndexedData", "--trainer.max_epochs", "1",
              "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.logger", "false",
              "--trainer.use_distributed_sampler", "true", "--trainer.default_root_dir", str(tmp_path)]
    for strategy in (["ddp"], ["lightning.pytorch.strategies.DDPStrategy", "--trainer.strategy.timeout", "0:05:00"]):
        cli = DPLightningCLI(DPModule, DPDataModule, subclass_mode_model=True, subclass_mode_data=True,
                             save_config_callback=None, run=False, args=[*common, "--trainer.strategy", *strategy])
        assert type(cli.trainer.strategy) is DPDDPStrategy and isinstance(cli.trainer.strategy, DDPStrategy)
        assert cli.config.trainer.use_distributed_sampler is False


class UserIndexedData(IndexedData):
    """IndexedData whose rows belong to users of 1 to 4 rows (row i: user i // 4 + (i % 4 == 3))."""

    def train_user_keys(self):
        return [str(i // 4 + (i % 4 == 3)) for i in range(self.n)]


def test_user_level_sampling_two_processes_equal_one(tmp_path):
    """privacy.unit: user under DDP: ranks hold whole users (never a user split across them) and the result equals one
    process, to the float32-summation tolerance."""
    settings = dict(noise_multiplier=0.5, batch_size=8, physical_batch_size=3, seed=7, max_grad_norm=1.0,
                    unit="user", max_rows_per_user=2)

    def fit(out, devices):
        module = VectorModule(privacy=PrivacyConfig(**settings), optimizer=functools.partial(torch.optim.SGD, lr=0.5))
        trainer = L.Trainer(max_epochs=1, limit_train_batches=4, accelerator="cpu", devices=devices,
                            strategy=DPDDPStrategy(start_method="fork") if devices > 1 else "auto",
                            use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                            limit_val_batches=0, default_root_dir=str(out), precision="64-true",
                            callbacks=[Recorder(out / "ranks")])
        threads = torch.get_num_threads()
        if devices > 1:
            torch.set_num_threads(1)
        try:
            trainer.fit(module, UserIndexedData(160))
        finally:
            torch.set_num_threads(threads)
        return [torch.load(out / "ranks" / f"rank{r}.pt", weights_only=False) for r in range(devices)]

    one = fit(tmp_path / "one", 1)[0]
    two = fit(tmp_path / "two", 2)
    user_of = UserIndexedData(160).train_user_keys()
    for step, batch in enumerate(one["batches"]):
        shards = [set(r["batches"][step]) for r in two]
        assert sorted(shards[0] | shards[1]) == sorted(batch)
        assert not {user_of[i] for i in shards[0]} & {user_of[i] for i in shards[1]}  # users whole on one rank
        assert max(Counter(user_of[i] for i in batch).values(), default=0) <= 2  # at most k rows of a user
    assert any(one["batches"])
    for rank in two:
        assert rank["sigma"] == one["sigma"] and rank["epsilon"] == one["epsilon"]
        assert_same_params(rank["params"], one["params"], atol=summation_tolerance(one, steps=4, lr=0.5, batch=8))
