"""``dpl export <run or checkpoint> <folder>``: a Hugging Face model folder from a run.

The folder loads with the task's ``AutoModelFor...`` class (``from_pretrained(folder)``; LoRA merged into the
weights; a base read from a GGUF file saved dequantized, as an ordinary float32 model), or, with ``--adapter``, is a
PEFT adapter folder (``AutoPeftModelFor...``) whose ``adapter_config.json`` names a base that loads as is: the
configured base model, or the base as trained saved beside it in ``base/`` (a classifier's new head and labels; a
GGUF base). Beside the weights: the tokenizer, the label mapping (``config.json``'s ``id2label``),
``privacy.json`` / ``privacy.md`` of the exported checkpoint, a ``README.md`` (how to load it, and the privacy
guarantee), and ``dpl.json`` (what ``dpl predict`` needs: the task, label names, data settings). A classifier with
dpl's mean-pooling head (``pooling: mean``) is saved with its few lines of modeling code (``modeling_dpl.py``):
load it with ``trust_remote_code=True``. What a task and fine-tuning mode cannot export is refused in one line before
anything is written; an export that fails leaves nothing behind (it is written into a hidden folder beside the
target and renamed at the end).

Nothing secret is exported: the checkpoint's ``.secret`` sidecar is never read, and only weights, tokenizer files
and public settings are written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from dpl.errors import ConfigError, DPLError
from dpl.folders import check_writable
from dpl.trained.runs import EXPORT_META, LoadedRun, load_run

DATA_KEYS = ("max_length", "text_column", "text_pair_column", "prompt_template", "template", "chat_template")


def export_run(run: LoadedRun, folder: str | Path, adapter: bool = False) -> Path:
    """Write ``run``'s model to ``folder`` (see the module docstring); return the folder."""
    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ConfigError(f"{folder} exists and is not empty: export into a new folder")
    check_writable(folder, "export folder")
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".partial", dir=folder.parent))
    try:
        _write(run, partial, adapter, folder.name)
        if folder.exists():
            folder.rmdir()
        partial.replace(folder)
        from dpl.tasks.exporting import relocate_base

        relocate_base(folder)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return folder


def _write(run: LoadedRun, folder: Path, adapter: bool, name: str) -> None:
    module = run.module
    module.export_model(folder, adapter)
    run.tokenizer.save_pretrained(folder)
    meta = {"task": module.task, **module.export_meta(), "adapter": adapter,
            "data": {k: run.data[k] for k in DATA_KEYS if run.data.get(k) is not None},
            "source": run.source.name if run.source is not None else None}
    (folder / EXPORT_META).write_text(json.dumps(meta, indent=2) + "\n")
    from dpl.lightning.report import write_report

    report = _report_of(run)
    if report is not None:
        write_report(report, folder)
    (folder / "README.md").write_text(model_card(run, folder, adapter, report, name))
    _shareable(folder)


def _shareable(folder: Path) -> None:
    """The modes of ordinary files (0644 and 0755 under the umask): the export is meant to be shared, and
    ``mkdtemp`` and safetensors make their folder and files private."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o755 & ~umask)
    for path in folder.rglob("*"):
        path.chmod((0o755 if path.is_dir() else 0o644) & ~umask)


def model_card(run: LoadedRun, folder: Path, adapter: bool, report: dict[str, Any] | None, name: str) -> str:
    """The export's README.md: what it is, how to load it, its privacy guarantee."""
    module = run.module
    auto = module.auto_class
    remote = ", trust_remote_code=True" if (folder / "modeling_dpl.py").is_file() else ""
    if adapter:
        base = "f\"{folder}/base\"" if (folder / "base").is_dir() else repr(
            json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"])
        load = (f"from peft import PeftModel\nfrom transformers import {auto}\n\nfolder = \"path/to/this/folder\"\n"
                f"model = PeftModel.from_pretrained({auto}.from_pretrained({base}), folder)")
    else:
        load = f"from transformers import {auto}\n\nmodel = {auto}.from_pretrained(\"path/to/this/folder\"{remote})"
    privacy = report["model_card"] if report is not None else "The checkpoint held no privacy report."
    return "\n".join([
        f"# {name}",
        "", f"A {module.task} model fine-tuned by dpl from `{module.model_location}`"
        f" ({'a PEFT adapter' if adapter else 'merged weights'}).", "", "## Loading", "", "```python", load, "```",
        "", "Or with dpl: `dpl predict path/to/this/folder inputs.jsonl`.", "", "## Privacy", "", privacy,
        "", "Details: privacy.md and privacy.json in this folder.", ""])


def _report_of(run: LoadedRun) -> dict[str, Any] | None:
    """The checkpoint's privacy report; the run folder's instead where it is the same run at the same step (it then
    also says how the run ended)."""
    from dpl.lightning.report import REPORT_JSON, REPORT_KEY

    report = (run.checkpoint or {}).get(REPORT_KEY)
    if report is None or run.source is None or not (report.get("run") or {}).get("id"):
        return report
    try:
        final = json.loads((Path(run.source).parent.parent / REPORT_JSON).read_text())
    except (OSError, ValueError):
        return report
    same = ((final.get("run") or {}).get("id") == report["run"]["id"]
            and final.get("steps_taken") == report.get("steps_taken"))
    return final if same else report


def export_command(argv: list[str]) -> int:
    """``dpl export RUN FOLDER [--adapter]``."""
    parser = argparse.ArgumentParser(prog="dpl export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a run folder (lightning_logs/version_N), or a .ckpt file")
    parser.add_argument("folder", help="the folder to write (new or empty)")
    parser.add_argument("--adapter", action="store_true", help="a PEFT adapter folder instead of merged weights")
    args = parser.parse_args(argv)
    try:
        check_writable(args.folder, "export folder")
        run = load_run(args.run)
        if run.checkpoint is None:
            raise ConfigError(f"{args.run} is an exported folder already")
        folder = export_run(run, args.folder, adapter=args.adapter)
    except DPLError as exc:
        print(f"dpl: error: {exc}", file=sys.stderr)
        return 2
    print(f"dpl: exported {run.source} to {folder}" + ("" if (folder / "privacy.json").is_file()
                                                      else " (no privacy report in the checkpoint)"))
    return 0
