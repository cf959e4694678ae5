"""Every config (configs/, plugins/<name>/*.yaml) and every documented `dpl` command runs: README.md, docs/**/*.md and
the plugins' pages plugins/<name>/README.md (fenced bash blocks) and the commands in the configs' header comments, each
for two steps on a tiny model and tiny data.

Commands run as written, in a scratch folder that mirrors the repository layout (`configs/`, `plugins/` linked, tiny
data at `../shared/data/...`); only these arguments are appended: a tiny model and tokenizer, `--trainer.max_steps 2`
and small evaluation limits (generation: 4 new tokens); `dpl tune` runs at most one trial. Placeholder folders
(`path/to/folder`, `path/to/dart`, ...) are replaced by tiny data of the format the command's data module reads (after
`--data.dataset`: the same rows saved as a `DatasetDict` folder). A
fragment config (no model/data class) runs composed as its header comment says, else with configs/quickstart.yaml.
GPU-only configs are skipped on CPU.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers import CHATML, save_tiny_bert, save_tiny_llama_lm, write_sentiment_tsv

from dpl.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "plugins").glob("*/README.md"))]
CONFIGS = sorted([*(ROOT / "configs").rglob("*.yaml"), *(ROOT / "plugins").rglob("*.yaml")])
STEPS = "2"


# ------------------------------------------------------------------------------------------- discovery


def _split_commands(text: str) -> list[str]:
    """`dpl ...` commands in a shell snippet (continuation lines joined, `&&` / `;` chains split)."""
    text = text.replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        for part in re.split(r"&&|;", line):
            part = part.strip()
            if part.startswith("dpl "):
                commands.append(" ".join(shlex.split(part, comments=True)))
    return commands


def doc_commands() -> list[tuple[str, str]]:
    found = []
    for path in DOCS:
        for block in re.findall(r"```(?:bash|sh|shell|console)\n(.*?)```", path.read_text(), flags=re.S):
            found += [(str(path.relative_to(ROOT)), c) for c in _split_commands(block)]
    for path in CONFIGS:
        header = "\n".join(line.lstrip("#").strip() for line in path.read_text().splitlines()
                           if line.startswith("#"))
        found += [(str(path.relative_to(ROOT)), c) for c in _split_commands(header)]
    return found


def _is_fragment(config: dict) -> bool:
    return not (isinstance(config.get("model"), dict) and "class_path" in config["model"])


def config_commands(documented: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """A command for each config not already run by a documented command."""
    covered = set()
    for _, command in documented:
        args = shlex.split(command)
        covered |= {args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--config", "-c")}
    found = []
    for path in CONFIGS:
        rel = str(path.relative_to(ROOT))
        if rel in covered:
            continue
        config = yaml.safe_load(path.read_text()) or {}
        if rel.startswith("configs/audit/"):
            found.append((rel, f"dpl audit --config {rel}"))
        elif _is_fragment(config):
            found.append((rel, f"dpl fit --config configs/quickstart.yaml --config {rel}"))
        else:
            found.append((rel, f"dpl fit --config {rel}"))
    return found


def readme_sequence() -> list[str]:
    """README's newcomer sequence: the block that trains a smoke run on one's own data and uses that run after."""
    for block in re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S):
        commands = _split_commands(block)
        if "configs/smoke.yaml" in block and any(c.startswith("dpl predict") for c in commands):
            return commands
    return []


SEQUENCE = readme_sequence()
DOCUMENTED = [item for item in doc_commands() if item != ("README.md", item[1]) or item[1] not in SEQUENCE]
_FIRST: dict[str, tuple[str, str]] = {}
for _source, _command in DOCUMENTED + config_commands(DOCUMENTED):
    _FIRST.setdefault(_command, (_source, _command))  # each distinct command once, named by its first source
ALL = list(_FIRST.values())


# ------------------------------------------------------------------------------------------ tiny world


def _write_csv(path: Path, rows: list[list[str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        csv.writer(f, lineterminator="\n").writerows(rows)


def _e2e_rows(n_mrs: int, refs: int = 2, offset: int = 0) -> list[list[str]]:
    names = ["aromi", "alimentum", "cotto", "wildwood"]
    rows = [["mr", "ref"]]
    for i in range(offset, offset + n_mrs):
        name, food = names[i % 4], ["italian", "french"][i // 4 % 2]
        mr = f"name[{name}], food[{food}], area[{['city centre', 'riverside'][i // 8 % 2]}], table[{i}]"
        rows += [[mr, f"{name} serves {food} food in the {'city' if i % 2 else 'riverside'} ."] for _ in range(refs)]
    return rows


def _dart(n: int) -> list[dict]:
    return [{"tripleset": [["cafe", "food", "italian"], ["cafe", "area", ["city", "riverside"][i % 2]]],
             "subtree_was_extended": False,
             "annotations": [{"source": "e2e", "text": f"the cafe serves italian food {i} ."}]} for i in range(n)]


def _jsonl(path: Path, n: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"prompt": f"name : {['aromi', 'cotto'][i % 2]} , food : italian",
                         "completion": " the restaurant serves italian food ."}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n")


def _classification_dir(folder: Path, text: str = "sentence", label: str = "label", rows: int = 1100) -> Path:
    for split, n, seed in (("train", rows, 0), ("validation", 40, 1)):
        path = write_sentiment_tsv(folder / f"{split}.tsv", rows=n, seed=seed)
        lines = Path(path).read_text().splitlines()
        Path(path).write_text("\n".join([f"{text}\t{label}", *lines[1:]]) + "\n")
    return folder


def _saved_dataset(kind: str, world: dict, text: str, label: str) -> str:
    """The tiny data of ``kind`` as a ``DatasetDict`` folder written by ``save_to_disk`` (for ``--data.dataset``)."""
    import datasets

    folder = world["tmp"] / "saved" / f"{kind}_{text}_{label}"
    if not folder.exists():
        if kind == "classification":
            source = _classification_dir(world["tmp"] / "data" / f"cls_{text}_{label}", text, label)
            splits = {s: datasets.Dataset.from_csv(str(source / f"{s}.tsv"), sep="\t", keep_in_memory=True)
                      for s in ("train", "validation")}
        else:
            source = world[kind.lower()]
            splits = {s: datasets.Dataset.from_list([json.loads(line) for line in
                                                     (source / f"{s}.jsonl").read_text().splitlines() if line])
                      for s in ("train", "validation")}
        datasets.DatasetDict(splits).save_to_disk(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A scratch checkout: work/ (cwd; configs/ and plugins/ linked), shared/data/{sst2,e2e} and tiny models."""
    tmp = tmp_path_factory.mktemp("documented")
    work = tmp / "work"
    work.mkdir()
    (work / "configs").symlink_to(ROOT / "configs")
    (work / "plugins").symlink_to(ROOT / "plugins")
    models = {"bert": save_tiny_bert(tmp / "models" / "bert"),
              "llama": save_tiny_llama_lm(tmp / "models" / "llama", tie=True),
              "llama_chat": save_tiny_llama_lm(tmp / "models" / "llama_chat", tie=True, chat_template=CHATML)}
    _classification_dir(tmp / "shared" / "data" / "sst2")
    _write_csv(tmp / "shared" / "data" / "e2e" / "devset.csv", _e2e_rows(60))
    e2e = tmp / "data" / "e2e"
    _write_csv(e2e / "trainset.csv", _e2e_rows(40))
    _write_csv(e2e / "devset.csv", _e2e_rows(4, offset=40))
    _write_csv(e2e / "testset_w_refs.csv", _e2e_rows(4, offset=44))
    dart = tmp / "data" / "dart"
    dart.mkdir(parents=True)
    for split, n in (("train", 80), ("dev", 4), ("test", 4)):
        (dart / f"dart-v1.1.1-full-{split}.json").write_text(json.dumps(_dart(n)))
    _jsonl(tmp / "data" / "jsonl" / "train.jsonl", 80)
    _jsonl(tmp / "data" / "jsonl" / "validation.jsonl", 6)
    chat = tmp / "data" / "chat"  # conversations: the shipped example's
    chat.mkdir(parents=True)
    for name in ("train.jsonl", "validation.jsonl"):
        (chat / name).write_text((ROOT / "configs" / "chat" / name).read_text())
    return {"tmp": tmp, "work": work, "models": models, "e2e": e2e, "dart": dart, "jsonl": tmp / "data" / "jsonl",
            "chat": chat}


