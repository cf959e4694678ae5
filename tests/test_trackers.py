"""Experiment trackers: real tiny runs logged to MLflow (a local file store) and Weights & Biases (offline); the
tracker's own store holds ε at the steps taken, δ, σ, the unit, every validation metric and the privacy report
(the shipped fragments configs/trackers/*.yaml), and dpl's run folder (metrics.csv, checkpoints, privacy.json) stays where it is. Skipped without the packages
(``pip install -e ".[trackers]"``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import save_tiny_bert, write_sentiment_tsv

from dpl.cli import main
from dpl.lightning.trackers import privacy_params

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trackers")
    write_sentiment_tsv(tmp / "data" / "train.tsv", rows=64)
    write_sentiment_tsv(tmp / "data" / "validation.tsv", rows=8, seed=1)
    return {"model": save_tiny_bert(tmp / "bert"), "data": tmp / "data"}


def _fit(tiny: dict, tmp: Path, tracker: str, store: str) -> Path:
    """A 3-step run with the shipped fragment ``configs/trackers/<tracker>.yaml``, its store moved to ``store``."""
    where = {"mlflow": "tracking_uri", "wandb": "save_dir"}[tracker]
    main(["fit", "--config", str(ROOT / "configs" / "trackers" / f"{tracker}.yaml"),
          f"--trainer.logger.init_args.{where}", store, "--model", "dpl.tasks.modules.DPClassificationModule",
          "--model.model", tiny["model"], "--data", "dpl.tasks.data.ClassificationDataModule", "--data.tokenizer",
          tiny["model"], "--data.data_dir", str(tiny["data"]), "--data.max_length", "16",
          "--model.privacy.target_epsilon", "8", "--model.privacy.batch_size", "16", "--trainer.max_steps", "3",
          "--trainer.val_check_interval", "3", "--trainer.num_sanity_val_steps", "0", "--trainer.accelerator", "cpu",
          "--trainer.default_root_dir", str(tmp / "runs")])
    run = sorted((tmp / "runs").glob("lightning_logs/version_*"))[-1]
    assert (run / "metrics.csv").is_file() and (run / "privacy.json").is_file()  # the run folder stays
    assert list(run.glob("checkpoints/last.ckpt"))
    return run


def test_privacy_params_are_public_plan_values():
    summary = {"unit": "user", "delta": 1e-5, "noise_multiplier": 0.9, "epsilon": 3.0, "seeded": True,
               "plugins": {}, "max_grad_norm": 1.0, "num_units": None}
    assert privacy_params(summary) == {"privacy/unit": "user", "privacy/delta": 1e-5, "privacy/sigma": 0.9,
                                       "privacy/max_grad_norm": 1.0}


def test_mlflow_file_store_holds_epsilon_delta_sigma_unit_metrics_and_report(tiny, tmp_path, monkeypatch, capsys):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store behind this switch
    from mlflow.tracking import MlflowClient

    store = tmp_path / "mlruns"
    run = _fit(tiny, tmp_path, "mlflow", f"file:{store}")
    assert "dpl: trained 3 private steps" in capsys.readouterr().out
    report = json.loads((run / "privacy.json").read_text())
    client = MlflowClient(tracking_uri=f"file:{store}")
    found, = client.search_runs([client.get_experiment_by_name("dpl").experiment_id])
    run_id = found.info.run_id
    history = client.get_metric_history(run_id, "epsilon")
    assert [m.step for m in history][-1] == 3 and history[-1].value == pytest.approx(report["epsilon"], rel=1e-5)
    assert {"val_acc", "val_f1", "val_loss"} <= set(found.data.metrics)
    params = found.data.params
    assert params["privacy/unit"] == "example" and float(params["privacy/delta"]) == pytest.approx(report["delta"])
    assert float(params["privacy/sigma"]) == pytest.approx(report["noise_multiplier"])
    assert not any("seed" in k or "generator" in k for k in [*params, *found.data.metrics])
    names = {a.path for a in client.list_artifacts(run_id, "privacy")}
    assert names == {"privacy/privacy.json", "privacy/privacy.md"}
    copy = Path(client.download_artifacts(run_id, "privacy/privacy.json", str(tmp_path / "copy")))
    assert json.loads(copy.read_text()) == report and report["run"]["status"] == "finished"


def wandb_records(path: Path) -> list:
    """The records of an offline W&B run file (``run-*.wandb``): LevelDB-log framed protocol buffers (32 KiB blocks
    of records with a 7-byte header: checksum, length, type full/first/middle/last) after a 7-byte file header."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    at, pending, raw = 7, b"", []
    while at + 7 <= len(data):
        left = 32768 - at % 32768
        if left < 7:  # the rest of a block is padding
            at += left
            continue
        _, length, kind = struct.unpack("<IHB", data[at:at + 7])
        chunk, at = data[at + 7:at + 7 + length], at + 7 + length
        if kind in (1, 2):
            pending = chunk
        elif kind in (3, 4):
            pending += chunk
        if kind in (1, 4):
            raw.append(pending)
    records = []
    for item in raw:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(item)
        records.append(record)
    return records


def test_wandb_offline_run_holds_epsilon_delta_sigma_unit_metrics_and_report(tiny, tmp_path, monkeypatch, capsys):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    store = tmp_path / "wandb_store"
    store.mkdir()
    run = _fit(tiny, tmp_path, "wandb", str(store))
    wandb.finish()
    wandb.teardown()  # the service process writes the run file out
    capsys.readouterr()
    report = json.loads((run / "privacy.json").read_text())
    offline, = (store / "wandb").glob("offline-run-*")
    records = wandb_records(next(offline.glob("run-*.wandb")))
    def key(item) -> str:
        return item.key or "/".join(item.nested_key)

    history = [{key(i): json.loads(i.value_json) for i in r.history.item} for r in records if r.HasField("history")]
    epsilon = [h["epsilon"] for h in history if "epsilon" in h]
    assert epsilon[-1] == pytest.approx(report["epsilon"], rel=1e-5) and epsilon == sorted(epsilon)
    assert any({"val_acc", "val_f1", "val_loss"} <= set(h) for h in history)
    config = {key(i): json.loads(i.value_json) for r in records if r.HasField("config") for i in r.config.update}
    assert config["privacy/unit"] == "example" and config["privacy/delta"] == pytest.approx(report["delta"])
    assert config["privacy/sigma"] == pytest.approx(report["noise_multiplier"])
    saved = {f.path for r in records if r.HasField("files") for f in r.files.files}
    assert {"privacy.json", "privacy.md"} <= saved
    assert json.loads((offline / "files" / "privacy.json").read_text()) == report


def test_a_tracker_keeps_the_run_folder_first(tmp_path):
    from lightning.pytorch.loggers import CSVLogger, Logger

    from dpl.lightning.trackers import with_run_folder

    class Tracker(Logger):  # a tracker that stores nothing on disk
        name, version = "t", 0

        def log_metrics(self, metrics, step=None): ...

        def log_hyperparams(self, params, *args, **kwargs): ...

    tracker, csv = Tracker(), CSVLogger(save_dir=str(tmp_path / "other"))
    first, second = with_run_folder(tracker, str(tmp_path / "runs"))
    assert isinstance(first, CSVLogger) and first.save_dir == str(tmp_path / "runs") and second is tracker
    assert with_run_folder([tracker, csv], None) == [csv, tracker]  # the config's own CSV logger, moved first
    assert with_run_folder(csv, None) is csv and with_run_folder(False, None) is False
