"""Every shipped config parses with LightningCLI (run=False), alone and composed."""

from pathlib import Path

import pytest

from dpl.cli import DPLightningCLI
from dpl.data.base import DPDataModule
from dpl.modules.base import DPModule

ROOT = Path(__file__).resolve().parents[1]
TASK_CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if p.parent.name != "finetuning"
                      and p.parent.name != "plugins" and p.parent.name != "optimizers"
                      and p.parent.name != "audit"  # dpl audit configs: tests/test_audit.py
                      and p.parent.name != "strategies"  # fragments needing processes/GPUs: tests/test_ddp.py
                      and p.name != "smoke.yaml")  # a fragment (composed below)


def _parse(*configs: Path):
    args = [arg for c in configs for arg in ("--config", str(c))]
    return DPLightningCLI(DPModule, DPDataModule, subclass_mode_model=True, subclass_mode_data=True, run=False,
                          args=args, auto_configure_optimizers=False)


@pytest.mark.parametrize("config", TASK_CONFIGS, ids=[str(p.relative_to(ROOT)) for p in TASK_CONFIGS])
def test_task_config_parses(config):
    cli = _parse(config)
    assert isinstance(cli.model, DPModule)
    assert isinstance(cli.datamodule, DPDataModule)


FRAGMENTS = sorted(p for folder in ("finetuning", "plugins", "optimizers") for p in (ROOT / "configs" / folder).glob("*.yaml")) + [ROOT / "configs" / "smoke.yaml"]


@pytest.mark.parametrize("fragment", FRAGMENTS, ids=lambda p: p.name)
def test_fragments_compose_with_quickstart(fragment):
    cli = _parse(ROOT / "configs" / "quickstart.yaml", fragment)
    assert isinstance(cli.model, DPModule)


def test_lora_fragment_switches_method():
    cli = _parse(ROOT / "configs" / "sst2" / "dpsgd.yaml", ROOT / "configs" / "finetuning" / "lora.yaml")
    assert cli.model.finetuning.method == "lora"
