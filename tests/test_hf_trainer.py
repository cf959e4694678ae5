"""dpl inside ``transformers.Trainer`` (``dpl.hf.PrivateTrainer``): the same run as ``dpl.PrivateTraining`` (sigma,
epsilon, sampled rows, parameters), the settings refused in one line, the budget, the logs, the checkpoints (no
secret in the checkpoint folder), resume with dpl's rules, users as units and the per-example losses."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_bert, tiny_llama_lm

pytest.importorskip("accelerate")
from transformers import TrainingArguments, default_data_collator  # noqa: E402

from dpl import PrivacyConfig, PrivateTraining  # noqa: E402
from dpl.errors import ConfigError  # noqa: E402
from dpl.hf import PrivateTrainer  # noqa: E402
from dpl.hf import data as hf_data  # noqa: E402
from dpl.hf.losses import causal_lm_loss  # noqa: E402
from dpl.hf.saving import ENGINE_FILE, SECRETS_DIR  # noqa: E402


def rows(n: int = 64, length: int = 8, users: bool = False) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        row = {"input_ids": torch.randint(1, 50, (length,), generator=gen),
               "attention_mask": torch.ones(length, dtype=torch.long), "labels": i % 2}
        if users:
            row["user"] = i // 4
        out.append(row)
    return out


def arguments(tmp_path, **kw) -> TrainingArguments:
    settings = dict(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4, learning_rate=0.1,
                    optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, report_to=[], save_strategy="no",
                    logging_steps=1, use_cpu=True, disable_tqdm=True)
    settings.update(kw)
    return TrainingArguments(**settings)


def privacy(**kw) -> PrivacyConfig:
    settings = dict(target_epsilon=4.0, batch_size=16, physical_batch_size=4, max_grad_norm=1.0, seed=7)
    settings.update(kw)
    return PrivacyConfig(**settings)


def trainer(tmp_path, data=None, args=None, **kw) -> PrivateTrainer:
    return PrivateTrainer(model=kw.pop("model", None) or tiny_bert(), args=args or arguments(tmp_path),
                          train_dataset=rows() if data is None else data, data_collator=default_data_collator,
                          privacy=kw.pop("privacy", None) or privacy(), **kw)


def record_rows(monkeypatch) -> list[list[int]]:
    seen: list[list[int]] = []
    original = hf_data.RowCollate.__call__

    def call(self, batch_rows):
        seen.append(list(batch_rows))
        return original(self, batch_rows)

    monkeypatch.setattr(hf_data.RowCollate, "__call__", call)
    return seen


# --------------------------------------------------------------------------------------------- the same run


def test_three_steps_equal_private_training(tmp_path, monkeypatch):
    """Same model, data, seed and privacy settings: the trainer and dpl.PrivateTraining give the same sigma, epsilon,
    sampled rows and parameters. Both run the same float32 operations in the same order (the engine's step, then
    torch's SGD step, by the trainer's wrapped optimizer or directly), so the parameters are compared exactly."""
    seen = record_rows(monkeypatch)
    hf = trainer(tmp_path)
    hf.train()

    model = tiny_bert()
    data = rows()

    def loss(batch):  # written independently of dpl.hf.losses
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return F.cross_entropy(logits, batch["labels"], reduction="none")

    lib = PrivateTraining(model, loss, privacy(), data=data, steps=3,
                          optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1))
    drawn: list[list[int]] = []
    next_indices = lib.next_indices
    lib.next_indices = lambda: drawn.append(next_indices()) or drawn[-1]
    lib.run()

    assert hf.dpl_engine.noise_multiplier == lib.noise_multiplier and hf.dpl_engine.task_kind == "classification"
    assert hf.dpl_engine.epsilon() == lib.epsilon and hf.dpl_engine.steps_done == lib.steps_done == 3
    assert seen == drawn and any(seen)
    for (name, a), (_, b) in zip(hf.model.named_parameters(), model.named_parameters()):
        assert torch.equal(a, b), name
    assert not torch.equal(hf.model.classifier.weight, tiny_bert().classifier.weight)  # it trained


def test_sigma_is_calibrated_at_construction_for_the_trainers_steps(tmp_path):
    by_epochs = trainer(tmp_path, args=arguments(tmp_path, max_steps=-1, num_train_epochs=2))
    assert by_epochs.dpl_engine.plan.steps == 2 * (64 // 16)  # epochs x floor(N / B), as the trainer counts them
    assert by_epochs.get_train_dataloader().__len__() == 64 // 16
    by_steps = trainer(tmp_path, args=arguments(tmp_path, max_steps=5))
    assert by_steps.dpl_engine.plan.steps == 5
    assert by_steps.dpl_engine.noise_multiplier > by_epochs.dpl_engine.noise_multiplier * 0  # calibrated
    assert abs(by_steps.dpl_engine.final_epsilon() - 4.0) < 0.05


# --------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("kw, words", [
    (dict(gradient_accumulation_steps=4), "set gradient_accumulation_steps=1, privacy.batch_size to the logical"),
    (dict(train_sampling_strategy="group_by_length"), "group_by_length"),
    (dict(train_sampling_strategy="sequential"), "Poisson"),
    (dict(auto_find_batch_size=True), "micro-batch"),
])
def test_settings_that_break_the_guarantee_are_one_line(tmp_path, kw, words):
    with pytest.raises(ConfigError, match=words) as err:
        trainer(tmp_path, args=arguments(tmp_path, **kw))
    assert "\n" not in str(err.value)


def test_a_custom_train_sampler_is_refused(tmp_path):
    class Mine(PrivateTrainer):
        def _get_train_sampler(self, dataset=None):
            return torch.utils.data.SequentialSampler(dataset)

    with pytest.raises(ConfigError, match="Mine._get_train_sampler draws its own training batches"):
        Mine(model=tiny_bert(), args=arguments(tmp_path), train_dataset=rows(), data_collator=default_data_collator,
             privacy=privacy())


def test_max_steps_beyond_the_budget_is_refused_before_training(tmp_path):
    with pytest.raises(ConfigError, match="the plan spends epsilon = .* > privacy.max_epsilon = 2"):
        trainer(tmp_path, args=arguments(tmp_path, max_steps=50),
                privacy=privacy(target_epsilon=None, noise_multiplier=1.0, max_epsilon=2.0))
    assert not list((tmp_path / "out").rglob("*")) if (tmp_path / "out").exists() else True  # nothing written


def test_batch_size_above_the_rows_and_an_iterable_set_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"privacy.batch_size \(16\) is larger than the training set \(8 examples\)"):
        trainer(tmp_path, data=rows(8))

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(rows())

    with pytest.raises(ConfigError, match="iterable"):
        trainer(tmp_path, data=Stream())


def test_max_epsilon_stops_a_trainer_that_would_run_past_the_plan(tmp_path):
    hf = trainer(tmp_path)
    hf.args.max_steps = 6  # the trainer would run 3 steps more than planned: the budget stops it
    hf.train()
    assert hf.dpl_engine.steps_done == hf.state.global_step == 3
    assert hf.dpl_engine.epsilon() <= 4.0


# --------------------------------------------------------------------------------------------- logs


def test_epsilon_and_the_plan_reach_the_logs_and_the_loss_does_not(tmp_path):
    hf = trainer(tmp_path)
    hf.train()
    logged = hf.state.log_history
    epsilons = [line["epsilon"] for line in logged if "epsilon" in line]
    assert len(epsilons) >= 3 and epsilons == sorted(epsilons) and epsilons[-1] == hf.dpl_engine.epsilon()
    plan = [line for line in logged if "privacy/sigma" in line]
    assert len(plan) == 1 and plan[0]["privacy/sigma"] == hf.dpl_engine.noise_multiplier
    assert plan[0]["privacy/steps_planned"] == 3 and plan[0]["privacy/batch_size"] == 16
    assert not any("loss" in line or "train_loss" in line for line in logged)
    assert all(line.get("total_flos", 0) == 0 for line in logged)  # no count that follows the realized batches


# --------------------------------------------------------------------------------------------- saving, resuming


def test_checkpoints_carry_the_report_and_no_secret(tmp_path):
    hf = trainer(tmp_path, args=arguments(tmp_path, save_strategy="steps", save_steps=2))
    hf.train()
    hf.save_model()
    out = tmp_path / "out"
    checkpoint = out / "checkpoint-2"
    report = json.loads((checkpoint / "privacy.json").read_text())
    assert report["steps_taken"] == 2 and report["noise_multiplier"] == hf.dpl_engine.noise_multiplier
    final = json.loads((out / "privacy.json").read_text())
    assert final["steps_taken"] == 3 and final["run"]["status"] == "finished" and final["epsilon"] <= 4.0
    state = torch.load(checkpoint / ENGINE_FILE, weights_only=False)
    assert "noise_rng" not in state and "sampler_rng" not in state and state["steps_done"] == 2
    for path in checkpoint.iterdir():  # nothing secret in the folder one shares or pushes
        assert b"noise_rng" not in path.read_bytes() and b"sampler_rng" not in path.read_bytes(), path
    sidecar = out / SECRETS_DIR / "checkpoint-2.secret"
    assert stat.S_IMODE(sidecar.stat().st_mode) == 0o600
    assert stat.S_IMODE((out / SECRETS_DIR).stat().st_mode) == 0o700
    assert "noise_rng" in torch.load(sidecar, weights_only=True)
    ledger = [json.loads(line) for line in (out / "privacy_ledger.jsonl").read_text().splitlines()]
    assert {line["run_id"] for line in ledger} == {final["run"]["id"]} and ledger[-1]["steps"] == 3


def test_resume_with_the_seed_replays_the_uninterrupted_run(tmp_path):
    whole = trainer(tmp_path / "a", args=arguments(tmp_path / "a", max_steps=4))
    whole.train()
    first = trainer(tmp_path / "b", args=arguments(tmp_path / "b", max_steps=4, save_strategy="steps",
                                                   save_steps=2))
    first.args.max_steps = 2  # stops after the checkpoint of step 2, as an interrupted run would
    first.train()
    second = trainer(tmp_path / "b", args=arguments(tmp_path / "b", max_steps=4))
    second.train(resume_from_checkpoint=True)
    assert second.dpl_engine.steps_done == 4 and second.dpl_engine.epsilon() == whole.dpl_engine.epsilon()
    assert second.dpl_engine.summary()["resumed_noise"] == "replayed"
    for (name, a), (_, b) in zip(whole.model.named_parameters(), second.model.named_parameters()):
        assert torch.equal(a, b), name
    report = json.loads((tmp_path / "b" / "out" / "privacy.json").read_text())
    assert report["run"]["continues"]["steps"] == 2


def test_resume_with_changed_privacy_is_refused_and_without_a_state_too(tmp_path):
    first = trainer(tmp_path, args=arguments(tmp_path, max_steps=4, save_strategy="steps", save_steps=2))
    first.args.max_steps = 2
    first.train()
    changed = trainer(tmp_path, args=arguments(tmp_path, max_steps=4), privacy=privacy(max_grad_norm=0.5))
    with pytest.raises(ConfigError) as err:
        changed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert "\n" not in str(err.value) and "max_grad_norm" in str(err.value).replace("C ", "max_grad_norm ")
    os.remove(tmp_path / "out" / "checkpoint-2" / ENGINE_FILE)
    with pytest.raises(ConfigError, match="holds no dpl privacy state"):
        trainer(tmp_path, args=arguments(tmp_path, max_steps=4)).train(resume_from_checkpoint=True)


# --------------------------------------------------------------------------------------------- units, losses


def test_users_are_the_units(tmp_path, monkeypatch):
    seen = record_rows(monkeypatch)
    hf = trainer(tmp_path, data=rows(users=True), user_column="user",
                 privacy=privacy(unit="user", max_rows_per_user=4, batch_size=4))
    assert hf.dpl_engine.plan.population == 16  # 64 rows of 16 users
    hf.train()
    for batch in seen:  # each sampled user comes with all its rows (k = 4 = its rows)
        assert sorted({r // 4 for r in batch}) == sorted({r // 4 for r in batch if batch.count(r) == 1})
        assert all(sum(1 for r in batch if r // 4 == u) == 4 for u in {r // 4 for r in batch})
    assert json.loads((tmp_path / "out" / "privacy.json").read_text())["unit"] == "user"


def test_causal_lm_loss_is_the_mean_over_the_labelled_tokens():
    model = tiny_llama_lm(vocab_size=40)
    ids = torch.tensor([[1, 5, 6, 7, 8, 0], [1, 9, 10, 0, 0, 0]])
    mask = (ids != 0).long()
    labels = torch.tensor([[-100, -100, 6, 7, 8, -100], [-100, -100, 10, -100, -100, -100]])
    got = causal_lm_loss(model, {"input_ids": ids, "attention_mask": mask, "labels": labels})
    logits = model(input_ids=ids, attention_mask=mask).logits
    expected = []
    for i in range(2):
        targets = labels[i, 1:]
        keep = targets != -100
        expected.append(F.cross_entropy(logits[i, :-1][keep], targets[keep]))
    assert torch.allclose(got, torch.stack(expected), rtol=1e-5, atol=1e-6)