# ------------------------------------------------------------------------------------------- running


def _configs_of(args: list[str]) -> list[Path]:
    return [Path(args[i + 1]) for i, a in enumerate(args[:-1]) if a in ("--config", "-c")]


def _merged(paths: list[Path], work: Path) -> dict:
    merged: dict = {}
    for path in paths:
        _merge(merged, yaml.safe_load((work / path).read_text()) or {})
    return merged


def _merge(into: dict, new: dict) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _class_of(args: list[str], merged: dict, group: str) -> str:
    for i, a in enumerate(args[:-1]):
        if a == f"--{group}" and not args[i + 1].endswith((".yaml", ".yml")):
            return args[i + 1]
    return str((merged.get(group) or {}).get("class_path", ""))


def _gpu_only(merged: dict) -> str | None:
    trainer = merged.get("trainer") or {}
    if str(trainer.get("accelerator", "")).lower() in ("gpu", "cuda"):
        return f"needs a GPU (accelerator={trainer.get('accelerator')}, strategy={trainer.get('strategy')})"
    return None


def _option(args: list[str], name: str) -> str | None:
    for i, a in enumerate(args[:-1]):
        if a == name:
            return args[i + 1]
    return None


def _tracker_missing(merged: dict) -> str | None:
    """Why a config's tracker cannot run here (its package is not installed: ``pip install -e ".[trackers]"``)."""
    import importlib.util

    logger = str((merged.get("trainer") or {}).get("logger", ""))
    for name, package in (("MLFlowLogger", "mlflow"), ("WandbLogger", "wandb")):
        if name in logger and importlib.util.find_spec(package) is None:
            return f"needs {package} (pip install -e '.[trackers]')"
    return None


