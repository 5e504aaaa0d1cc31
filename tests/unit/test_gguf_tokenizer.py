"""``GGUFTokenizer`` (appliance/engine/tokenizer.py), a GGUF model's tokenizer on the ``tokenizers``
library alone, against transformers' tokenizer of the same directory (the reference: what the engine
used before): token ids, decoded text, special tokens, vocabulary and chat-template text, on the
default model's GGUF, a llama GGUF written by the test (byte-level BPE, built without AutoTokenizer)
and a Gemma 3 GGUF (built through AutoTokenizer), over unicode, special tokens in text, and chat
templates with system messages, tools, tool calls, reasoning and continued final messages."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from appliance.engine.tokenizer import GGUFTokenizer, load_tokenizer
from appliance.models.gguf_loader import tokenizer_dir

TEXTS = [
    "", " ", "Hello, world!", "The capital of France is", "  leading and trailing  ", "\n\n\ttabs\r\nand CRLF\n",
    "naïve café — “quotes” and ‘single’ … ½ × ÷ ≠ ∞", "日本語のテキストと中文混合", "한국어 텍스트", "Ελληνικά και русский",
    "emoji 😀👍🏽👨‍👩‍👧 flags 🇫🇷", "عربى مع أرقام ١٢٣", "combining e\u0301 and zero\u200bwidth",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "text<|endoftext|>more <|im_end|>x",
    "def f(x):\n    return x ** 2  # code\n", "1234567890 3.14159 -42 1e-9", "a" * 300, "!!!???...,,,;;;",
    "<unk> <s> </s> <pad> [PAD] <|fake|>",
]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city — ünïcode",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}

# exercises what transformers' environment adds: tojson (no HTML escaping, indent), raise_exception,
# namespace, dict(), loopcontrols, {% generation %}, trim/lstrip blocks and the special-token variables
RICH = """\
{%- set ns = namespace(sys='') -%}
{%- for m in messages if m.role == 'system' %}{% set ns.sys = ns.sys + m.content %}{% endfor -%}
{{ bos_token }}[SYS]{{ ns.sys }}[/SYS]
{% if tools %}
[TOOLS]{{ tools | tojson }}
{{ tools[0] | tojson(indent=2) }}[/TOOLS]
{% endif %}
{% for m in messages %}
  {% if m.role == 'system' %}{% continue %}{% endif %}
  {% if m.role not in ['user', 'assistant', 'tool'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}
  {% if m.role == 'assistant' %}
<a>{% generation %}{{ m.content }}{% if m.reasoning_content is defined %}(think: {{ m.reasoning_content }}){% endif %}
{% for tc in m.tool_calls or [] %}<call>{{ tc.function.name }} {{ tc.function.arguments | tojson }}</call>{% endfor %}
{{ eos_token }}{% endgeneration %}</a>
  {% else %}
<{{ m.role }}>{{ m.content if m.content is string else (m.content | map(attribute='text') | join(' ')) }}</{{ m.role }}>
  {% endif %}
{% endfor %}
{%- set d = dict(a=1, b='<&>') -%}
{{ d | tojson }}{{ extra_var | default('') }}
{%- if add_generation_prompt %}<a>{% endif %}"""

SIMPLE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

CHATS = [
    [{"role": "user", "content": "Hi there 😀"}],
    [{"role": "system", "content": "Be terse. «ok»"}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And <|im_end|> 3+3?"}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": '{"temp": 21}'}, {"role": "user", "content": "thanks"}],
    [{"role": "user", "content": "think first"}, {"role": "assistant", "content": "Sure", "reasoning": "hmm..."}],
    [{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]}],
    [{"role": "user", "content": "drop me", "name": None}],
]


def _default_gguf():
    from appliance.models.default_model import default_gguf_path

    return default_gguf_path()


def _llama_gguf(tmp):
    from gguf_files import tokenizer_vocab, write_llama_gguf

    return write_llama_gguf(tmp / "bpe.gguf", tokenizer_vocab(), {"token_embd.weight": "Q8_0"},
                            layers=1, hidden=64, ffn=128, n_head=2, n_kv=1)


def _gemma_gguf(tmp, tiny_model_dir):
    from appliance.bench.gguf_export import write_gguf

    return write_gguf(tiny_model_dir("gemma3", False, 2, num_hidden_layers=2, query_pre_attn_scalar=16), tmp / "gemma3.gguf")


@pytest.fixture(scope="module", params=["default", "llama", "gemma3"])
def pair(request, tmp_path_factory, tiny_model_dir):
    """(GGUFTokenizer, transformers' tokenizer) of one GGUF's tokenizer directory."""
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("gguf-tok")
    gguf_path = {"default": _default_gguf, "llama": lambda: _llama_gguf(tmp),
                 "gemma3": lambda: _gemma_gguf(tmp, tiny_model_dir)}[request.param]()
    d = tokenizer_dir(gguf_path, tmp / "cache")
    ours = load_tokenizer(d, from_gguf=True)
    assert type(ours) is GGUFTokenizer, f"{request.param}: the directory was not loaded without transformers"
    return ours, AutoTokenizer.from_pretrained(str(d))


def test_backend_is_the_one_transformers_builds(pair):
    ours, hf = pair
    assert ours.backend_tokenizer.to_str() == hf.backend_tokenizer.to_str()


def test_vocabulary_and_special_tokens(pair):
    ours, hf = pair
    assert len(ours) == len(hf) and ours.vocab_size == hf.vocab_size and ours.get_vocab() == hf.get_vocab()
    assert ours.special_tokens_map == hf.special_tokens_map
    for name in ("bos", "eos", "unk", "pad", "sep", "cls", "mask"):
        assert getattr(ours, f"{name}_token") == getattr(hf, f"{name}_token"), name
        assert getattr(ours, f"{name}_token_id") == getattr(hf, f"{name}_token_id"), name
    assert ours.all_special_tokens == hf.all_special_tokens and ours.all_special_ids == hf.all_special_ids
    probe = ["<|im_end|>", "<|im_start|>", "<end_of_turn>", "<|eot_id|>", "hello", "not-a-token-xyz", ""]
    assert ours.convert_tokens_to_ids(probe) == hf.convert_tokens_to_ids(probe)
    for t in probe:
        assert ours.convert_tokens_to_ids(t) == hf.convert_tokens_to_ids(t), t
    ids = list(range(0, len(hf), max(1, len(hf) // 500))) + [len(hf) - 1] + hf.all_special_ids
    assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert ours.convert_ids_to_tokens(ids, skip_special_tokens=True) == hf.convert_ids_to_tokens(
        ids, skip_special_tokens=True)
    assert ours.chat_template == hf.chat_template


@pytest.mark.parametrize("add_special", [True, False])
def test_encode_and_decode(pair, add_special):
    ours, hf = pair
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=add_special)
        assert ids == hf.encode(text, add_special_tokens=add_special), text
        for skip in (False, True):
            for clean in (None, False, True):
                assert ours.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=clean) == hf.decode(
                    ids, skip_special_tokens=skip, clean_up_tokenization_spaces=clean), (text, skip, clean)
    every = list(range(len(hf)))  # each token alone and the whole vocabulary in one sequence
    assert [ours.decode(i) for i in every[:2000]] == [hf.decode(i) for i in every[:2000]]
    assert ours.decode(every, skip_special_tokens=True) == hf.decode(every, skip_special_tokens=True)
    assert ours.decode(tuple(every[:50])) == hf.decode(every[:50])


@pytest.mark.parametrize("template", ["own", "simple", "rich"])
def test_chat_templates(pair, template):
    ours, hf = pair
    kw = {} if template == "own" else {"chat_template": SIMPLE if template == "simple" else RICH}
    if template == "own" and hf.chat_template is None:
        with pytest.raises(ValueError):
            ours.apply_chat_template(CHATS[0], tokenize=False)
        return
    checked = 0
    for chat in CHATS:
        for tools in (None, [WEATHER]):
            for gen in (True, False):
                args = dict(tools=tools, add_generation_prompt=gen, tokenize=False, extra_var="!", **kw)
                try:
                    want = hf.apply_chat_template(chat, **args)
                except Exception as e:  # noqa: BLE001 - the template rejects this chat: so must ours
                    with pytest.raises(type(e)):
                        ours.apply_chat_template(chat, **args)
                    continue
                assert ours.apply_chat_template(chat, **args) == want, (chat, tools, gen)
                checked += 1
    assert checked >= len(CHATS)  # most combinations render


def test_continue_final_message(pair):
    ours, hf = pair
    chat = [{"role": "user", "content": "Name a city."}, {"role": "assistant", "content": "It is  "}]
    for template in (SIMPLE, RICH):
        args = dict(chat_template=template, tokenize=False, continue_final_message=True)
        assert ours.apply_chat_template(chat, **args) == hf.apply_chat_template(chat, **args)
    blocks = [{"role": "user", "content": "x"}, {"role": "assistant", "content": [{"type": "text", "text": "a"},
                                                                                  {"type": "text", "text": "b "}]}]
    args = dict(chat_template=RICH, tokenize=False, continue_final_message=True)
    assert ours.apply_chat_template(blocks, **args) == hf.apply_chat_template(blocks, **args)
    for bad in (dict(add_generation_prompt=True), dict(continue_final_message="nope")):
        with pytest.raises(ValueError):
            hf.apply_chat_template(chat, **{**args, "continue_final_message": True, **bad})
        with pytest.raises(ValueError):
            ours.apply_chat_template(chat, **{**args, "continue_final_message": True, **bad})


def test_template_errors_and_sandbox(pair):
    ours, _ = pair
    bad_role = [{"role": "robot", "content": "x"}]
    with pytest.raises(Exception, match="bad role robot"):
        ours.apply_chat_template(bad_role, chat_template=RICH, tokenize=False)
    import jinja2

    for evil in ("{{ ''.__class__.__mro__ }}", "{% set ns = namespace(_x=1) %}", "{{ messages.append(1) }}"):
        with pytest.raises(jinja2.exceptions.SecurityError):
            ours.apply_chat_template([{"role": "user", "content": "x"}], chat_template=evil, tokenize=False)


def test_message_objects_and_delegated_calls(pair):
    """Dataclass messages render as dicts; calls this class does not reproduce (tokenized chats,
    ``__call__``, batches) are transformers' own answers."""
    ours, hf = pair

    @dataclasses.dataclass
    class Msg:
        role: str
        content: str

    chat = [Msg("user", "hello")]
    assert ours.apply_chat_template(chat, chat_template=SIMPLE, tokenize=False) == hf.apply_chat_template(
        chat, chat_template=SIMPLE, tokenize=False)
    plain = [{"role": "user", "content": "hello"}]
    assert ours.apply_chat_template(plain, chat_template=SIMPLE) == hf.apply_chat_template(plain,
                                                                                          chat_template=SIMPLE)
    assert ours("a b c")["input_ids"] == hf("a b c")["input_ids"]
    assert ours.batch_decode([[1, 2], [3]]) == hf.batch_decode([[1, 2], [3]])


def test_structured_outputs_tokenizer_matches_llguidance_hf(pair):
    """The grammar engine's tokenizer built from the backend equals llguidance.hf's from transformers."""
    import llguidance.hf

    from appliance.structured.matchers import StructuredOutputs

    ours, hf = pair
    n = len(hf)
    lt = StructuredOutputs(ours, n, (hf.eos_token_id,) if hf.eos_token_id is not None else ()).tokenizer()
    ref = llguidance.hf.from_tokenizer(hf, n_vocab=n, eos_token=[hf.eos_token_id] if hf.eos_token_id is not None
                                       else None)
    assert lt.vocab_size == ref.vocab_size and lt.eos_token == ref.eos_token
    for text in TEXTS[:12]:
        assert lt.tokenize_str(text) == ref.tokenize_str(text), text
    assert [lt.decode_bytes([i]) for i in range(n)] == [ref.decode_bytes([i]) for i in range(n)]


def test_incremental_detokenizer_uses_the_backend(pair):
    from appliance.engine.detokenizer import IncrementalDetokenizer

    ours, hf = pair
    ids = ours.encode(TEXTS[6] + TEXTS[10] + TEXTS[7], add_special_tokens=False)
    texts = []
    for tok in (ours, hf):
        d = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
        for i in ids:
            d.add_tokens([i])
        d.flush()
        texts.append(d.text)
    assert texts[0] == texts[1] == hf.decode(ids, skip_special_tokens=True)


def test_directories_it_does_not_reproduce_go_to_transformers(pair, tmp_path):
    """A key it does not know, a named special token that is not an added token, or truncation in the
    backend: transformers' tokenizer, as before; a model directory (from_gguf False) too."""
    import shutil

    ours, _ = pair
    src = ours.name_or_path
    cases = {"key": lambda c, t: c.update(add_bos_token=True),
             "special": lambda c, t: c.update(eos_token="not-an-added-token-xyz"),
             "trunc": lambda c, t: t.update(truncation={"direction": "Right", "max_length": 8, "strategy":
                                                        "LongestFirst", "stride": 0})}
    for name, edit in cases.items():
        d = tmp_path / name
        shutil.copytree(src, d)
        cfg, tj = json.loads((d / "tokenizer_config.json").read_text()), json.loads((d / "tokenizer.json").read_text())
        edit(cfg, tj)
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
        (d / "tokenizer.json").write_text(json.dumps(tj))
        assert GGUFTokenizer.open(d) is None, name
        assert type(load_tokenizer(d, from_gguf=True)) is not GGUFTokenizer, name
    assert type(load_tokenizer(src, from_gguf=False)) is not GGUFTokenizer


def test_engine_loads_a_gguf_without_transformers(tmp_path):
    """The default model's engine, in a fresh process, ends its start-up and a chat round (template,
    encode, generation, detokenization) with transformers never imported."""
    code = ("import sys; from appliance import LLM; "
            "llm = LLM(None, dtype='float32', num_kv_blocks=64, max_model_len=256); "
            "from appliance.engine.tokenizer import GGUFTokenizer; "
            "assert type(llm.get_tokenizer()) is GGUFTokenizer; "
            "out = llm.chat([{'role': 'user', 'content': 'What is the capital of France?'}], "
            "   __import__('appliance').SamplingParams(max_tokens=8, temperature=0)); "
            "print('TEXT', repr(out[0].outputs[0].text)); "
            "print('TRANSFORMERS', 'transformers' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "TRANSFORMERS False" in r.stdout, r.stdout
    assert "Paris" in r.stdout, r.stdout


def _tokenizer_json(model: dict, added: list[dict]) -> dict:
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            "post_processor": None, "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                                                "use_regex": True}, "model": model}


@pytest.mark.parametrize("variant", ["bpe", "bpe_string_merges", "word_level"])
def test_backend_equals_from_file(tmp_path, variant):
    """``_backend`` builds a BPE model from Python (less resident than ``from_file``'s deserializer) and
    must give the tokenizer ``from_file`` gives: the same serialization and tokens, including added
    tokens the model also has under another id than the file declares (``from_file`` takes the
    model's), added tokens it lacks (appended after the vocabulary), and the cases it hands to
    ``from_str`` (merges as strings, another model type)."""
    import tokenizers

    from appliance.engine.tokenizer import _backend

    chars = ["a", "b", "c", "d", "Ġ", "h", "i"]
    merged = ["ab", "abc", "Ġa", "hi", "Ġhi"]
    vocab = {t: i for i, t in enumerate(["<s>", "</s>"] + chars + merged + ["<x>"])}
    merges = [["a", "b"], ["ab", "c"], ["Ġ", "a"], ["h", "i"], ["Ġ", "hi"]]
    added = [{"id": 0, "content": "<s>", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True},
             {"id": 5, "content": "<x>", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True},  # the model has it at another id
             {"id": 99, "content": "<new>", "single_word": True, "lstrip": True, "rstrip": False, "normalized": True,
              "special": False}]  # not in the model
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
             "vocab": vocab, "merges": merges}
    if variant == "bpe_string_merges":
        model["merges"] = [" ".join(m) for m in merges]
    elif variant == "word_level":
        model = {"type": "WordLevel", "vocab": vocab, "unk_token": "<s>"}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(_tokenizer_json(model, added)), encoding="utf-8")
    ours, ref = _backend(path), tokenizers.Tokenizer.from_file(str(path))
    assert json.loads(ours.to_str()) == json.loads(ref.to_str())
    assert ours.get_vocab(with_added_tokens=True) == ref.get_vocab(with_added_tokens=True)
    assert ours.token_to_id("<x>") == vocab["<x>"] and ours.token_to_id("<new>") == len(vocab)
    for text in ["abc hi", "<s>abcd <x> hi<new> ab", " hihi <new>", ""]:
        a, b = ours.encode(text), ref.encode(text)
        assert a.ids == b.ids and a.offsets == b.offsets and a.special_tokens_mask == b.special_tokens_mask, text
        assert ours.decode(a.ids, skip_special_tokens=True) == ref.decode(b.ids, skip_special_tokens=True)
