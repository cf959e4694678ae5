"""SIGTERM stops a run cleanly: within a step, exit status 143, complete checkpoints and report kept, and a run
without a checkpoint leaves nothing behind but its line in the privacy ledger; a long generation stops at the next
token."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import save_tiny_bert, write_sentiment_tsv

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("signals")
    model = save_tiny_bert(tmp / "bert")
    write_sentiment_tsv(tmp / "data" / "train.tsv", rows=96)
    write_sentiment_tsv(tmp / "data" / "validation.tsv", rows=8, seed=1)
    return tmp, model


def _start(world, root: Path, *extra: str) -> subprocess.Popen:
    tmp, model = world
    args = ["fit", "--model", "dpl.tasks.modules.DPClassificationModule", "--model.model", model,
            "--model.privacy.noise_multiplier", "1.0", "--model.privacy.max_epsilon", "1e6",
            "--model.privacy.batch_size", "16",
            "--model.privacy.log_epsilon_every_n_steps", "1000",
            "--data", "dpl.tasks.data.ClassificationDataModule", "--data.tokenizer", model,
            "--data.data_dir", str(tmp / "data"), "--data.max_length", "16", "--trainer.max_steps", "3000",
            "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(root), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "dpl.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _wait_for(condition, process: subprocess.Popen, limit: float = 240.0) -> None:
    start = time.monotonic()
    while not condition():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() - start < limit, "timed out"
        time.sleep(0.2)


def _terminate(process: subprocess.Popen) -> tuple[int, str, float]:
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    try:
        _, err = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail("the run kept going after SIGTERM")
    return process.returncode, err, time.monotonic() - sent


def test_sigterm_after_a_checkpoint_keeps_it_complete(world, tmp_path):
    root = tmp_path / "runs"
    process = _start(world, root)
    _wait_for(lambda: any(root.rglob("checkpoints/last.ckpt")), process)
    code, err, _ = _terminate(process)
    assert code == 143 and "stopped by SIGTERM" in err and "Traceback" not in err, err
    run = next(root.glob("lightning_logs/version_*"))
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    report = json.loads((run / "privacy.json").read_text())
    assert checkpoint["dpl"]["steps_done"] >= 1 and report["steps_taken"] >= checkpoint["dpl"]["steps_done"]
    assert not list(run.rglob("*.tmp"))


def test_sigterm_before_any_checkpoint_leaves_nothing_but_its_ledger_line(world, tmp_path):
    root = tmp_path / "runs"
    process = _start(world, root, "--trainer.enable_checkpointing", "false")
    _wait_for(lambda: any(root.rglob("privacy.json")), process)  # training started
    code, err, _ = _terminate(process)
    assert code == 143 and "stopped by SIGTERM" in err, err
    left = [p for p in root.rglob("*") if p.is_file()] if root.exists() else []
    assert [p.name for p in left] in ([], ["privacy_ledger.jsonl"]), left  # the run folder is gone
    if left:  # it took a private step before the signal: recorded, and said so
        [entry] = [json.loads(line) for line in left[0].read_text().splitlines()]
        assert entry["status"] == "interrupted" and entry["steps"] >= 1
        assert not Path(entry["run_folder"]).exists()
        assert f"dpl: interrupted after {entry['steps']} private step" in err, err


def test_generation_stops_at_the_next_token_after_sigterm():
    from dpl.tasks.modules import DPGenerationModule

    module = DPGenerationModule(model="unused")
    trainer = SimpleNamespace(received_sigterm=False)
    module._trainer = trainer
    criteria = module._stop_on_sigterm()
    ids = torch.zeros((3, 4), dtype=torch.long)
    assert not bool(criteria(ids, None).any())
    trainer.received_sigterm = True
    assert bool(criteria(ids, None).all())