def prepare(command: str, world: dict) -> tuple[list[str], str | None]:
    """The argument list to run (placeholders replaced, tiny overrides appended), or a reason to skip."""
    args = shlex.split(command)[1:]
    work = world["work"]
    configs = _configs_of(args)
    missing = [str(c) for c in configs if not (work / c).exists()]
    if missing:
        return [], f"__missing__ {missing}"
    if args[0] in ("plugins",):
        return args, None
    if args[0] == "verify-data":  # a run of the config whose runs the folder holds, on the config's own data
        _train_config_of(args[2], world)
    if args[0] in ("predict", "export", "report", "verify-data"):  # after training: a run (trained first if need be)
        return [_after_training_path(a, world) for a in args], None
    if args[0] == "ledger":  # the quickstart's runs are recorded first (trained if need be); the command runs as written
        _run_file("runs/quickstart/.../privacy_ledger.jsonl", world)
        return args, None
    if args[0] == "audit":
        return args + ["--steps", "3", "--canaries", "20", "--examples", "20", "--batch_size", "4"], None
    if args[0] in ("synthesize", "evaluate-synthetic"):
        return _synthetic_args(args, world), None
    merged = _merged(configs, work)
    gpu = _gpu_only(merged)
    if gpu and not torch.cuda.is_available():
        return [], gpu
    tracker = _tracker_missing(merged)
    if tracker:
        return [], tracker
    nodes = _option(args, "--trainer.num_nodes") or str((merged.get("trainer") or {}).get("num_nodes", 1))
    if nodes.isdigit() and int(nodes) > 1:
        return [], f"needs {nodes} machines (trainer.num_nodes {nodes})"
    devices = _option(args, "--trainer.devices")
    if devices and devices.isdigit() and int(devices) > 2 and torch.cuda.device_count() < int(devices):
        args[args.index("--trainer.devices") + 1] = "2"  # as many CPU processes as this machine can host
    model_class, data_class = _class_of(args, merged, "model"), _class_of(args, merged, "data")
    generation = any(k in data_class for k in ("E2E", "DART", "JSONL", "Generation", "Synthetic"))
    kind = next((k for k in ("E2E", "DART", "JSONL") if k in data_class), "classification")
    init = (merged.get("data") or {}).get("init_args") or {}
    if kind == "classification" and "Synthetic" in data_class:  # records to generate: a table, or conversations
        kind = "CHAT" if init.get("format") == "messages" else kind
    if kind == "JSONL" and (_option(args, "--data.format") or init.get("format")) == "messages":
        kind = "CHAT"  # conversations: tiny conversation data, a tiny model whose tokenizer has a chat template
    for i, a in enumerate(args):
        if a.startswith("path/to/") and i > 0 and args[i - 1] == "--data.dataset":
            args[i] = _saved_dataset(kind, world, _option(args, "--data.text_column") or "sentence",
                                     _option(args, "--data.label_column") or "label")
        elif a.startswith("path/to/"):
            if kind == "classification":
                text = _option(args, "--data.text_column") or "sentence"
                label = _option(args, "--data.label_column") or "label"
                args[i] = str(_classification_dir(world["tmp"] / "data" / f"cls_{text}_{label}", text, label))
            else:
                args[i] = str(world[kind.lower()])
        elif "/.../" in a:
            args[i] = _run_file(a, world)
    shared = _option(args, "--data.data_dir") or str(init.get("data_dir") or "")
    if kind == "classification" and shared.startswith("../shared/data/") and not (work / shared).exists():
        text = _option(args, "--data.text_column") or init.get("text_column") or "sentence"
        label = _option(args, "--data.label_column") or init.get("label_column") or "label"
        _classification_dir((work / shared).resolve(), text, label)  # a tiny stand-in for the real data set
    if kind in ("DART", "JSONL") and _option(args, "--data.data_dir") is None \
            and not (merged.get("data", {}).get("init_args") or {}).get("data_dir"):
        args += ["--data.init_args.data_dir", str(world[kind.lower()])]
    model = world["models"]["llama_chat" if kind == "CHAT" else "llama" if generation else "bert"]
    if args[0] in ("fit", "tune") and "--print_config" not in args:  # max_time: a loop that ignores max_steps ends
        args += ["--trainer.max_steps", STEPS, "--trainer.max_time", "00:00:02:00"]
    if "--print_config" not in args:
        args += ["--model.init_args.model", model, "--data.init_args.tokenizer", model,
                 "--trainer.limit_val_batches", "2", "--trainer.limit_test_batches", "2"]
        if generation or "Generation" in model_class:
            args += ["--model.init_args.generation.max_new_tokens", "4"]
    return args, None


