"""``PromptClassificationDataModule``: classification files rendered into a cloze template for masked LMs.

Each example's text is placed into ``template`` (default ``"{sentence} It was [MASK]."``, MeZO's SST-2 prompt):
``{sentence}`` is the text column, ``[MASK]`` the tokenizer's mask token. The sentence alone is truncated, so the
template and its mask always survive ``max_length``. Files, checks, labels and batching are those of
:class:`~dpl.tasks.data.ClassificationDataModule`; pair it with :class:`~dpl.tasks.modules.prompt.DPPromptClassificationModule`.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from dpl.tasks.data.classification import ClassificationDataModule, SplitData, label_key
from dpl.errors import DataError

MASK = "[MASK]"
SLOT = "{sentence}"


def render_ids(tokenizer: Any, template: str, sentence: str, max_length: int) -> list[int]:
    """Token ids of ``template`` with the sentence in its slot (truncated to fit) and the mask token."""
    before, after = template.split(SLOT)
    mask = tokenizer.mask_token

    def ids(text: str) -> list[int]:
        return tokenizer(text.replace(MASK, mask), add_special_tokens=False)["input_ids"] if text.strip() else []

    prefix, suffix = ids(before), ids(after)
    start, end = special_tokens(tokenizer)
    budget = max_length - len(start) - len(end) - len(prefix) - len(suffix)
    if budget < 1:
        raise DataError(f"data.max_length = {max_length} leaves no room for the sentence in the template "
                        f"{template!r}")
    body = ids(sentence)[:budget]
    return start + prefix + body + suffix + end


def special_tokens(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer puts before and after a single text (BERT: [CLS] / [SEP])."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    for i in range(len(full) - len(plain) + 1):
        if full[i:i + len(plain)] == plain:
            return full[:i], full[i + len(plain):]
    raise DataError("cannot tell the tokenizer's special tokens apart from the text")


def _encode_prompt(batch: dict[str, list], tokenizer: Any, template: str, text_column: str, label_column: str,
                   label_map: dict[str, int], label_names: list[str] | None, max_length: int,
                   keep: tuple[str, ...]) -> dict[str, list]:
    rows = [render_ids(tokenizer, template, "" if t is None else str(t), max_length) for t in batch[text_column]]
    out: dict[str, list] = {"input_ids": rows}
    if "attention_mask" in keep:
        out["attention_mask"] = [[1] * len(r) for r in rows]
    if "token_type_ids" in keep:
        out["token_type_ids"] = [[0] * len(r) for r in rows]
    out["labels"] = [label_map[label_key(v, label_names)] for v in batch[label_column]]
    return out


class PromptClassificationDataModule(ClassificationDataModule):
    """Classification data rendered into a masked-LM prompt (MeZO / LM-BFF style).

    Args:
        template: the prompt, with ``{sentence}`` (the text column) and ``[MASK]`` (the tokenizer's mask token)
            each exactly once. Default: MeZO's SST-2 prompt ``"{sentence} It was [MASK]."``.
        user_column: column (generation readers: record field) naming the user who owns each row, for
            privacy.unit: user; rows of one user form one privacy unit.
        everything else: see :class:`~dpl.tasks.data.ClassificationDataModule` (no text pairs).
    """

    def __init__(self, tokenizer: str, template: str = "{sentence} It was [MASK].", data_dir: str | None = None,
                 train_file: str | None = None, val_file: str | None = None, test_file: str | None = None,
                 text_column: str = "sentence", label_column: str = "label", labels: list[str | int] | None = None,
                 max_length: int = 128, eval_batch_size: int = 64, num_workers: int = 0,
                 max_train_examples: int | None = None, max_eval_examples: int | None = None,
                 cache_dir: str | None = None, user_column: str | None = None) -> None:
        if template.count(SLOT) != 1 or template.count(MASK) != 1:
            raise DataError(f"data.template must contain {SLOT} and {MASK} exactly once, got {template!r}")
        super().__init__(tokenizer=tokenizer, data_dir=data_dir, train_file=train_file, val_file=val_file,
                         test_file=test_file, text_column=text_column, label_column=label_column, labels=labels,
                         max_length=max_length, eval_batch_size=eval_batch_size, num_workers=num_workers,
                         max_train_examples=max_train_examples, max_eval_examples=max_eval_examples,
                         cache_dir=cache_dir, user_column=user_column)
        self.template = template

    @property
    def tokenizer(self) -> Any:
        tokenizer = super().tokenizer
        if getattr(tokenizer, "mask_token", None) is None:
            raise DataError(f"tokenizer {self.tokenizer_location!r} has no mask token: prompts need a masked LM")
        return tokenizer

    def probe_row(self, ids: list[int]) -> list[int]:
        """The mask token last: the model reads its prediction there."""
        return [*ids[:-1], int(self.tokenizer.mask_token_id)]

    def _encoder(self, split: SplitData) -> tuple[Any, list[Any]]:
        fn = partial(_encode_prompt, tokenizer=self.tokenizer, template=self.template, text_column=self.text_column,
                     label_column=self.label_column, label_map=self.label_map, label_names=split.label_names,
                     max_length=self.max_length, keep=self._input_keys)
        return fn, ["dpl-prompt-v1", self.template, self.text_column]
