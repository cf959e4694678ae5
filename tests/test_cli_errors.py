"""dpl.cli_errors: each rule that turns a jsonargparse error message into one ``dpl: error:`` line, fed the message
that jsonargparse really gives for ``dpl fit`` (captured from dpl's own parser, before the rewrite)."""

from typing import Any

import pytest
import yaml

from dpl import cli_lightning
from dpl.cli_errors import summarize_parse_error
from dpl.core.plugin_manager import installed_plugins
from dpl.lightning.data import DPDataModule
from dpl.lightning.module import DPModule

CONFIG = {"model": {"class_path": "dpl.tasks.modules.DPClassificationModule", "init_args": {"model": "m"}},
          "data": {"class_path": "dpl.tasks.data.ClassificationDataModule",
                   "init_args": {"tokenizer": "m", "data_dir": "d"}}}


class _Captured(Exception):
    pass


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli_errors") / "config.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    return str(path)


def parse_error(argv: list[str]) -> tuple[str, list[str], Any]:
    """The message, command line and parser that dpl's parser hands to the rewrite when ``dpl <argv>`` fails to
    parse."""
    seen: dict[str, Any] = {}

    def capture(message: str, given: list[str], parser: Any) -> str:
        seen.update(message=str(message), argv=given, parser=parser)
        raise _Captured

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cli_lightning, "summarize_parse_error", capture)
        with pytest.raises(_Captured):
            cli_lightning.DPLightningCLI(DPModule, DPDataModule, subclass_mode_model=True, subclass_mode_data=True,
                                         args=argv, auto_configure_optimizers=False)
    return seen["message"], seen["argv"], seen["parser"]


def rewrite(argv: list[str]) -> str:
    message, given, parser = parse_error(argv)
    assert given == argv  # the parser knows the command line it parsed
    return summarize_parse_error(message, given, parser)


def test_no_command_names_the_commands():
    assert rewrite([]).startswith("expected a command: fit, validate, test, predict")


def test_no_model_or_data_points_to_a_config():
    assert rewrite(["fit"]) == ("the following arguments are required: fit.data, fit.model (give a config: dpl fit "
                                "--config configs/quickstart.yaml)")


def test_a_config_file_error_names_the_config_not_the_parser_key(tmp_path):
    missing = str(tmp_path / "none.yaml")
    assert rewrite(["fit", "--config", missing]) == f"config: File does not exist: '{missing}'"


@pytest.mark.parametrize(("option", "line"), [
    ("--trainer.max_stepz", "unknown option --trainer.max_stepz; did you mean --trainer.max_steps?"),
    ("--xyzzy", "unknown option --xyzzy; see dpl fit --help"),
])
def test_an_unrecognized_option_names_the_closest(config, option, line):
    assert rewrite(["fit", "--config", config, option, "3"]) == line


@pytest.mark.parametrize(("option", "line"), [
    ("--model.init_args.privacy.batchsize",
     "unknown option --model.init_args.privacy.batchsize; did you mean --model.init_args.privacy.batch_size?"),
    ("--model.privacy.batchsize", "unknown option --model.privacy.batchsize; did you mean --model.privacy.batch_size?"),
    ("--model.init_args.lrate", "unknown option --model.init_args.lrate; see --model.help CLASS"),
])
def test_an_unknown_nested_option_is_named_as_typed_with_the_closest(config, option, line):
    assert rewrite(["fit", "--config", config, option, "8"]) == line


def test_a_value_of_the_wrong_type_says_what_was_expected(config):
    assert rewrite(["fit", "--config", config, "--model.init_args.privacy.batch_size", "abc"]) == \
        "model.privacy.batch_size: expected int"


@pytest.mark.parametrize(("plugins", "line"), [
    ("{denoize: {}}", "unknown plugin 'denoize' in model.plugins; did you mean denoise? (installed: "
                      f"{', '.join(sorted(set(installed_plugins()) - {'clip', 'gaussian'}))})"),
    ("{denoise: {kapa: 1.0}}", "unknown option model.plugins.denoise.kapa; did you mean kappa?"),
    ("{denoise: {svd: ful}}",
     "model.plugins.denoise.svd: expected one of 'auto', 'full', 'randomized', got 'ful'; did you mean 'full'?"),
    ("{adambc: {gamma: abc}}", "model.plugins.adambc.gamma: expected float, got 'abc'"),
])
def test_a_bad_plugin_entry_is_one_line(config, plugins, line):
    assert rewrite(["fit", "--config", config, "--model.init_args.plugins", plugins]) == line


def test_any_other_message_keeps_its_last_meaningful_line_and_the_debug_hint():
    message = 'Parser key "trainer":\n  Something else went wrong\n  Given value: 3'
    assert summarize_parse_error(message, [], None) == \
        "trainer: Something else went wrong (DPL_DEBUG=1 shows the full message)"


@pytest.mark.parametrize("option", ["--model.privacy.batchsize", "--model.init_args.privacy.batchsize", "--xyzzy",
                                    "--privacy.batch_sise"])
def test_the_precheck_says_what_the_full_parser_says(config, option):
    from dpl.cli_precheck import precheck

    assert precheck(["--config", config, option, "3"]) == rewrite(["fit", "--config", config, option, "3"])


@pytest.mark.parametrize("argv", [["--model.privacy.batch_size", "3"], ["--model.privacy.zzz", "3"],
                                  ["--traner.max_steps", "3"], ["--seed_everythin", "3"], ["--ckpt", "x"],
                                  ["--model.privacy.help"], ["--trainer.max_stepz", "3"]])
def test_the_precheck_leaves_what_it_is_not_sure_of_to_the_full_parser(config, argv):
    from dpl.cli_precheck import precheck

    assert precheck(["--config", config, *argv]) is None


def test_a_privacy_typo_in_a_config_file_is_answered_before_lightning_is_imported(tmp_path):
    import subprocess
    import sys

    typo = tmp_path / "typo.yaml"
    typo.write_text("model:\n  init_args:\n    privacy:\n      batch_sise: 4\n")
    code = ("import sys\nfrom dpl.cli import main\ntry:\n    main(['fit', '--config', 'configs/quickstart.yaml', "
            f"'--config', {str(typo)!r}])\nexcept SystemExit as exc:\n    print(exc.code, 'lightning' in sys.modules, "
            "'torch' in sys.modules)")
    from pathlib import Path

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.stdout.split() == ["2", "False", "False"], done.stderr[-2000:]
    assert done.stderr.strip() == (f"dpl: error: unknown option model.init_args.privacy.batch_sise in {typo}; did "
                                   f"you mean model.init_args.privacy.batch_size?")