def _synthetic_args(args: list[str], world: dict) -> list[str]:
    """``dpl synthesize``: its run trained first if need be, a few records of 4 tokens; ``dpl evaluate-synthetic``:
    its synthetic folder sampled first if need be (by the documented command that writes it), the tiny encoder."""
    work = world["work"]
    if args[0] == "synthesize":
        if not (work / args[1]).exists():
            _train_config_of(args[1], world)
        args = list(args)
        args[args.index("--rows") + 1] = "6"
        return args + ["--max_new_tokens", "4", "--overwrite"]
    if not (work / args[1]).exists():
        writer = next(c for _, c in ALL if c.startswith("dpl synthesize ") and f"--out {args[1]}" in c)
        cwd = Path.cwd()
        try:
            os.chdir(work)
            main(_synthetic_args(shlex.split(writer)[1:], world))
        finally:
            os.chdir(cwd)
    return args + ["--encoder", world["models"]["bert"], "--overwrite"]


def _train_config_of(root: str, world: dict) -> None:
    """Train the config whose ``default_root_dir`` is ``root``, as written (the tiny overrides appended)."""
    config = next(c for c in CONFIGS if ((yaml.safe_load(c.read_text()) or {}).get("trainer") or {})
                  .get("default_root_dir") == root.rstrip("/"))
    fit, _ = prepare(f"dpl fit --config {config.relative_to(ROOT)}", world)
    cwd = Path.cwd()
    try:
        os.chdir(world["work"])
        main(fit)
    finally:
        os.chdir(cwd)


