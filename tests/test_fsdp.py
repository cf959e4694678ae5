"""FSDP (sharded parameters, ``dpl.lightning.fsdp.DPFSDPStrategy``) with the privacy guarantee of one process.

Two CPU processes (gloo, FSDP2 ``fully_shard``, forked) against one process on the same data, seed and global
batch: the same parameters (to float tolerance) for the default mechanism and each plugin that supports sharding,
on a block model and on a tiny BERT (embeddings, LayerNorm, padded sequences); parameters really are sharded;
filler examples change nothing; checkpoint/resume; the CLI with ``configs/strategies/fsdp.yaml``; refusals.
"""

from __future__ import annotations

import functools
import stat
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import SaveAndStopAt, save_tiny_bert, write_sentiment_tsv
from test_ddp import OPTIONAL_PLUGINS, IndexedData, Recorder, assert_same_params, check_cli_run, summation_tolerance
from torch import nn

from dpl.lightning.checkpoint import secret_path
from dpl.lightning.samplers import PADDING_KEY, BalancedShardBatchSampler, ShardedBatchSampler
from dpl.errors import ConfigError
from dpl.core.sharding import as_gradient_of
from dpl.lightning.fsdp import DPFSDPStrategy
from dpl.lightning.module import DPModule
from dpl.core.plugin_manager import installed_plugins
from dpl.core.privacy import PrivacyConfig
from dpl.core.sampling import PoissonBatchSampler
from dpl.core.step import RunSetup

DIM = 6
pytestmark = pytest.mark.filterwarnings("ignore::dpl.errors.PrivacyWarning")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class BlockNet(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, width)
        self.blocks = nn.ModuleList([Block(width) for _ in range(2)])
        self.head = nn.Linear(width, 2)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class BlockModule(DPModule):
    """Input layer, a ModuleList of blocks (each its own FSDP unit), a head."""

    def __init__(self, width: int = 10, **kwargs) -> None:
        super().__init__(**kwargs)
        self.width = width
        self.kinds: list[str] = []
        self.val_seen: list[int] = []

    def build_model(self) -> nn.Module:
        torch.manual_seed(0)
        return BlockNet(self.width).double()  # float64: see tests/test_ddp.py::summation_tolerance

    def per_example_loss(self, batch):  # through the root's forward: FSDP gathers the root unit's parameters there
        return F.cross_entropy(self.model(batch["x"].double()), batch["labels"], reduction="none")

    def on_train_start(self) -> None:
        self.kinds = sorted({type(p).__name__ for p in self.model.parameters()})

    def validation_step(self, batch, batch_idx):
        self.val_seen += batch["idx"].tolist()
        self.log("val_loss", self.per_example_loss(batch).mean(), sync_dist=True, batch_size=len(batch["idx"]))


@pytest.fixture(autouse=True)
def _fresh_port(monkeypatch):
    for var in ("MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def fit(module: DPModule, data: L.LightningDataModule, out: Path, devices: int, steps: int, ckpt_path=None,
        callbacks=(), validate: bool = False, accelerator: str = "cpu") -> list[dict]:
    # fork is fast, but a process forked after CUDA was initialised cannot use CUDA (not even torch's lazy checks)
    fork = accelerator == "cpu" and not torch.cuda.is_initialized()
    strategy = DPFSDPStrategy(start_method="fork" if fork else "spawn") if devices > 1 else "auto"
    trainer = L.Trainer(max_epochs=1, limit_train_batches=steps, accelerator=accelerator, devices=devices,
                        strategy=strategy, use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=None if validate else 0, default_root_dir=str(out),
                        callbacks=[Recorder(out / "ranks"), *callbacks])
    threads = torch.get_num_threads()
    if devices > 1:
        torch.set_num_threads(1)  # fork with one intra-op thread (see tests/test_ddp.py)
    try:
        trainer.fit(module, data, ckpt_path=ckpt_path)
    finally:
        torch.set_num_threads(threads)
    return [torch.load(out / "ranks" / f"rank{r}.pt", weights_only=False) for r in range(devices)]


