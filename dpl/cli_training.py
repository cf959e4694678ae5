"""``dpl fit`` / ``validate`` / ``test`` as typed: dpl's own keys checked before torch and Lightning are imported
(:mod:`dpl.cli_precheck`), then the run (:mod:`dpl.cli_lightning`), a DPLError as one ``dpl: error:`` line (exit 2)
and SIGTERM as exit 143. :func:`dpl.cli.main` hands these commands here, and a ``dpl tune`` trial runs its fit and
validate through it (:mod:`dpl.tune.trials`)."""

from __future__ import annotations

import logging
import os
import sys

from dpl.errors import dpl_error_in
from dpl.messages import format_warnings, quiet


def training_command(args: list[str] | None = None) -> None:
    """Run ``dpl ARGS`` for Lightning's commands; ``args`` defaults to the command line (which Lightning then reads
    itself). Exits (``SystemExit``) with 2 after a one-line error, 143 after SIGTERM."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] in (["fit"], ["validate"], ["test"]) and not os.environ.get("DPL_DEBUG"):
        from dpl.cli_precheck import precheck

        mistake = precheck(argv[1:])  # dpl's own keys, before the seconds of importing torch and Lightning
        if mistake:
            print(f"dpl: error: {mistake}", file=sys.stderr)
            raise SystemExit(2)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Lightning first: it gives its loggers their own handler when the root logger has none yet
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from dpl import cli_lightning

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    quiet()
    format_warnings()  # again: Lightning installs its own format when imported
    try:
        cli_lightning.run(args)
    except SIGTERMException:
        print("dpl: stopped by SIGTERM after the current step; checkpoints already written are complete (a run "
              "without one was removed)", file=sys.stderr)
        raise SystemExit(143) from None
    except Exception as exc:
        error = dpl_error_in(exc)
        if error is None or os.environ.get("DPL_DEBUG"):
            raise
        print(f"dpl: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
