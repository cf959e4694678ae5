"""Every shipped config (configs/, plugins/<name>/*.yaml) parses with LightningCLI (run=False), alone and composed."""

from pathlib import Path

import pytest
import yaml

from dpl.cli_lightning import DPLightningCLI
from dpl.lightning.data import DPDataModule
from dpl.lightning.module import DPModule

ROOT = Path(__file__).resolve().parents[1]
SKIPPED = ("audit", "strategies", "trackers")  # dpl audit configs: tests/test_audit.py; process/GPU fragments:
# tests/test_ddp.py; tracker fragments (their logger opens its store): tests/test_trackers.py


def _is_task(path: Path) -> bool:
    """A task config names its model class; a fragment (plugins, optimizers, smoke, ...) only adds to one."""
    model = (yaml.safe_load(path.read_text()) or {}).get("model")
    return isinstance(model, dict) and "class_path" in model


# configs/ and the plugins' own fragments (plugins/<name>/*.yaml)
SHIPPED = sorted(p for p in [*(ROOT / "configs").rglob("*.yaml"), *(ROOT / "plugins").rglob("*.yaml")]
                 if p.parent.name not in SKIPPED)
TASK_CONFIGS = [p for p in SHIPPED if _is_task(p)]


def _parse(*configs: Path):
    args = [arg for c in configs for arg in ("--config", str(c))]
    return DPLightningCLI(DPModule, DPDataModule, subclass_mode_model=True, subclass_mode_data=True, run=False,
                          args=args, auto_configure_optimizers=False)


@pytest.mark.parametrize("config", TASK_CONFIGS, ids=[str(p.relative_to(ROOT)) for p in TASK_CONFIGS])
def test_task_config_parses(config):
    cli = _parse(config)
    assert isinstance(cli.model, DPModule)
    assert isinstance(cli.datamodule, DPDataModule)


FRAGMENTS = [p for p in SHIPPED if not _is_task(p)]


@pytest.mark.parametrize("fragment", FRAGMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_fragments_compose_with_quickstart(fragment):
    task = fragment.parent / "dpsgd.yaml"  # a fragment beside a task config (e2e/smoke.yaml) composes with it
    cli = _parse(task if task.is_file() else ROOT / "configs" / "quickstart.yaml", fragment)
    assert isinstance(cli.model, DPModule)


def test_lora_fragment_switches_method():
    cli = _parse(ROOT / "configs" / "sst2" / "dpsgd.yaml", ROOT / "configs" / "finetuning" / "lora.yaml")
    assert cli.model.finetuning.method == "lora"