def run_blocks(out: Path, devices: int, steps: int = 4, plugins=None, optimizer=None, sigma: float = 0.5,
               privacy: dict | None = None, **kwargs) -> list[dict]:
    settings = dict(noise_multiplier=sigma, batch_size=16, physical_batch_size=3, seed=7, max_grad_norm=1.0,
                    **(privacy or {}))
    module = BlockModule(privacy=PrivacyConfig(**settings), plugins=plugins,
                         optimizer=optimizer or functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9))
    return fit(module, IndexedData(160), out, devices, steps, **kwargs)


# ---------------------------------------------------------------------------------------------------------
# samplers and slicing (no processes)


def test_fsdp_shards_are_padded_with_zero_weight_fillers():
    n = 50
    global_batches = list(PoissonBatchSampler(n, 0.2, 8, torch.Generator().manual_seed(3)))
    shards = [list(ShardedBatchSampler(PoissonBatchSampler(n, 0.2, 8, torch.Generator().manual_seed(3)), r, 3,
                                       pad_to=n)) for r in range(3)]
    for step, batch in enumerate(global_batches):
        parts = [shard[step] for shard in shards]
        assert len({len(p) for p in parts}) == 1  # every rank runs as many examples (hence micro-batches)
        real = [[i for i in p if i < n] for p in parts]
        assert sorted(i for p in real for i in p) == sorted(batch)  # the real ones: exactly the global batch
        assert all(i - n in batch for p in parts for i in p if i >= n)  # fillers repeat members of the batch


def test_filler_flags_refuse_a_reordering_collate():
    from dpl.lightning.samplers import PaddedCollate

    def reordering(examples):  # e.g. a collate that sorts longest first itself
        examples = sorted(examples, key=lambda e: len(e["input_ids"]), reverse=True)
        return {"attention_mask": torch.tensor([[1] * len(e["input_ids"]) + [0] * (3 - len(e["input_ids"]))
                                                for e in examples])}

    items = [({"input_ids": [1]}, False), ({"input_ids": [1, 2, 3]}, True)]
    with pytest.raises(RuntimeError, match="keep the examples' order"):
        PaddedCollate(reordering)(items)
    in_order = PaddedCollate(lambda ex: reordering(ex[:1]) | {"attention_mask": torch.tensor([[1, 0, 0], [1, 1, 1]])})
    assert in_order(items)[PADDING_KEY].tolist() == [False, True]


def test_balanced_eval_batches():
    for n, world, size in [(21, 2, 8), (10, 3, 2), (7, 2, 3)]:
        samplers = [BalancedShardBatchSampler(n, r, world, size) for r in range(world)]
        assert len({len(list(s)) for s in samplers}) == 1
        seen = [i for s in samplers for b in s for i in b]
        assert sorted(seen) == list(range(n)) and all(len(b) <= size for s in samplers for b in s)
    with pytest.raises(ConfigError, match="eval_batch_size"):
        BalancedShardBatchSampler(3, 1, 2, 1)


def test_fillers_contribute_exactly_zero():
    from plugins.clip import ClipPlugin

    model = nn.Sequential(nn.Linear(DIM, 4), nn.Tanh(), nn.Linear(4, 2))
    x, y = torch.randn(5, DIM), torch.tensor([0, 1, 1, 0, 1])

    def loss(batch):
        return F.cross_entropy(model(batch["x"]), batch["labels"], reduction="none")

    ctx = SimpleNamespace(model=model, per_example_loss=loss, max_grad_norm=0.5)
    clip = ClipPlugin()
    alone = clip.estimate_gradient(ctx=ctx, batch={"x": x[:3], "labels": y[:3]})
    padded = clip.estimate_gradient(ctx=ctx, batch={"x": x, "labels": y,
                                                    PADDING_KEY: torch.tensor([False] * 3 + [True] * 2)})
    assert padded.count == 3 and alone.count == 3
    for name in alone.values:
        torch.testing.assert_close(padded.values[name], alone.values[name], rtol=0, atol=1e-7)


# ---------------------------------------------------------------------------------------------------------
# 2 processes == 1 process

