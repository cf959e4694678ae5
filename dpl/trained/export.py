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

DATA_KEYS = ("max_length", "text_column", "text_pair_column", "prompt_template", "template", "chat_template",
             "format", "messages_field")


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
        if os.path.isabs(str(report.get("resumed_from") or "")):  # an older dpl's absolute checkpoint path
            report = {**report, "resumed_from": Path(report["resumed_from"]).name}
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
    from dpl.lightning.provenance import public_location

    module = run.module
    auto = module.auto_class
    remote = ", trust_remote_code=True" if (folder / "modeling_dpl.py").is_file() else ""
    origin = public_location(str(module.model_location))
    if adapter:
        if (folder / "base").is_dir():
            base = "f\"{folder}/base\""
        else:
            stated = json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
            base = repr(stated if public_location(stated) == stated else f"path/to/{origin}")
        load = (f"from peft import PeftModel\nfrom transformers import AutoTokenizer, {auto}\n\n"
                f"folder = \"path/to/this/folder\"\n"
                f"model = PeftModel.from_pretrained({auto}.from_pretrained({base}), folder)\n"
                f"tokenizer = AutoTokenizer.from_pretrained(folder)")
    else:
        load = (f"from transformers import AutoTokenizer, {auto}\n\nfolder = \"path/to/this/folder\"\n"
                f"model = {auto}.from_pretrained(folder{remote})\ntokenizer = AutoTokenizer.from_pretrained(folder)")
    load += "\n" + inputs_as_trained(run)
    privacy = report["model_card"] if report is not None else "The checkpoint held no privacy report."
    return "\n".join([
        f"# {name}",
        "", f"A {module.task} model fine-tuned by dpl from `{origin}`"
        f" ({'a PEFT adapter' if adapter else 'merged weights'}).", "", "## Loading", "", "```python", load, "```",
        "", "Or with dpl: `dpl predict path/to/this/folder inputs.jsonl`.", *module.card_usage(run.data, run.tokenizer),
        "", "## Privacy", "", privacy,
        "", "Details: privacy.md and privacy.json in this folder.", ""])


def inputs_as_trained(run: LoadedRun) -> str:
    """Python lines that turn an input into the model's input ids exactly as training did: the prompt template, the
    chat template (or none) and ``max_length`` of the run (generation), or the text columns and truncation
    (classification)."""
    data, module = run.data, run.module
    max_length = data.get("max_length")
    if module.task == "generation" and data.get("format") == "messages":  # conversations: the turns so far
        new_tokens = (module.export_meta().get("generation") or {}).get("max_new_tokens")
        lines = [f"# as trained: conversations rendered with the tokenizer's chat template, data.max_length {max_length}",
                 "messages = [{\"role\": \"user\", \"content\": \"...\"}]  # the conversation so far (system, user, "
                 "assistant turns)",
                 "ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors=\"pt\", "
                 "return_dict=True).input_ids"]
        if max_length:
            lines += [f"ids = ids[:, -{int(max_length) - 1}:]  # evaluation kept a conversation's last max_length - 1 "
                      "tokens"]
        lines += [f"output = model.generate(ids, max_new_tokens={new_tokens or 64})",
                  "print(tokenizer.decode(output[0, ids.shape[1]:], skip_special_tokens=True))"]
        return "\n".join(lines)
    if module.task == "generation":
        from dpl.tasks.data.templates import uses_chat_template

        template = data.get("prompt_template") or "{prompt}"
        mode = data.get("chat_template") or "auto"
        fields = ", ".join(f"{f}=\"...\"" for f in _fields(template)) or ""
        lines = [f"# as trained: data.prompt_template {template!r}, data.chat_template {mode!r}, "
                 f"data.max_length {max_length}",
                 f"prompt = {template!r}.format({fields})"]
        if uses_chat_template(run.tokenizer, mode):
            lines += ["text = tokenizer.apply_chat_template([{\"role\": \"user\", \"content\": prompt}], tokenize=False, "
                      "add_generation_prompt=True)",
                      "ids = tokenizer(text, add_special_tokens=False, return_tensors=\"pt\").input_ids"]
        else:
            lines += ["ids = tokenizer(prompt, return_tensors=\"pt\").input_ids"]
        if max_length:
            lines += [f"ids = ids[:, -{int(max_length) - 1}:]  # evaluation kept a prompt's last max_length - 1 tokens"]
        new_tokens = (module.export_meta().get("generation") or {}).get("max_new_tokens")
        lines += [f"output = model.generate(ids, max_new_tokens={new_tokens or 64})",
                  "print(tokenizer.decode(output[0, ids.shape[1]:], skip_special_tokens=True))"]
        return "\n".join(lines)
    pair = data.get("text_pair_column")
    texts = "[\"a text\"], [\"its pair\"]" if pair else "[\"a text\"]"
    lines = [f"# as trained: data.max_length {max_length}"
             + (f", the text column {data.get('text_column')!r}" if data.get("text_column") else "")
             + (f" paired with {pair!r}" if pair else "")
             + (f", data.template {data.get('template')!r}" if data.get("template") else ""),
             f"inputs = tokenizer({texts}, truncation=True, max_length={max_length}, padding=True, "
             "return_tensors=\"pt\")" if max_length else
             f"inputs = tokenizer({texts}, padding=True, return_tensors=\"pt\")"]
    if module.task == "classification":
        lines += ["probabilities = model(**inputs).logits.softmax(-1)"]
    return "\n".join(lines)


