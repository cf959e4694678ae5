"""``dpl export <run or checkpoint> <folder>``: a Hugging Face model folder from a run.

The folder loads with ``AutoModelForSequenceClassification`` / ``AutoModelForCausalLM.from_pretrained(folder)``
(LoRA merged into the weights), or, with ``--adapter``, is a PEFT adapter folder (``AutoPeftModelFor...``; the base
model is referenced by its path). Beside the weights: the tokenizer, the label mapping (``config.json``'s
``id2label``), ``privacy.json`` / ``privacy.md`` of the exported checkpoint, and ``dpl.json`` (what ``dpl predict``
needs: the task, label names, prompt template, max length). A classifier with dpl's mean-pooling head
(``pooling: mean``) is saved with its few lines of modeling code (``modeling_dpl.py``): load it with
``trust_remote_code=True``.

Nothing secret is exported: the checkpoint's ``.secret`` sidecar is never read, and only weights, tokenizer files
and public settings are written.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from dpl.errors import ConfigError, DPLError
from dpl.lightning.report import REPORT_JSON, REPORT_KEY, write_report
from dpl.trained.runs import EXPORT_META, LoadedRun, load_run

DATA_KEYS = ("max_length", "text_column", "text_pair_column", "prompt_template", "template")


def _merged(model: Any) -> Any:
    from peft import PeftModel

    return model.merge_and_unload() if isinstance(model, PeftModel) else model


def _label_config(config: Any, names: list[str]) -> None:
    config.id2label = dict(enumerate(names))
    config.label2id = {name: i for i, name in enumerate(names)}


def _save_mean_pooled(model: Any, folder: Path, names: list[str]) -> None:
    """dpl's :class:`~dpl.tasks.modules.classification.MeanPoolClassifier` as a remote-code model."""
    from dpl.trained import modeling_dpl

    encoder = _merged(model.encoder)
    config = encoder.config
    _label_config(config, names)
    config.num_labels = len(names)
    config.dpl_pooling = "mean"
    config.auto_map = {"AutoModelForSequenceClassification": "modeling_dpl.MeanPoolForSequenceClassification"}
    exported = modeling_dpl.MeanPoolForSequenceClassification(config)
    exported.encoder.load_state_dict(encoder.state_dict())
    exported.classifier.load_state_dict(model.classifier.state_dict())
    exported.save_pretrained(folder)
    shutil.copy(modeling_dpl.__file__, folder / "modeling_dpl.py")


def export_run(run: LoadedRun, folder: str | Path, adapter: bool = False) -> Path:
    """Write ``run``'s model to ``folder`` (see the module docstring); return the folder."""
    from peft import PeftModel

    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()):
        raise ConfigError(f"{folder} exists and is not empty: export into a new folder")
    module, names = run.module, run.label_names
    model = module.model
    mean_pooled = type(model).__name__ == "MeanPoolClassifier"
    if not mean_pooled and not callable(getattr(model, "save_pretrained", None)):
        raise ConfigError(f"{type(model).__name__} is not a transformers model: export supports sequence "
                          f"classifiers (pooling: model or mean) and causal LMs; use dpl predict on the run itself")
    if adapter and (mean_pooled or not isinstance(model, PeftModel)):
        raise ConfigError("--adapter needs a LoRA run whose model is a transformers model (not pooling: mean)"
                          if mean_pooled or isinstance(getattr(model, "encoder", None), PeftModel) else
                          "--adapter needs a LoRA run (finetuning.method: lora)")
    folder.mkdir(parents=True, exist_ok=True)
    if mean_pooled:
        _save_mean_pooled(model, folder, names)
    else:
        if names is not None:
            _label_config(model.config, names)
            if isinstance(model, PeftModel):
                _label_config(model.get_base_model().config, names)
        (model if adapter else _merged(model)).save_pretrained(folder)
    run.tokenizer.save_pretrained(folder)
    meta = {"task": run.task, "label_names": names, "adapter": adapter,
            "data": {k: run.data[k] for k in DATA_KEYS if run.data.get(k) is not None},
            "source": run.source.name if run.source is not None else None}
    if run.task == "generation":
        meta["generation"] = {"max_new_tokens": module.generation.max_new_tokens,
                              "num_beams": module.generation.num_beams}
    (folder / EXPORT_META).write_text(json.dumps(meta, indent=2) + "\n")
    report = _report_of(run)
    if report is not None:
        write_report(report, folder)
    return folder


def _report_of(run: LoadedRun) -> dict[str, Any] | None:
    """The checkpoint's privacy report; the run folder's instead where it is the same run at the same step (it then
    also says how the run ended)."""
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