FSDP_PLUGINS = {k: v for k, v in OPTIONAL_PLUGINS.items() if k != "dpzero"}


@pytest.mark.parametrize("case", ["default", *FSDP_PLUGINS])
def test_two_sharded_processes_equal_one(tmp_path, case):
    plugins = None
    optimizer = None
    if case != "default":
        if case not in installed_plugins():
            pytest.skip(f"plugin {case} is not installed (dpl plugins)")
        plugins = FSDP_PLUGINS[case]
        if case == "adambc":  # adambc runs under plain SGD; its weight decay reads the (sharded) parameters
            plugins = {"adambc": {"gamma": 1e-3, "weight_decay": 0.1}}
            optimizer = functools.partial(torch.optim.SGD, lr=0.05)
    one = run_blocks(tmp_path / "one", 1, plugins=plugins, optimizer=optimizer)[0]
    two = run_blocks(tmp_path / "two", 2, plugins=plugins, optimizer=optimizer)
    for step, batch in enumerate(one["batches"]):
        real = [{i for i in r["batches"][step] if i < 160} for r in two]
        assert not real[0] & real[1] and sorted(real[0] | real[1]) == sorted(batch)
        assert len(two[0]["batches"][step]) == len(two[1]["batches"][step])  # padded to the same size
    for rank in two:
        assert rank["world"] == 2
        assert rank["epsilon"] == one["epsilon"] and rank["sigma"] == one["sigma"]
        # SGD with momentum 0.9 carries a difference into every later step: at most 1 / (1 - 0.9) = 10 times
        lr, amplification = (0.05, 2 / 1e-3 ** 0.5) if case == "adambc" else (0.5, 10.0 * (2.0 if case == "denoise" else 1.0))
        assert_same_params(rank["params"], one["params"], atol=summation_tolerance(
            one, steps=4, lr=lr, amplification=amplification))
    start = BlockModule().build_model().state_dict()
    assert max((one["params"][n] - start[n]).abs().max().item() for n in start) > 1e-3  # it trained
    assert torch.equal(two[0]["fingerprint"], two[1]["fingerprint"])  # same generator states


@pytest.mark.parametrize("thresholds", ["fixed", "adaptive"])
def test_per_layer_clipping_two_sharded_processes_equal_one(tmp_path, thresholds):
    """Group-wise clipping under FSDP: each rank clips its examples layer by layer in its one backward pass (no
    second pass, which ``clipping_memory: low`` would need and FSDP refuses); the adaptive counts are summed over
    the ranks with the clipped sums."""
    privacy = dict(clipping="per_layer", clipping_thresholds=thresholds)
    one = run_blocks(tmp_path / "one", 1, privacy=privacy)[0]
    two = run_blocks(tmp_path / "two", 2, privacy=privacy)
    for rank in two:
        assert rank["epsilon"] == one["epsilon"] and rank["sigma"] == one["sigma"]
        # SGD with momentum 0.9 carries a difference into every later step: at most 1 / (1 - 0.9) = 10 times
        assert_same_params(rank["params"], one["params"], atol=summation_tolerance(
            one, steps=4, lr=0.5, amplification=10.0))
    assert torch.equal(two[0]["fingerprint"], two[1]["fingerprint"])
    start = BlockModule().build_model().state_dict()
    assert max((one["params"][n] - start[n]).abs().max().item() for n in start) > 1e-3  # it trained


def test_parameters_are_sharded_and_validation_synchronized(tmp_path):
    class Kinds(L.Callback):
        def on_train_end(self, trainer, pl_module):
            torch.save(pl_module.kinds, tmp_path / f"kinds{trainer.global_rank}.pt")

    one = run_blocks(tmp_path / "one", 1, steps=2, validate=True)[0]
    two = run_blocks(tmp_path / "two", 2, steps=2, validate=True, callbacks=[Kinds()])
    assert torch.load(tmp_path / "kinds0.pt") == ["DTensor"]
    assert two[0]["val_loss"] == two[1]["val_loss"]
    assert abs(two[0]["val_loss"] - one["val_loss"]) < 0.05


