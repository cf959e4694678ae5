"""The first hour with dpl, without a workaround: README's own-data blocks as written on a 300-row folder, and the
chat config outside the checkout and on one's own conversation files."""

from __future__ import annotations

import json
import logging
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
    config's B = 1,024 alone would be refused); the smoke run keeps one checkpoint file, last.ckpt linking to it."""
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
        if "configs/smoke.yaml" in command:  # one checkpoint file: last.ckpt a link to it, one sidecar beside it
            last = Path(world["work"]) / re.search(r"checkpoint (\S+)$", out.strip().splitlines()[-1]).group(1)
            files = sorted(p.name for p in last.parent.iterdir() if not p.is_symlink())
            assert files == ["epoch=0-step=5.ckpt", "epoch=0-step=5.ckpt.secret"], files
            assert last.is_symlink() and last.resolve() == last.parent / files[0]


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
    assert "Training ran 1 private step (mechanism" in shipped["model_card"]  # one step, in the singular
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


def _progress_lines(caplog) -> list[str]:
    """The progress lines logged, their seconds (which depend on the machine) shown as T."""
    return [re.sub(r"\d+ s\b", "T s", r.getMessage()) for r in caplog.records if r.name == "dpl.tasks.data.progress"]


def test_tokenizing_a_split_in_log_mode_prints_progress_lines(tmp_path, monkeypatch, caplog):
    """Output to a file (datasets' bars off): a line every INTERVAL seconds (0 here: one a batch of 1,000 rows) with
    the rows done of the split's, and one when it is done."""
    import datasets
    from helpers import save_tiny_bert

    from dpl.tasks.data import ClassificationDataModule, progress

    monkeypatch.setattr(progress, "INTERVAL", 0.0)
    write_sentiment_tsv(tmp_path / "data" / "train.tsv", rows=2_500)
    write_sentiment_tsv(tmp_path / "data" / "validation.tsv", rows=8, seed=1)
    module = ClassificationDataModule(tokenizer=save_tiny_bert(tmp_path / "bert"), data_dir=str(tmp_path / "data"),
                                      cache_dir=str(tmp_path / "hf-cache"))
    was_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        with caplog.at_level(logging.INFO, logger="dpl"):
            module.setup("fit")
    finally:
        if was_on:
            datasets.enable_progress_bars()
    lines = [line for line in _progress_lines(caplog) if "train" in line]
    assert lines == ["dpl: tokenizing train: 1,000 of 2,500 rows (T s)", "dpl: tokenizing train: 2,000 of 2,500 rows "
                     "(T s)", "dpl: tokenizing train: 2,500 rows in T s"], lines
    assert len(module.train_set) == 2_500


def test_tokenizing_generation_data_prints_progress_lines_and_the_same_tokens(tmp_path, monkeypatch, caplog):
    """The generation modules tokenize in chunks of CHUNK rows (2 here), a progress line between them; the tokens are
    those of one call on all rows."""
    from test_data_generation import build, make_tokenizer, write_jsonl

    from dpl.tasks.data import JSONLDataModule, progress

    rows = [{"prompt": f"name {word}", "completion": f"the {word} pub"} for word in ("aromi", "cotto", "wildwood",
                                                                                  "alimentum", "riverside")]
    write_jsonl(tmp_path / "train.jsonl", rows)
    write_jsonl(tmp_path / "validation.jsonl", rows[:2])
    tok = make_tokenizer()
    whole = build(JSONLDataModule, tok, data_dir=str(tmp_path))
    whole.setup("fit")
    monkeypatch.setattr(progress, "INTERVAL", 0.0)
    monkeypatch.setattr(progress, "CHUNK", 2)
    chunked = build(JSONLDataModule, tok, data_dir=str(tmp_path))
    with caplog.at_level(logging.INFO, logger="dpl"):
        chunked.setup("fit")
    assert chunked.train_set == whole.train_set
    lines = [line for line in _progress_lines(caplog) if "train" in line]
    assert lines[:3] == ["dpl: tokenizing train prompts: 2 of 5 rows (T s)", "dpl: tokenizing train prompts: 4 of 5 "
                         "rows (T s)", "dpl: tokenizing train prompts: 5 rows in T s"], lines
    assert "dpl: tokenizing train completions: 4 of 5 rows (T s)" in lines


@pytest.mark.parametrize("command", ["export", "predict"])
def test_a_truncated_checkpoint_outside_its_run_folder_is_said_to_be_truncated(tmp_path, capsys, command):
    """A checkpoint copied out of its run folder and cut short: the one line says it is truncated, not that its run's
    config.yaml is missing."""
    path = tmp_path / "copied.ckpt"
    path.write_bytes(b"PK\x03\x04 truncated")
    args = [command, str(path), str(tmp_path / ("out" if command == "export" else "in.txt"))]
    (tmp_path / "in.txt").write_text("a sentence\n")
    code, _, err = _run(args, capsys)
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1 and "corrupt or truncated" in lines[0] and "config.yaml" not in lines[0], err


def test_last_ckpt_is_a_link_only_where_the_newest_checkpoint_is_the_last():
    """Without a monitor the newest checkpoint kept is the newest state: last.ckpt links to it. With a monitor (the
    best kept, not the newest), with no checkpoint kept, or in a remote folder, last.ckpt is a file of its own."""
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import ModelCheckpoint

    from dpl.cli_lightning import _last_checkpoint_kind

    local, remote = SimpleNamespace(default_root_dir="runs"), SimpleNamespace(default_root_dir="s3://bucket/runs")
    assert _last_checkpoint_kind(ModelCheckpoint(), local) == "link"
    assert _last_checkpoint_kind(ModelCheckpoint(monitor="val_acc", mode="max"), local) is True
    assert _last_checkpoint_kind(ModelCheckpoint(save_top_k=0), local) is True
    assert _last_checkpoint_kind(ModelCheckpoint(), remote) is True