def _fields(template: str) -> list[str]:
    import string

    return list(dict.fromkeys(name for _, name, _, _ in string.Formatter().parse(template) if name))


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
    """``dpl export RUN FOLDER [--adapter] [--push-to-hub REPO]``."""
    parser = argparse.ArgumentParser(prog="dpl export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a run folder (lightning_logs/version_N), or a .ckpt file")
    parser.add_argument("folder", help="the folder to write (new or empty)")
    parser.add_argument("--adapter", action="store_true", help="a PEFT adapter folder instead of merged weights")
    parser.add_argument("--push-to-hub", metavar="REPO", default=None,
                        help="then upload the folder to this Hugging Face model repository (created private if new; "
                             "needs a configured token and the network)")
    args = parser.parse_args(argv)
    try:
        if args.push_to_hub is not None:
            check_hub_access(args.push_to_hub)
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
    if args.push_to_hub is not None:
        from huggingface_hub import HfApi

        try:
            api = HfApi()
            api.create_repo(args.push_to_hub, private=True, exist_ok=True)
            url = api.upload_folder(repo_id=args.push_to_hub, folder_path=str(folder),
                                    commit_message="dpl export")
        except Exception as exc:  # noqa: BLE001 - the Hub's errors are many: one line, the folder stays
            print(f"dpl: error: pushing {folder} to {args.push_to_hub!r} failed ({str(exc).strip().splitlines()[0]}); "
                  f"the exported folder is kept", file=sys.stderr)
            return 2
        print(f"dpl: pushed {folder} to {url}")
    return 0


def check_hub_access(repo: str) -> None:
    """Raise :class:`ConfigError` in one line unless ``repo`` can be pushed to: online (no ``HF_HUB_OFFLINE``), with
    a configured Hugging Face token (``HF_TOKEN`` or ``hf auth login``)."""
    from huggingface_hub import constants, get_token

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on") or constants.HF_HUB_OFFLINE:
        raise ConfigError(f"--push-to-hub {repo}: the Hugging Face Hub is offline here (HF_HUB_OFFLINE is set); "
                          f"export without it and upload the folder later")
    if get_token() is None:
        raise ConfigError(f"--push-to-hub {repo}: no Hugging Face token is configured (set HF_TOKEN or run "
                          f"`hf auth login`)")
