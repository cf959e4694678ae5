"""`dpl plan`: sigma as `dpl fit` calibrates it, the noise regime and its warning, the alternatives table at the same
epsilon and compute, the model counted without its weights, N counted without tokenizing, one-line errors."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
from helpers import save_tiny_bert, save_tiny_llama_lm, write_sentiment_tsv
from torch import nn

from dpl.cli import main
from dpl.core.accounting import epsilon_for
from dpl.core.engine import PrivateEngine
from dpl.core.privacy import PrivacyConfig
from dpl.core.regime import HOPELESS, NoiseRegime, needed_dimension
from dpl.planning.alternatives import Row, recommend, same_compute
from dpl.planning.command import plan_config
from dpl.planning.skeleton import build_without_weights

ROOT = Path(__file__).resolve().parents[1]
WARNING = "noise on each step's mean update"


# ------------------------------------------------------------------------------------------- the regime check


def test_a_small_lora_r8_run_is_hopeless_and_the_quickstart_is_not():
    # docs/planning.md's noisy example: 512 SST-2 rows, B = 16, 3 epochs at epsilon 4 (sigma 0.6967 as dpl plan and
    # dpl fit calibrate it), MiniLM LoRA r 8 on query/key/value/dense (338,690 trainable parameters with the head)
    study = NoiseRegime(0.6967, 16, 338_690, 1.0)
    assert study.relative_noise == pytest.approx(25.3, abs=0.05) and study.hopeless and not study.quiet
    assert "= 25.3 C" in study.warning() and study.warning().startswith("dpl: ") and "\n" not in study.warning()
    # configs/quickstart.yaml: B = 512, LoRA r 1 on query/value + head (9,986), sigma at epsilon 8 over 40 steps
    quickstart = NoiseRegime(0.4601, 512, 9_986, 1.0)
    assert quickstart.relative_noise == pytest.approx(0.0898, abs=1e-3) and quickstart.quiet
    assert not quickstart.hopeless


def test_regime_is_a_function_of_sigma_batch_dimension_and_clip():
    regime = NoiseRegime(2.0, 100, 2_500, 0.5)
    assert regime.noise_batch_ratio == pytest.approx(0.02)
    assert regime.relative_noise == pytest.approx(1.0)  # 2 * 50 / 100
    assert regime.noise_norm == pytest.approx(0.5)  # in units of C: the same ratio
    assert regime.quiet and not regime.hopeless
    edge = NoiseRegime(1.0, 10, int((HOPELESS * 10) ** 2), 1.0)
    assert edge.relative_noise == pytest.approx(HOPELESS) and not edge.hopeless  # strictly above warns
    assert NoiseRegime(1.0, 10, int((HOPELESS * 10) ** 2) + 100, 1.0).hopeless
    assert needed_dimension(2.0, 100) == 2_500 and NoiseRegime(2.0, 100, needed_dimension(2.0, 100), 1).quiet


def _engine(model: nn.Module, n: int, batch: int, steps: int, epsilon: float) -> PrivateEngine:
    engine = PrivateEngine(PrivacyConfig(target_epsilon=epsilon, batch_size=batch, physical_batch_size=batch))
    engine.setup(model, num_rows=n, steps=steps)
    return engine


def test_engine_start_warns_once_in_the_hopeless_regime(caplog):
    # what dpl fit does before the first step (DPModule.on_fit_start -> PrivateEngine.start)
    engine = _engine(nn.Linear(1000, 400), n=64, batch=8, steps=16, epsilon=1.0)
    regime = engine.noise_regime()
    assert regime.dimension == 400_400 and regime.noise_multiplier == engine.noise_multiplier and regime.hopeless
    with caplog.at_level(logging.INFO, logger="dpl"):
        engine.start()
        engine.start()
    warned = [r for r in caplog.records if WARNING in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING and warned[0].name == "dpl"
    assert "\n" not in warned[0].getMessage()



def test_the_warning_cites_classification_evidence_only_to_a_classification_run():
    """Above 16 only classification runs failed to appear and the one generation run (E2E LoRA at 20) learned: a
    generation run, or one whose driver names no task, is not told it is noisier than any classification run."""
    from dpl.core.regime import CLASSIFICATION, GENERATION

    regime = NoiseRegime(0.6967, 16, 338_690, 1.0)
    classification, generation, unsaid = (regime.warning(k) for k in (CLASSIFICATION, GENERATION, None))
    assert "above 16 C, noisier than any classification run the project has seen learn; raise B" in classification
    for line in (generation, unsaid):
        assert "noisier than any classification run" not in line and "\n" not in line
        assert ("above 16 C, where no classification run the project has seen learned and its one generation run (a "
                "pretrained language model's LoRA on E2E, at 20 C) did; if the validation loss does not fall") in line


@pytest.mark.parametrize("kind", ["classification", "generation"])
def test_engine_start_warns_in_the_words_of_its_drivers_task(kind, caplog):
    from dpl.tasks.modules import DPClassificationModule, DPGenerationModule, DPPromptClassificationModule

    assert DPClassificationModule(model="x").engine.task_kind == "classification"
    assert DPPromptClassificationModule.task_kind == "classification"
    assert DPGenerationModule(model="x").engine.task_kind == "generation"
    engine = _engine(nn.Linear(1000, 400), n=64, batch=8, steps=16, epsilon=1.0)
    engine.task_kind = kind
    with caplog.at_level(logging.INFO, logger="dpl"):
        engine.start()
    warned = [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]
    assert len(warned) == 1 and warned[0] == engine.noise_regime().warning(kind)
    assert ("noisier than any classification run" in warned[0]) == (kind == "classification")

def test_engine_start_does_not_warn_below_the_threshold(caplog):
    engine = _engine(nn.Linear(8, 2), n=10_000, batch=256, steps=20, epsilon=8.0)
    assert engine.noise_regime().quiet
    with caplog.at_level(logging.INFO, logger="dpl"):
        engine.start()
    assert not [r for r in caplog.records if WARNING in r.getMessage()]
    assert any("sigma=" in r.getMessage() for r in caplog.records)  # the start line itself was logged


def test_a_replaced_gradient_estimate_is_not_assessed():
    engine = PrivateEngine(PrivacyConfig(target_epsilon=4.0, batch_size=8, physical_batch_size=8),
                           plugins={"dpzero": {}})
    engine.setup(nn.Linear(1000, 400), num_rows=64, steps=4)
    assert engine.release_dimension is None and engine.noise_regime() is None


# ------------------------------------------------------------------------------------------- the alternatives


def test_same_compute_keeps_batch_times_steps():
    pairs = same_compute(512, 40, 50_000)
    assert (512, 40) in pairs and all(b * t == 512 * 40 for b, t in pairs)
    assert all(1 <= b <= 50_000 for b, _ in pairs) and len(pairs) >= 5
    assert all(b * t == 48 * 3 for b, t in same_compute(48, 3, 10_000))


def _row(batch, steps, relative, current=False, sigma=1.0):
    dimension = int((relative * batch / sigma) ** 2)
    return Row(batch, steps, 1.0, sigma, 4.0, NoiseRegime(sigma, batch, dimension, 1.0), current=current)


def test_recommend_keeps_a_quiet_run_and_otherwise_takes_the_most_steps_that_are_quiet():
    rows = [_row(64, 80, 2.0), _row(128, 40, 0.8, current=True), _row(256, 20, 0.3)]
    best, why = recommend(rows, replan=None, population=1000)
    assert best.current and why.startswith("keep B = 128")
    rows = [_row(64, 80, 5.0), _row(128, 40, 3.0, current=True), _row(256, 20, 0.9), _row(512, 10, 0.4)]
    best, why = recommend(rows, replan=None, population=512)
    assert best.batch_size == 256 and why.startswith("raise B to 256") and "\n" not in why


def test_recommend_without_a_quiet_row_names_a_lora_rank():
    # d = 6,400 (LoRA r 8: 6,300 of them); quiet needs d <= (B / sigma)^2: 256 at B = 16, 1,024 at B = 32
    rows = [_row(16, 4, 5.0, current=True), _row(32, 2, 2.5)]
    best, why = recommend(rows, replan=None, population=16, lora=(8, 6_300, 100))
    assert best.batch_size == 32 and "\n" not in why
    assert why.startswith("no batch size at this compute") and "LoRA r 8 -> 1 at B = 32 (2 steps)" in why
    best, why = recommend(rows, replan=None, population=16)  # no LoRA: the least noise, and the parameters it takes
    assert best.batch_size == 32 and "cut the trainable parameters to <= 1,024 at B = 32" in why


# ------------------------------------------------------------------------------- plan and fit on a tiny world


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plan")
    return {"tmp": tmp, "bert": save_tiny_bert(tmp / "bert"), "llama": save_tiny_llama_lm(tmp / "llama", tie=True)}


def _quickstart_args(tiny, *extra: str) -> list[str]:
    return ["--config", str(ROOT / "configs/quickstart.yaml"), "--config", str(ROOT / "configs/smoke.yaml"),
            "--model.init_args.model", tiny["bert"], "--data.init_args.tokenizer", tiny["bert"],
            "--data.init_args.train_size", "400", "--data.init_args.validation_size", "20",
            "--trainer.default_root_dir", str(tiny["tmp"] / "runs"), "--trainer.precision", "32-true",
            "--trainer.enable_progress_bar", "false", *extra]


def _fit_privacy(tiny, args: list[str], name: str) -> dict:
    root = tiny["tmp"] / name
    main(["fit", *args, "--trainer.default_root_dir", str(root)])
    reports = sorted(root.rglob("privacy.json"))
    assert reports, f"no privacy.json under {root}"
    return json.loads(reports[-1].read_text())


@pytest.mark.parametrize("extra", [(), ("--config", str(ROOT / "configs/privacy/quickstart-authors.yaml"),
                                        "--config", str(ROOT / "configs/privacy/users.yaml"),
                                        "--data.init_args.authors", "60", "--model.init_args.privacy.batch_size", "8")],
                         ids=["examples", "users"])
def test_plan_sigma_is_what_fit_calibrates(tiny, extra, caplog):
    args = _quickstart_args(tiny, *extra)
    report = plan_config(args)
    with caplog.at_level(logging.INFO, logger="dpl"):
        fitted = _fit_privacy(tiny, args, f"fit_{len(extra)}")
    assert report.current.noise_multiplier == fitted["noise_multiplier"]  # the same calibration, bit for bit
    assert report.current.steps == fitted["steps_planned"] and report.delta == fitted["delta"]
    assert report.current.regime.hopeless == any(WARNING in r.getMessage() for r in caplog.records)


def test_fit_warns_before_training_where_plan_says_nothing_learns(tiny, caplog):
    args = _quickstart_args(tiny, "--model.init_args.privacy.batch_size", "2", "--trainer.max_steps", "2",
                            "--model.init_args.privacy.physical_batch_size", "2",
                            "--model.init_args.privacy.target_epsilon", "1",
                            "--model.init_args.finetuning.method", "full")
    report = plan_config(args)
    assert report.current.regime.hopeless
    with caplog.at_level(logging.INFO, logger="dpl"):
        _fit_privacy(tiny, args, "fit_hopeless")
    messages = [r.getMessage() for r in caplog.records if r.name == "dpl"]
    warned = [i for i, m in enumerate(messages) if WARNING in m]
    assert len(warned) == 1 and f"= {report.current.regime.relative_noise:.3g} C" in messages[warned[0]]
    start = next(i for i, m in enumerate(messages) if m.startswith("dpl: N="))
    assert warned[0] == start + 1  # right after the start line, before any step


def test_the_table_keeps_compute_and_epsilon(tiny):
    report = plan_config(_quickstart_args(tiny, "--model.init_args.privacy.batch_size", "32",
                                          "--trainer.max_steps", "8"))
    cur = report.current
    assert len(report.rows) >= 4 and sum(r.current for r in report.rows) == 1
    for row in report.rows:
        assert row.batch_size * row.steps == cur.batch_size * cur.steps
        assert row.epochs == pytest.approx(row.batch_size * row.steps / report.population)
        eps = epsilon_for(row.noise_multiplier, row.batch_size / report.population, row.steps, report.delta)
        assert report.target_epsilon * 0.99 <= eps <= report.target_epsilon * (1 + 1e-9)  # the accountant, again
        assert row.epsilon == pytest.approx(eps, rel=1e-9)
        assert row.regime.dimension == report.trainable
    ratios = [r.regime.noise_batch_ratio for r in sorted(report.rows, key=lambda r: r.batch_size)]
    assert ratios == sorted(ratios, reverse=True)  # sigma grows more slowly than B (Sander et al.)
    assert report.recommended is not None and report.why


def test_plan_command_prints_the_plan(tiny, capsys):
    main(["plan", *_quickstart_args(tiny)])
    out = capsys.readouterr().out
    for text in ("sigma = ", "q = ", "noise-batch ratio sigma/B", "sigma C sqrt(d)/B", "(current)", "recommended"):
        assert text in out, text


@pytest.mark.parametrize("extra,pattern", [
    (("--model.init_args.privacy.batch_sise", "3"), "unknown option --model.init_args.privacy.batch_sise; did you mean"),
    (("--model.init_args.privacy.batch_size", "1000"), "privacy.batch_size (1000) is larger than the training set (400"),
    (("--model.init_args.privacy.target_epsilon", "-1"), "privacy.target_epsilon must be > 0"),
])
def test_bad_input_is_one_line(tiny, capsys, extra, pattern):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *_quickstart_args(tiny, *extra)])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("dpl: error:")]
    assert exit_info.value.code == 2 and len(errors) == 1 and pattern in errors[0], err[-2000:]
    assert "Traceback" not in err


def test_plan_without_a_config_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("dpl: error: dpl plan needs a config") and err.count("\n") == 1


# ------------------------------------------------------------------ the model without weights, N without tokens


def _count(model: nn.Module) -> tuple[int, set[str]]:
    return (sum(p.numel() for p in model.parameters() if p.requires_grad),
            {n for n, p in model.named_parameters() if p.requires_grad})


@pytest.mark.parametrize("case", ["lora_model_head", "mean_full_freeze", "prompt_auto", "gen_lora", "gen_untie",
                                  "gen_freeze"])
def test_trainable_parameters_without_weights_are_those_of_the_real_model(tiny, case):
    from dpl.tasks.data import ClassificationDataModule, JSONLDataModule
    from dpl.tasks.modules import DPClassificationModule, DPGenerationModule
    from dpl.tasks.modules.classification import FinetuneOptions, LoraOptions
    from dpl.tasks.modules.prompt import DPPromptClassificationModule

    bert, llama = tiny["bert"], tiny["llama"]
    lora = FinetuneOptions(method="lora", lora=LoraOptions(r=2, alpha=4, target_modules=None))

    def make():
        if case == "lora_model_head":
            return DPClassificationModule(model=bert, num_labels=2, finetuning=lora)
        if case == "mean_full_freeze":
            return DPClassificationModule(model=bert, num_labels=3, pooling="mean",
                                          finetuning=FinetuneOptions(freeze=["*embeddings*"]))
        if case == "prompt_auto":  # the checkpoint has no MLM head: the auto decoder scores word embeddings
            return DPPromptClassificationModule(model=bert, label_words=["bad", "good"])
        ties = {"gen_untie": "untie", "gen_freeze": "freeze"}.get(case, "freeze")
        finetuning = FinetuneOptions(method="lora", lora=LoraOptions(r=2)) if case == "gen_lora" else None
        return DPGenerationModule(model=llama, finetuning=finetuning, tied_embeddings=ties)

    data = None
    if case == "prompt_auto":
        folder = tiny["tmp"] / "cls"
        write_sentiment_tsv(folder / "train.tsv", rows=20)
        data = ClassificationDataModule(tokenizer=bert, data_dir=str(folder))
    elif case.startswith("gen"):
        data = JSONLDataModule(tokenizer=llama, train_file=str(_jsonl(tiny["tmp"] / "gen" / "train.jsonl", 10)))
    planned = build_without_weights(make(), data)
    assert {p.device.type for p in planned.parameters() if p.requires_grad} <= {"meta", "cpu"}
    assert any(p.device.type == "meta" for p in planned.parameters())
    assert _count(planned) == _count(make().ensure_model(data))


def _jsonl(path: Path, n: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps({"prompt": f"name : aromi {i}", "completion": " the pub is in the city ."})
                              for i in range(n)) + "\n")
    return path


def test_counting_examples_does_not_tokenize_and_agrees_with_setup(tiny):
    from dpl.tasks.data import ClassificationDataModule, JSONLDataModule, QuickstartDataModule

    folder = tiny["tmp"] / "count"
    write_sentiment_tsv(folder / "train.tsv", rows=30)
    modules = [ClassificationDataModule(tokenizer=tiny["bert"], data_dir=str(folder), max_train_examples=25),
               JSONLDataModule(tokenizer=tiny["llama"], train_file=str(_jsonl(folder / "g" / "train.jsonl", 12)),
                               max_train_examples=9),
               QuickstartDataModule(tokenizer=tiny["bert"], train_size=300, validation_size=10, max_train_examples=250)]
    for module in modules:
        counted = module.count_train_examples()
        assert module.train_set is None  # nothing tokenized
        module.setup("fit")
        assert counted == module.num_train_examples, type(module).__name__
    assert modules[2].count_train_examples() == 250


def test_quickstart_authors_without_generating_the_rows(tiny):
    from dpl.tasks.data import QuickstartDataModule

    def make():
        return QuickstartDataModule(tokenizer=tiny["bert"], train_size=300, validation_size=10, authors=20,
                                    user_column="author", max_train_examples=280)

    fast = make()
    assert fast.count_train_examples() == 280 and fast._splits is None
    keys = fast.train_user_keys()
    assert fast._splits is None  # not generated
    slow = make()
    slow.setup("fit")
    assert keys == slow.train_user_keys() and len(keys) == slow.num_train_examples


def test_ftrl_rows_carry_their_own_sensitivity(tiny):
    report = plan_config(_quickstart_args(tiny, "--model.init_args.plugins", "{ftrl: {noise: independent}}",
                                          "--model.init_args.privacy.batch_size", "20", "--trainer.max_steps", "40",
                                          "--trainer.max_epochs", "3"))
    assert report.mechanism == "ftrl" and report.current.steps == 40
    assert {math.ceil(r.steps / (report.population // r.batch_size)) for r in report.rows} == {2, 3}
    for row in report.rows:
        # independent noise over k participations: sensitivity sqrt(k), k = ceil(steps / (N // B))
        k = math.ceil(row.steps / (report.population // row.batch_size))
        assert row.noise_scale == pytest.approx(math.sqrt(k), rel=1e-6)
        assert row.regime.noise_multiplier == pytest.approx(row.noise_multiplier * row.noise_scale)