def test_tiny_bert_two_sharded_processes_equal_one(tmp_path):
    """Embeddings, LayerNorm, attention over right-padded sequences, a ModuleList of BERT layers (FSDP units)."""
    from dpl.tasks.data.classification import ClassificationDataModule
    from dpl.tasks.modules.classification import DPClassificationModule

    folder = save_tiny_bert(tmp_path / "bert")
    data_dir = tmp_path / "data"
    write_sentiment_tsv(data_dir / "train.tsv", rows=96)
    write_sentiment_tsv(data_dir / "validation.tsv", rows=20, seed=1)

    class Float64Classification(DPClassificationModule):  # float64: see tests/test_ddp.py::summation_tolerance
        def build_model(self):
            return super().build_model().double()

    def run(out, devices):
        module = Float64Classification(model=folder, privacy=PrivacyConfig(
            noise_multiplier=0.7, batch_size=24, physical_batch_size=5, seed=3, max_grad_norm=0.5),
            optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9))
        data = ClassificationDataModule(tokenizer=folder, data_dir=str(data_dir), max_length=16, eval_batch_size=4)
        return fit(module, data, out, devices, steps=3)

    one = run(tmp_path / "one", 1)[0]
    two = run(tmp_path / "two", 2)
    tolerance = summation_tolerance(one, steps=3, lr=0.1, clip=0.5, batch=24, amplification=10.0)
    for rank in two:
        assert_same_params(rank["params"], one["params"], atol=tolerance)
    assert any(len(b) for b in one["batches"])


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, 50, (n, 6), generator=gen)
        self.labels = torch.randint(0, 2, (n,), generator=gen)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class TokenData(IndexedData):
    def setup(self, stage: str | None = None) -> None:
        self.train_set, self.val_set = Tokens(self.n), Tokens(8)

    def collate(self, examples):
        return {k: torch.stack([e[k] for e in examples]) for k in ("input_ids", "labels")}


class TinyLlamaModule(DPModule):
    def build_model(self) -> nn.Module:
        from helpers import tiny_llama

        return tiny_llama().double()  # float64: see tests/test_ddp.py::summation_tolerance

    def per_example_loss(self, batch):
        return F.cross_entropy(self.model(input_ids=batch["input_ids"]).logits, batch["labels"], reduction="none")


def test_tiny_llama_full_finetuning_sharded_equals_one(tmp_path):
    """RMSNorm weights train under FSDP through their closed form (no parameter value needed)."""
    def run(out, devices):
        module = TinyLlamaModule(privacy=PrivacyConfig(noise_multiplier=0.6, batch_size=16, physical_batch_size=4,
                                                       seed=5, max_grad_norm=0.5),
                                 optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9))
        return fit(module, TokenData(96), out, devices, steps=3)

    one = run(tmp_path / "one", 1)[0]
    two = run(tmp_path / "two", 2)
    assert any("norm" in n for n in one["params"])
    tolerance = summation_tolerance(one, steps=3, lr=0.1, clip=0.5, amplification=10.0)
    for rank in two:
        assert_same_params(rank["params"], one["params"], atol=tolerance)


def test_checkpoint_resume_under_fsdp(tmp_path):
    straight = run_blocks(tmp_path / "straight", 2, steps=6)
    ckpt = tmp_path / "half.ckpt"
    run_blocks(tmp_path / "first", 2, steps=6, callbacks=[SaveAndStopAt(3, ckpt)])
    assert ckpt.is_file() and stat.S_IMODE(secret_path(ckpt).stat().st_mode) == 0o600
    saved = torch.load(ckpt, weights_only=False)
    assert "dpl_secret" not in saved
    assert all(type(v) is torch.Tensor for v in saved["state_dict"].values())  # full weights, not shards
    resumed = run_blocks(tmp_path / "resumed", 2, steps=6, ckpt_path=str(ckpt))
    for rank in (0, 1):
        assert resumed[rank]["steps"] == 6
        assert_same_params(resumed[rank]["params"], straight[0]["params"])