def _run_file(pattern: str, world: dict) -> str:
    """``runs/<name>/.../<file>``: the newest such file of the runs before (if none, the config whose
    ``default_root_dir`` is ``runs/<name>`` is trained first)."""
    work = world["work"]
    head, tail = pattern.split("/.../")
    found = sorted((work / head).glob(f"**/{tail}"))
    config = next((c for c in CONFIGS if ((yaml.safe_load(c.read_text()) or {}).get("trainer") or {})
                   .get("default_root_dir") == head.rstrip("/")), None)
    if not found and config is not None:  # run alone: train the run's config first
        fit, _ = prepare(f"dpl fit --config {config.relative_to(ROOT)}", world)
        cwd = Path.cwd()
        try:
            os.chdir(work)
            main(fit)
        finally:
            os.chdir(cwd)
        found = sorted((work / head).glob(f"**/{tail}"))
    assert found, f"{pattern}: no such file after the runs before it"
    return str(found[-1])


def _after_training_path(arg: str, world: dict) -> str:
    """An argument of dpl predict/export/report: a run's file, or an input file of a few sentences."""
    if "/.../" in arg:
        return _run_file(arg, world)
    if arg.startswith("path/to/"):
        path = world["tmp"] / "inputs" / Path(arg).name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("the movie was very good\nthe plot was awful\n")
        return str(path)
    return arg


def _multi_process(args: list[str], world: dict) -> bool:
    if args[0] not in ("fit", "validate", "test"):
        return False
    merged = _merged(_configs_of(args), world["work"])
    strategy = str(_option(args, "--trainer.strategy") or (merged.get("trainer") or {}).get("strategy", ""))
    devices = str(_option(args, "--trainer.devices") or (merged.get("trainer") or {}).get("devices", "1"))
    return "ddp" in strategy.lower() or (devices.isdigit() and int(devices) > 1)


def _id(item: tuple[str, str]) -> str:
    source, command = item
    return f"{source}: {command}"[:150]


@pytest.mark.parametrize("source,command", ALL, ids=[_id(c) for c in ALL])
def test_documented_command_runs(source, command, world, monkeypatch, capsys):
    args, skip = prepare(command, world)
    if skip and skip.startswith("__missing__"):
        if "gradnorm.yaml" in skip:  # docs/writing-plugins.md: the example plugin's own config
            pytest.skip("the example plugin package of docs/writing-plugins.md is not installed")
        pytest.fail(f"{source}: `{command}` names a config that does not exist: {skip[12:]}")
    if skip:
        pytest.skip(skip)
    monkeypatch.chdir(world["work"])
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # docs/configuration.md#trackers exports it for MLflow
    if args[0] == "tune":  # K is drawn as documented, then capped at one trial to keep the test short
        from dpl.core.accounting.tuning import TrialDistribution

        draw = TrialDistribution.sample
        monkeypatch.setattr(TrialDistribution, "sample", lambda self, *a, **k: min(draw(self, *a, **k), 1))
    code = 0
    if _multi_process(args, world):  # DDP re-launches the command line: run it as a user would, in a process
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        result = subprocess.run([sys.executable, "-m", "dpl.cli", *args], capture_output=True, text=True,
                                cwd=world["work"], env=env, timeout=600)
        code, out, err = result.returncode, result.stdout, result.stderr
    else:
        try:
            main(args)
        except SystemExit as exc:
            code = exc.code or 0
        out, err = capsys.readouterr()
        if "wandb" in sys.modules and sys.modules["wandb"].run is not None:
            sys.modules["wandb"].finish()  # an offline W&B run ends with its command
    assert code == 0 or (args[0] == "audit" and code == 1), f"`{command}` exited {code}:\n{err[-3000:]}"
    if args[0] == "fit" and "--print_config" not in args:
        lines = [line for line in out.splitlines() if line.strip()]
        assert lines and lines[-1].startswith("dpl: trained "), f"no final summary line:\n{out[-2000:]}"
        assert lines[-1].startswith(f"dpl: trained {STEPS} private steps"), lines[-1]  # max_steps was honoured
        assert "\x1b[" not in out and "\r" not in out, "terminal control codes in redirected output"
    if args[0] == "validate":
        assert "val_" in out
    if args[0] == "plan":
        assert "sigma = " in out and "recommended" in out, out[-2000:]
    if args[0] == "verify-data":
        last = out.strip().splitlines()[-1]  # after the fit that made the run, when it ran first
        assert last.startswith("dpl verify-data: ") and " matches " in last and "train file" in last, out[-2000:]
    if args[0] == "ledger":
        assert "dpl ledger: " in out and ("composed over" in out or "no run recorded" in out), out
    if args[0] == "tune":
        assert "dpl: tuned model: epsilon=" in out or "nothing is released" in out, out[-2000:]


