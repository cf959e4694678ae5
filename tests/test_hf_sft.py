"""dpl inside TRL's ``SFTTrainer`` (``dpl.hf.PrivateSFTTrainer``) on the shipped chat data: the same run as
``dpl fit --config configs/chat/dpsgd.yaml`` (sigma, epsilon, sampled rows, parameters), TRL's own tokenization with
its masks, and packing refused.

How the two runs are made comparable: one tiny Llama (full fine-tuning, untied embeddings, no dropout) with a
word-level ChatML tokenizer stands in for SmolLM2; the trainer gets the token ids and labels that ``dpl fit``'s data
module makes of configs/chat/train.jsonl (TRL leaves a dataset with a ``labels`` column as it is), the config's
optimizer (AdamW, lr 0.002, torch's defaults) passed as the trainer's optimizer, a constant learning rate (the config
has no scheduler), float32 (TRL's default is bf16, which ``dpl fit`` turns off on a CPU without native bfloat16) and the same privacy settings with ``privacy.seed``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import tiny_llama_lm
from test_data_chat import make_chat_tokenizer

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
from trl import SFTConfig  # noqa: E402

from dpl import PrivacyConfig  # noqa: E402
from dpl.core.engine import PrivateEngine  # noqa: E402
from dpl.errors import ConfigError  # noqa: E402
from dpl.hf import PrivateSFTTrainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHAT = ROOT / "configs" / "chat"


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-chat")
    tokenizer = make_chat_tokenizer()
    tokenizer.save_pretrained(folder)
    tiny_llama_lm(vocab_size=len(tokenizer), tie=False).save_pretrained(folder)
    return str(folder)


def record_draws(monkeypatch) -> list[list[list[int]]]:
    """The rows every engine's sampler draws, one list per engine."""
    draws: list[list[list[int]]] = []
    original = PrivateEngine.batch_sampler

    class Recording:
        def __init__(self, sampler, into):
            self.sampler, self.into = sampler, into

        def __len__(self):
            return len(self.sampler)

        def __iter__(self):
            for rows in self.sampler:
                self.into.append(list(rows))
                yield rows

    def batch_sampler(self):
        if not hasattr(self, "_drawn"):
            self._drawn = []
            draws.append(self._drawn)
        return Recording(original(self), self._drawn)

    monkeypatch.setattr(PrivateEngine, "batch_sampler", batch_sampler)
    return draws


def sft_config(tmp_path, **kw) -> SFTConfig:
    settings = dict(output_dir=str(tmp_path / "sft"), max_steps=3, per_device_train_batch_size=8,
                    lr_scheduler_type="constant", report_to=[], save_strategy="no", logging_steps=1, use_cpu=True,
                    disable_tqdm=True, max_length=None, bf16=False)
    settings.update(kw)
    return SFTConfig(**settings)