def test_cli_with_the_fsdp_fragment(tmp_path):
    """``dpl fit --config configs/strategies/fsdp.yaml``: Lightning re-launches the command for rank 1."""
    check_cli_run(tmp_path, "fsdp.yaml", "test_fsdp.BlockModule")


# ---------------------------------------------------------------------------------------------------------
# refusals


def _sharded_setup(model: nn.Module, **kwargs) -> RunSetup:
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    base = dict(model=model, trainable=trainable, plugin_names=[], population=100, expected_batch_size=10,
                steps=5, sampling_rate=0.1, accountant="prv", optimizer_name="SGD",
                world_size=2, sharded=True)
    base.update(kwargs)
    return RunSetup(**base)


def test_refusals_under_fsdp():
    from plugins.clip import ClipPlugin

    class Scale(nn.Module):  # a module whose per-example gradient needs its parameter's value
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x * self.weight

    with pytest.raises(ConfigError, match="FSDP.*Scale"):
        ClipPlugin().validate_setup(setup=_sharded_setup(nn.Sequential(nn.Linear(3, 4), Scale())))
    ClipPlugin().validate_setup(setup=_sharded_setup(nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))))
    with pytest.raises(ConfigError, match="estimate_gradient"):
        ClipPlugin().validate_setup(setup=_sharded_setup(nn.Linear(3, 4), replaced_hooks=frozenset(
            {"estimate_gradient"})))
    if "dpzero" in installed_plugins():  # declared in its contract (full_tensors), refused by the core
        from dpl.core.plugin_manager import check_contracts, create_plugin_manager

        with pytest.raises(ConfigError, match="sharded"):
            check_contracts(create_plugin_manager({"dpzero": {}}), sharded=True)

    from dpl.lightning.strategy import dp_strategy

    class FSDPStrategy:  # Lightning's FSDP1 strategy (which needs CUDA to construct) and plain ModelParallel
        pass

    with pytest.raises(ConfigError, match="DPFSDPStrategy"):
        dp_strategy(SimpleNamespace(world_size=2, strategy=FSDPStrategy()))


def test_as_gradient_of_plain_parameter():
    param = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    grad = as_gradient_of(param, torch.ones(3))
    assert grad.dtype == torch.float64 and torch.equal(grad, torch.ones(3, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------------------
# GPUs (skipped on CPU-only machines)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="FSDP over GPUs needs >= 2 CUDA GPUs (none here)")
def test_two_gpus_sharded_equal_one_gpu(tmp_path):  # pragma: no cover - GPU only
    """NCCL: 2 GPUs with sharded parameters = 1 GPU (the same CUDA noise generator state on both ranks)."""
    one = run_blocks(tmp_path / "one", 1, accelerator="gpu")[0]
    two = run_blocks(tmp_path / "two", 2, accelerator="gpu")
    for rank in two:
        assert_same_params(rank["params"], one["params"], atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)")
def test_one_gpu_equals_two_sharded_cpu_processes(tmp_path):  # pragma: no cover - GPU only
    """Same batches, clipping and update on 1 GPU and on 2 FSDP CPU processes. sigma = 0: CUDA and CPU generators
    draw different noise, so only the noiseless path can be compared across devices."""
    cpu = run_blocks(tmp_path / "cpu", 2, sigma=0.0)  # first: its processes fork before this one uses CUDA
    gpu = run_blocks(tmp_path / "gpu", 1, sigma=0.0, accelerator="gpu")[0]
    for step, batch in enumerate(gpu["batches"]):
        real = {i for r in cpu for i in r["batches"][step] if i < 160}
        assert sorted(real) == sorted(batch)
    for rank in cpu:
        assert_same_params({k: v.cpu() for k, v in gpu["params"].items()}, rank["params"], atol=1e-4)


def test_strategy_name_is_registered():
    trainer = L.Trainer(strategy="dpl_fsdp", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, DPFSDPStrategy)


def test_progress_counts_real_examples_only():
    from dpl.lightning.progress import _batch_size

    batch = {"x": torch.zeros(5, 2), PADDING_KEY: torch.tensor([False, False, True, False, True])}
    assert _batch_size(batch) == 3 and _batch_size({"x": torch.zeros(5, 2)}) == 5
