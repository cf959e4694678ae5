"""The first hour with dpl, without a workaround: README's own-data blocks as written on a 300-row folder, and the
chat config outside the checkout and on one's own conversation files."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from helpers import write_sentiment_tsv
from test_documented_commands import _run, prepare, world  # noqa: F401  (world: the module's fixture)

from dpl.cli import main

ROOT = Path(__file__).resolve().parents[1]


def own_data_commands() -> list[str]:
    """The `dpl fit` and `dpl plan` commands of README's "Your own data" section, in order."""
    from test_documented_commands import _split_commands

    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Your own data"):text.index("## Features")]
    commands = [c for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S) for c in _split_commands(block)]
    return [c for c in commands if c.split()[1] in ("fit", "plan")]


def test_readme_own_data_runs_as_written_on_300_rows(world, tmp_path, monkeypatch, capsys):  # noqa: F811
    """The smoke check comes first, and every fit and plan of the section runs on a folder of 300 rows (the SST-2
    config's B = 1,024 alone would be refused)."""
    commands = own_data_commands()
    assert [c.split()[1] for c in commands] == ["fit", "plan", "fit"] and "configs/smoke.yaml" in commands[0]
    folder = tmp_path / "mine"
    for split, rows in (("train", 300), ("validation", 40)):
        path = Path(write_sentiment_tsv(folder / f"{split}.tsv", rows=rows))
        lines = path.read_text().splitlines()
        path.write_text("\n".join(["text\tlabel", *lines[1:]]) + "\n")
    monkeypatch.chdir(world["work"])
    for command in commands:
        args, skip = prepare(command.replace("path/to/folder", str(folder)), world)
        assert skip is None, skip
        if "configs/smoke.yaml" in command:  # the smoke run as configured: 5 steps, validation and checkpoint at 5
            at = args.index("--trainer.max_steps")
            del args[at:at + 2]
        code, out, err = _run(args, capsys)
        assert code == 0, f"`{command}` exited {code}:\n{err[-2000:]}"


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory) -> str:
    from helpers import tiny_llama_lm
    from test_data_chat import make_chat_tokenizer

    folder = tmp_path_factory.mktemp("tiny-chat")
    tokenizer = make_chat_tokenizer()
    tokenizer.save_pretrained(folder)
    tiny_llama_lm(vocab_size=len(tokenizer), tie=False).save_pretrained(folder)
    return str(folder)


def fit_chat(config: Path, model: str, root: Path, *extra: str) -> dict:
    main(["fit", "--config", str(config), "--model.init_args.model", model, "--data.init_args.tokenizer", model,
          "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0", "--trainer.default_root_dir", str(root),
          *extra])
    run = sorted(root.glob("lightning_logs/version_*"))[-1]
    return json.loads((run / "privacy.json").read_text())


def test_chat_config_finds_its_files_outside_the_checkout_and_takes_ones_own(tiny_chat, tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # not the checkout: the config's files are found beside it
    shipped = fit_chat(ROOT / "configs" / "chat" / "dpsgd.yaml", tiny_chat, tmp_path / "runs-a")
    assert shipped["num_examples"] == 32
    assert [f["path"] for f in shipped["training_data"]["files"] if f["split"] == "train"] == ["train.jsonl"]

    own = tmp_path / "mine"
    own.mkdir()
    lines = (ROOT / "configs" / "chat" / "train.jsonl").read_text().splitlines()
    (own / "train.jsonl").write_text("\n".join(lines[:20]) + "\n")
    shutil.copy(ROOT / "configs" / "chat" / "validation.jsonl", own / "validation.jsonl")
    mine = fit_chat(ROOT / "configs" / "chat" / "dpsgd.yaml", tiny_chat, tmp_path / "runs-b", "--data.data_dir",
                    str(own))
    assert mine["num_examples"] == 20 and mine["training_data"]["id"] != shipped["training_data"]["id"]


def test_mlflow_file_store_needs_no_environment_switch(tmp_path, monkeypatch, capsys):
    """configs/trackers/mlflow.yaml as shipped, without MLFLOW_ALLOW_FILE_STORE in the environment: the run logs
    epsilon to the file store; the switch set to false is one line."""
    pytest.importorskip("mlflow")
    import test_trackers

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    data = tmp_path / "data"
    write_sentiment_tsv(data / "train.tsv", rows=64)
    write_sentiment_tsv(data / "validation.tsv", rows=8, seed=1)
    from helpers import save_tiny_bert

    tiny = {"model": save_tiny_bert(tmp_path / "bert"), "data": data}
    store = tmp_path / "mlruns"
    test_trackers._fit(tiny, tmp_path, "mlflow", f"file:{store}")
    assert "dpl: trained 3 private steps" in capsys.readouterr().out
    assert list(store.rglob("metrics/epsilon"))
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "false")
    with pytest.raises(SystemExit):
        test_trackers._fit(tiny, tmp_path / "again", "mlflow", f"file:{store}")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "MLFLOW_ALLOW_FILE_STORE=true" in err[0], err


def test_ctrl_c_names_the_last_checkpoint_and_its_step(tmp_path, capsys):
    """Interrupted at step 3 after a checkpoint at step 2: the final line says epsilon for the 3 steps and that the
    checkpoint holds step 2."""
    import lightning as L
    from helpers import InterruptAt, VectorDataModule, VectorModule
    from lightning.pytorch.callbacks import ModelCheckpoint

    from dpl import PrivacyConfig
    from dpl.lightning.report import PrivacyReport

    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_last=True)
    trainer = L.Trainer(max_steps=6, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, default_root_dir=str(tmp_path),
                        callbacks=[checkpoints, PrivacyReport(), InterruptAt(3)])
    module = VectorModule(privacy=PrivacyConfig(target_epsilon=8.0, batch_size=16, physical_batch_size=16))
    try:
        trainer.fit(module, datamodule=VectorDataModule())
    except (KeyboardInterrupt, SystemExit):
        pass
    line = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("dpl: interrupted")]
    assert len(line) == 1 and "interrupted after 3 private steps" in line[0], line
    assert line[0].endswith(f"; its last checkpoint, {tmp_path / 'ckpt' / 'last.ckpt'}, holds step 2 (--ckpt_path "
                            "resumes from it)"), line[0]


def test_a_chat_export_shows_loading_with_the_conversation():
    """The export's README of a conversation run: the turns through the chat template, not a prompt template."""
    from types import SimpleNamespace

    from dpl.trained.export import inputs_as_trained

    module = SimpleNamespace(task="generation", export_meta=lambda: {"generation": {"max_new_tokens": 32}})
    run = SimpleNamespace(module=module, data={"format": "messages", "max_length": 256, "chat_template": "auto"},
                          tokenizer=None)
    text = inputs_as_trained(run)
    assert text.startswith("# as trained: conversations") and "prompt_template" not in text
    assert "tokenizer.apply_chat_template(messages, add_generation_prompt=True" in text
    assert "ids[:, -255:]" in text and "max_new_tokens=32" in text
    compile(text, "card", "exec")  # the lines are Python
