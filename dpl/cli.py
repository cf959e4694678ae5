"""The ``dpl`` command: LightningCLI (``fit``, ``validate``, ``test``) plus ``dpl plugins``."""

from __future__ import annotations

import logging
import os
import sys

from lightning.pytorch.cli import LightningCLI

from dpl.data.base import DPDataModule
from dpl.errors import DPLError
from dpl.modules.base import DPModule


class DPLightningCLI(LightningCLI):
    """LightningCLI that validates the privacy setup before the trainer writes anything."""

    def before_fit(self) -> None:
        # Load and check the data, build the model, check plugins and calibrate sigma before fit starts, so a
        # bad input fails with one line and leaves no half-written run behind.
        self.datamodule.prepare_data()
        self.datamodule.setup("fit")
        self.model.ensure_model(self.datamodule)
        self.model.prepare_privacy(self.datamodule.num_train_examples, self.trainer)


def print_plugins() -> None:
    from dpl.plugin_manager import describe_plugins

    infos = describe_plugins()
    if not infos:
        print("no dpl plugins installed")
        return
    rows = [("name", "package", "version", "hooks")] + [(i.name, i.package, i.version, ", ".join(i.hooks))
                                                          for i in infos]
    widths = [max(len(r[c]) for r in rows) for c in range(3)]
    for r in rows:
        print("  ".join(r[c].ljust(widths[c]) for c in range(3)) + "  " + r[3])


def main(args: list[str] | None = None) -> None:
    """Entry point of ``dpl``; ``args`` defaults to the command line."""
    argv = sys.argv[1:] if args is None else args
    if argv[:1] == ["plugins"]:
        print_plugins()
        return
    if argv[:1] == ["audit"]:
        from dpl.audit import audit_command

        code = audit_command(argv[1:])
        if code:
            raise SystemExit(code)
        return
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        DPLightningCLI(DPModule, DPDataModule, subclass_mode_model=True, subclass_mode_data=True,
                       save_config_kwargs={"overwrite": True}, args=args, auto_configure_optimizers=False)
    except Exception as exc:
        error = _dpl_error_in(exc)
        if error is None or os.environ.get("DPL_DEBUG"):
            raise
        print(f"dpl: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def _dpl_error_in(exc: BaseException | None) -> DPLError | None:
    """The DPLError that caused ``exc`` (jsonargparse wraps errors raised while instantiating classes)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, DPLError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


if __name__ == "__main__":
    main()
