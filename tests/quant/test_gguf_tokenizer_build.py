"""The tokenizer a GGUF's metadata gives (``gguf_loader.tokenizer_dir``): for a byte-level BPE file
of a llama/Qwen family model it is built as the fast tokenizer directly, skipping AutoTokenizer's
re-derivation of the model config from the file (seconds for a real vocabulary, issue 14's
start-up); the files it saves are byte for byte those AutoTokenizer's route saves."""
from __future__ import annotations

import pytest
from gguf_files import tokenizer_vocab, write_llama_gguf

from appliance.models import gguf_loader


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    return write_llama_gguf(tmp_path_factory.mktemp("tok") / "bpe.gguf", tokenizer_vocab(), {"token_embd.weight": "Q8_0"},
                            layers=1, hidden=64, ffn=128, n_head=2, n_kv=1)


def _meta_config(path):
    reader = gguf_loader.open_gguf(path)
    meta = gguf_loader._read_metadata(reader, path)
    return meta, gguf_loader._build_configs(reader, meta, path)[0]


def test_direct_build_saves_what_autotokenizer_saves(gguf_file, tmp_path):
    meta, config = _meta_config(gguf_file)
    assert meta["tokenizer.ggml.model"] == "gpt2" and config["model_type"] == "llama"
    for name, auto in (("auto", True), ("direct", False)):
        (tmp_path / name).mkdir()
        gguf_loader._write_tokenizer(tmp_path / name, gguf_file, meta, config, through_auto=auto)
    auto_files = sorted(p.name for p in (tmp_path / "auto").iterdir())
    assert auto_files == sorted(p.name for p in (tmp_path / "direct").iterdir())
    assert "tokenizer.json" in auto_files
    for f in auto_files:
        assert (tmp_path / "auto" / f).read_bytes() == (tmp_path / "direct" / f).read_bytes(), f


def test_a_bpe_llama_file_does_not_go_through_autotokenizer(gguf_file, tmp_path, monkeypatch):
    import json

    import transformers

    def refuse(*a, **k):
        raise AssertionError("AutoTokenizer was used")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    meta, config = _meta_config(gguf_file)
    gguf_loader._write_tokenizer(tmp_path, gguf_file, meta, config)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and (tmp_path / "tokenizer.json").is_file()


def test_other_tokenizer_models_still_go_through_autotokenizer(gguf_file, tmp_path, monkeypatch):
    """A sentencepiece ("llama") vocabulary or another model type: AutoTokenizer's class may build
    differently (LlamaTokenizer, GemmaTokenizer, Mistral's), so it is still asked."""
    import transformers

    asked = []

    def stand_in(*a, **k):
        asked.append(a)
        raise RuntimeError("stand-in")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", stand_in)
    meta, config = _meta_config(gguf_file)
    for m, model_type in ((dict(meta, **{"tokenizer.ggml.model": "llama"}), "llama"), (meta, "gemma3_text"),
                          (meta, "mistral")):
        with pytest.raises(gguf_loader.ModelLoadError, match="stand-in"):
            gguf_loader._write_tokenizer(tmp_path, gguf_file, m, dict(config, model_type=model_type))
    assert len(asked) == 3