def _run(args: list[str], capsys) -> tuple[int, str, str]:
    code = 0
    try:
        main(args)
    except SystemExit as exc:
        code = exc.code or 0
    out, err = capsys.readouterr()
    return code, out, err


def _assert_no_local_path(files: list[Path], folders: list[Path]) -> None:
    """No file names a local folder (the scratch folders, home, the Python environment, the checkout)."""
    for path in files:
        text = path.read_text()
        for folder in folders:
            for form in {str(folder), str(folder.resolve())}:
                assert form not in text, f"{path.name} names the local folder {form}"


def test_readme_sequence_runs_on_one_run(world, tmp_path, monkeypatch, capsys):
    """README's own-data sequence in order: the smoke fit, then predict, export, ledger and tune on the run whose
    folder and checkpoint the fit's last line names."""
    assert [c.split()[1] for c in SEQUENCE] == ["fit", "predict", "export", "ledger", "tune"]
    work = tmp_path / "work"
    work.mkdir()
    for name in ("configs", "plugins"):
        (work / name).symlink_to(ROOT / name)
    world = {**world, "work": work}
    monkeypatch.chdir(work)
    from dpl.core.accounting.tuning import TrialDistribution

    draw = TrialDistribution.sample
    monkeypatch.setattr(TrialDistribution, "sample", lambda self, *a, **k: min(draw(self, *a, **k), 1))
    checkpoint = None
    for command in SEQUENCE:
        if checkpoint is not None:
            command = command.replace("runs/smoke/.../last.ckpt", checkpoint)
        args, skip = prepare(command, world)
        assert skip is None, skip
        code, out, err = _run(args, capsys)
        assert code == 0, f"`{command}` exited {code}:\n{err[-3000:]}"
        if args[0] == "fit":
            last = [line for line in out.splitlines() if line.strip()][-1]
            found = re.search(r"; run folder (\S+), checkpoint (\S+)$", last)
            assert found, last
            assert (work / found.group(1)).is_dir() and found.group(2).startswith(found.group(1))
            checkpoint = found.group(2)
            assert checkpoint.startswith("runs/smoke/") and (work / checkpoint).is_file()
        if args[0] == "predict":
            assert len([line for line in out.splitlines() if line.startswith("{")]) == 2, out
        if args[0] == "export":
            assert (work / "exported" / "smoke" / "privacy.json").is_file()
            run = work / checkpoint.split("/checkpoints/")[0]
            published = [run / "privacy.json", run / "privacy.md", *(work / "exported" / "smoke").glob("*.md"),
                         *(work / "exported" / "smoke").glob("*.json")]
            _assert_no_local_path(published, [world["tmp"], tmp_path, Path.home(), Path(sys.prefix), ROOT])
        if args[0] == "ledger":
            assert "composed over" in out, out
        if args[0] == "tune":
            assert "dpl: tuned model: epsilon=" in out or "nothing is released" in out, out[-2000:]


def test_every_config_is_covered():
    run = {c for _, command in ALL for c in _configs_of(shlex.split(command))}
    assert {str(p.relative_to(ROOT)) for p in CONFIGS} <= {str(c) for c in run}


def test_readme_quickstart_is_among_the_commands():
    assert ("README.md", "dpl fit --config configs/quickstart.yaml") in DOCUMENTED
    assert any("last.ckpt" in c for _, c in DOCUMENTED)  # the resume example of docs/configuration.md


if __name__ == "__main__":  # list what runs
    for item in ALL:
        print(_id(item), file=sys.stdout)