def test_three_steps_equal_dpl_fit_on_the_chat_config(tiny_chat_model, tmp_path, monkeypatch, capsys):
    from transformers import AutoModelForCausalLM

    from dpl.cli import main
    from dpl.tasks.data import JSONLDataModule

    draws = record_draws(monkeypatch)
    monkeypatch.chdir(ROOT)  # the config names its files relative to the repository
    main(["fit", "--config", "configs/chat/dpsgd.yaml", "--model.init_args.model", tiny_chat_model,
          "--data.init_args.tokenizer", tiny_chat_model, "--model.init_args.finetuning.method", "full",
          "--model.init_args.privacy.seed", "7", "--trainer.max_steps", "3", "--trainer.limit_val_batches", "0",
          "--trainer.default_root_dir", str(tmp_path / "runs")])
    assert "dpl: trained 3 private steps" in capsys.readouterr().out
    run_dir = sorted((tmp_path / "runs").glob("lightning_logs/version_*"))[-1]
    fit_report = json.loads((run_dir / "privacy.json").read_text())
    checkpoint = torch.load(sorted(run_dir.glob("checkpoints/*.ckpt"))[-1], map_location="cpu", weights_only=False)
    fit_params = {k.split("model.", 1)[1]: v for k, v in checkpoint["state_dict"].items()}

    data = JSONLDataModule(tokenizer=tiny_chat_model, train_file=str(CHAT / "train.jsonl"),
                           val_file=str(CHAT / "validation.jsonl"), format="messages", chat_template="auto",
                           max_length=256)
    data.setup("fit")
    train = datasets.Dataset.from_list([{"input_ids": list(ex["input_ids"]), "labels": list(ex["labels"])}
                                        for ex in data.train_set])
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model)
    model.config.pad_token_id = data.tokenizer.pad_token_id
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.002)
    trainer = PrivateSFTTrainer(model=model, args=sft_config(tmp_path), train_dataset=train,
                                processing_class=data.tokenizer, optimizers=(optimizer, None),
                                privacy=PrivacyConfig(target_epsilon=8.0, batch_size=8, max_grad_norm=1.0, seed=7))
    trainer.train()
    engine = trainer.dpl_engine

    assert engine.noise_multiplier == fit_report["noise_multiplier"]
    assert engine.epsilon() == fit_report["epsilon"] and engine.steps_done == 3
    assert len(draws) == 2 and draws[0][:3] == draws[1][:3] and any(draws[1])  # Lightning fetches one batch ahead
    # The same float32 operations on the same batches in the same order (the per-example passes on the same token
    # ids cut to the same length, the engine's step, torch's AdamW): equal to the bit, on any CPU (both run on it).
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param.detach(), fit_params[name]), name
    assert not torch.equal(trainer.model.lm_head.weight, AutoModelForCausalLM.from_pretrained(tiny_chat_model)
                           .lm_head.weight)


def test_trl_tokenizes_the_conversations_and_packing_is_refused(tiny_chat_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    conversations = datasets.load_dataset("json", data_files=str(CHAT / "train.jsonl"), split="train")
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model)
    privacy = PrivacyConfig(target_epsilon=8.0, batch_size=8, max_grad_norm=1.0)
    with pytest.raises(ConfigError, match="packing=True puts several examples in one row"):
        PrivateSFTTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_chat_model),
                          args=sft_config(tmp_path, packing=True, max_length=64), train_dataset=conversations,
                          processing_class=tokenizer, privacy=privacy)
    trainer = PrivateSFTTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_chat_model),
                                args=sft_config(tmp_path, max_steps=2), train_dataset=conversations,
                                processing_class=tokenizer, privacy=privacy, user_column="user")
    assert trainer.dpl_task == "causal_lm" and trainer.dpl_engine.plan.num_rows == 32
    assert trainer.dpl_engine.task_kind == "generation"  # the noise regime's warning cites generation's evidence
    trainer.train()
    assert trainer.dpl_engine.steps_done == 2 and trainer.state.log_history[-1]["epsilon"] > 0


def test_the_model_card_names_no_local_path_of_the_base_model(tiny_chat_model, tmp_path):
    """A base model loaded from a local file (as a .gguf is) is not named by its path in TRL's README.md."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    weights = tmp_path / "models" / "tiny.Q4_1.gguf"
    weights.parent.mkdir()
    weights.write_bytes(b"GGUF")
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model)
    model.config.name_or_path = str(weights)  # what from_pretrained(..., gguf_file=...) records
    conversations = datasets.load_dataset("json", data_files=str(CHAT / "train.jsonl"), split="train")
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model)
    trainer = PrivateSFTTrainer(model=model, args=sft_config(tmp_path, max_steps=1, max_length=64),
                                train_dataset=conversations, processing_class=tokenizer,
                                privacy=PrivacyConfig(target_epsilon=8.0, batch_size=8))
    trainer.create_model_card(model_name="sft")
    card = (tmp_path / "sft" / "README.md").read_text()
    assert "# Model Card for sft" in card and str(tmp_path) not in card and "gguf" not in card
    assert model.config.name_or_path == str(weights)  # the model's own config is left as it was
