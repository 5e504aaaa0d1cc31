"""The tokenizer of a GGUF model without transformers on the start-up path (issue 14, "a start-up of
seconds": importing transformers for ``AutoTokenizer`` was the largest piece of a warm GGUF start).

A GGUF's tokenizer directory (``gguf_loader.tokenizer_dir``: ``tokenizer.json`` and a
``tokenizer_config.json`` naming ``PreTrainedTokenizerFast``) is what transformers loads as its
plain fast tokenizer; ``GGUFTokenizer`` loads the same ``tokenizer.json`` with the Rust
``tokenizers`` library and does, for what the engine and the server use, what that tokenizer does:
``encode``, ``decode``, the special tokens, the vocabulary, ``convert_tokens_to_ids`` /
``convert_ids_to_tokens`` and ``apply_chat_template`` (rendered with jinja2 in a sandbox set up as
transformers sets up its own: the same filters, globals, ``{% generation %}`` tag, message
normalisation and ``continue_final_message`` handling). Anything else (``__call__``, tokenizing
chat templates, batched chats, control-token sanitising, ``save_pretrained``...) is handed to the
transformers tokenizer, built on first use. ``tests/unit/test_gguf_tokenizer.py`` compares the two on
the GGUF files the tests write and the default model.

A directory that holds anything this class does not reproduce (truncation or padding in the
backend, a named special token that is not an added token, config keys it does not know) is loaded
by transformers as before; so are model directories and ``--tokenizer``.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path

# tokenizer_config.json keys a GGUF tokenizer directory holds (gguf_loader._write_tokenizer) whose
# meaning this class reproduces; a directory with any other key is loaded by transformers.
_KNOWN_CONFIG_KEYS = frozenset({"backend", "tokenizer_class", "model_max_length", "chat_template", "add_prefix_space",
                                "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                                "mask_token"})
# transformers' named special tokens, in its order (``special_tokens_map``)
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Names a message's reasoning comes under; the first is the one chat templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# apply_chat_template arguments rendered here; any other non-default one goes to transformers.
_DELEGATED_DEFAULTS = {"sanitize_control_tokens": False, "padding": False, "truncation": False, "max_length": None,
                       "return_tensors": None, "return_assistant_tokens_mask": False, "tokenizer_kwargs": None}


def load_tokenizer(path: str | Path, from_gguf: bool = False):
    """The tokenizer in directory ``path``: a ``GGUFTokenizer`` when ``from_gguf`` (the directory was
    built from a GGUF's metadata) and it holds only what that class reproduces, else transformers'
    ``AutoTokenizer``. Errors from a bad directory propagate (callers name the model)."""
    path = Path(path)
    if from_gguf:
        tok = GGUFTokenizer.open(path)
        if tok is not None:
            return tok
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _backend(tj_path: Path):
    """The ``tokenizers.Tokenizer`` of a ``tokenizer.json``. A BPE model's vocabulary and merges are
    handed to ``tokenizers.models.BPE`` from Python rather than deserialized by ``from_file``, which
    leaves ~14 MiB more resident for a 152k-token vocabulary (tokenizers 0.23, after ``malloc_trim``:
    45 vs 31 MiB; issue 14's resident memory) at about the same load time. The rest is what
    ``from_file`` does: the other components from the file, then the model, then the added tokens
    added in the file's order (each id the model's when it has the token, as ``from_file`` does).
    Anything else (another model type, merges not as pairs, an option ``BPE`` does not take) is
    loaded by ``from_str`` as it is."""
    import tokenizers
    from tokenizers import AddedToken, models

    text = tj_path.read_text(encoding="utf-8")
    spec = json.loads(text)
    model, added = spec.get("model"), spec.get("added_tokens") or []
    if not (isinstance(model, dict) and model.get("type") == "BPE" and isinstance(model.get("vocab"), dict)
            and isinstance(model.get("merges"), list)
            and all(isinstance(m, list) and len(m) == 2 for m in model["merges"])
            and all(isinstance(t, dict) and isinstance(t.get("content"), str) for t in added)):
        return tokenizers.Tokenizer.from_str(text)
    options = {k: v for k, v in model.items() if k not in ("type", "vocab", "merges") and v is not None}
    try:
        bpe = models.BPE(model["vocab"], [tuple(m) for m in model["merges"]], **options)
    except TypeError:  # an option this tokenizers' BPE does not take
        return tokenizers.Tokenizer.from_str(text)
    del text
    model["vocab"], model["merges"], spec["added_tokens"] = {}, [], []
    backend = tokenizers.Tokenizer.from_str(json.dumps(spec))
    backend.model = bpe
    backend.add_tokens([AddedToken(t["content"], single_word=t.get("single_word", False), lstrip=t.get("lstrip", False),
                                   rstrip=t.get("rstrip", False), normalized=t.get("normalized", True),
                                   special=t.get("special", False)) for t in added])
    return backend


def _token_text(value) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):  # a saved AddedToken
        return value["content"]
    raise ValueError(f"unexpected special token entry {value!r}")


class GGUFTokenizer:
    """A GGUF model's fast tokenizer on the ``tokenizers`` library alone (see the module docstring)."""

    is_fast = True

    def __init__(self, path: Path, backend, config: dict, chat_template: str | None):
        self.name_or_path = str(path)
        self._tokenizer = backend  # the attribute name transformers uses (detokenizer, llguidance)
        self._config = config
        self.chat_template = chat_template
        self.model_max_length = config.get("model_max_length")
        self.clean_up_tokenization_spaces = False
        self._special = {k: _token_text(config.get(k)) for k in _SPECIAL_NAMES}
        self._hf = None

    @classmethod
    def open(cls, path: Path) -> "GGUFTokenizer | None":
        """The tokenizer of ``path``, or None when the directory needs transformers."""
        import tokenizers
        from tokenizers import processors

        cfg_path, tj_path = path / "tokenizer_config.json", path / "tokenizer.json"
        if not (cfg_path.is_file() and tj_path.is_file()):
            return None
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
        if config.get("tokenizer_class") != "PreTrainedTokenizerFast" or config.get("backend", "tokenizers") != \
                "tokenizers" or not set(config) <= _KNOWN_CONFIG_KEYS:
            return None
        backend = _backend(tj_path)
        if backend.truncation is not None or backend.padding is not None:
            return None
        added = {t.content for t in backend.get_added_tokens_decoder().values()}
        specials = [_token_text(config.get(k)) for k in _SPECIAL_NAMES]
        if any(s is not None and s not in added for s in specials):
            return None  # transformers would add it to the backend first
        if backend.post_processor is None:  # what transformers sets when there is none (no BOS/EOS added)
            backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1",
                                                                   special_tokens=[])
        template = config.get("chat_template")
        jinja = path / "chat_template.jinja"  # transformers reads this file first
        if jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        return cls(path, backend, config, template)

    # -- transformers, for what is not reproduced here -------------------------------------------
    def hf_tokenizer(self):
        """transformers' tokenizer of the same directory (imported and built on first use)."""
        if self._hf is None:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(self.name_or_path)
        return self._hf

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.hf_tokenizer(), name)

    def __call__(self, *args, **kwargs):
        return self.hf_tokenizer()(*args, **kwargs)

    def __repr__(self) -> str:
        return f"GGUFTokenizer({self.name_or_path!r}, vocab={len(self)})"

    # -- vocabulary and special tokens -----------------------------------------------------------
    @property
    def backend_tokenizer(self):
        return self._tokenizer

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {k: v for k, v in self._special.items() if v is not None}

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys(self.special_tokens_map.values()))

    @property
    def all_special_ids(self) -> list[int]:
        return [self.convert_tokens_to_ids(t) for t in self.all_special_tokens]

    def convert_tokens_to_ids(self, tokens):
        if tokens is None:
            return None
        if isinstance(tokens, str):
            tid = self._tokenizer.token_to_id(tokens)
            return self.unk_token_id if tid is None else tid
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        special = set(self.all_special_ids) if skip_special_tokens else ()
        return [self._tokenizer.id_to_token(i) for i in ids if i not in special]

    def _special_id(self, name: str) -> int | None:
        text = self._special[name]
        return None if text is None else self.convert_tokens_to_ids(text)

    bos_token = property(lambda self: self._special["bos_token"])
    eos_token = property(lambda self: self._special["eos_token"])
    unk_token = property(lambda self: self._special["unk_token"])
    pad_token = property(lambda self: self._special["pad_token"])
    sep_token = property(lambda self: self._special["sep_token"])
    cls_token = property(lambda self: self._special["cls_token"])
    mask_token = property(lambda self: self._special["mask_token"])
    bos_token_id = property(lambda self: self._special_id("bos_token"))
    eos_token_id = property(lambda self: self._special_id("eos_token"))
    pad_token_id = property(lambda self: self._special_id("pad_token"))
    sep_token_id = property(lambda self: self._special_id("sep_token"))
    cls_token_id = property(lambda self: self._special_id("cls_token"))
    mask_token_id = property(lambda self: self._special_id("mask_token"))

    @property
    def unk_token_id(self) -> int | None:
        text = self._special["unk_token"]
        return None if text is None else self._tokenizer.token_to_id(text)

    # -- text ------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True, **kwargs) -> list[int]:
        if kwargs or not isinstance(text, str):  # pairs, truncation, tensors...: transformers
            return self.hf_tokenizer().encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None,
               **kwargs) -> str:
        if kwargs or clean_up_tokenization_spaces:  # the clean-up (a no-op for BPE) and the rest: transformers
            return self.hf_tokenizer().decode(token_ids, skip_special_tokens=skip_special_tokens,
                                              clean_up_tokenization_spaces=clean_up_tokenization_spaces, **kwargs)
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        elif not isinstance(token_ids, list):
            token_ids = [int(t) for t in token_ids]  # tuples, numpy / torch vectors
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences, **kwargs) -> list[str]:
        return [self.decode(s, **kwargs) for s in sequences]

    # -- chat ------------------------------------------------------------------------------------
    def apply_chat_template(self, conversation, tools=None, documents=None, chat_template: str | None = None,
                            add_generation_prompt: bool = False, continue_final_message: bool | str = False,
                            tokenize: bool = True, **kwargs):
        """transformers' ``apply_chat_template`` for one conversation rendered to text (``tokenize=False``)
        with tools given as JSON schemas; other uses are handed to transformers."""
        delegated = {k: kwargs.pop(k) for k in list(kwargs) if k in _DELEGATED_DEFAULTS or k == "return_dict"}
        if (tokenize or any(delegated.get(k, d) != d for k, d in _DELEGATED_DEFAULTS.items())
                or (tools is not None and not all(isinstance(t, dict) for t in tools))
                or not isinstance(conversation, (list, tuple))
                or (conversation and (isinstance(conversation[0], (list, tuple)) or hasattr(conversation[0], "messages")))):
            return self.hf_tokenizer().apply_chat_template(
                conversation, tools=tools, documents=documents, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                tokenize=tokenize, **delegated, **kwargs)
        template = self.chat_template if chat_template is None else chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template (tokenizer.chat_template is not set) and none "
                             "was passed as chat_template")
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible")
        return render_chat(template, conversation, tools=tools, documents=documents,
                           add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                           **{**self.special_tokens_map, **kwargs})


# -- chat template rendering (transformers' semantics, see the module docstring) --------------------

def _plain(value):
    """What a template may see: JSON-like data rebuilt from ``value`` (str/int/float subclasses cut
    back to the base type, dataclasses and pydantic models as dicts); other objects become an inert
    ``<TypeName>`` placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if type(value).__module__ == "numpy" and hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        return _plain(value.item())  # numpy scalars (np.bool_(False) must stay falsy)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _as_dicts(value):
    """Message objects (dataclasses, pydantic models) as dicts, recursively; the rest unchanged."""
    if isinstance(value, Mapping):
        return {k: _as_dicts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_dicts(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_as_dicts(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _as_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _as_dicts(value.model_dump())
    return value


def render_chat(template: str, messages, tools=None, documents=None, add_generation_prompt: bool = False,
                continue_final_message: bool | str = False, **variables) -> str:
    """One conversation through ``template``: messages normalised (objects to dicts, keys whose value
    is None dropped, reasoning copied under its other names), everything the template sees made plain
    data, and with ``continue_final_message`` the text cut right after the final message's
    ``content`` (or the named field) so that the model continues it."""
    chat = []
    for m in _as_dicts(list(messages)):
        if not isinstance(m, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {m!r}.")
        chat.append({k: v for k, v in m.items() if v is not None})
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    tools, documents, variables = _plain(tools), _plain(documents), _plain(variables)
    chat = _plain(chat)
    aliased = []
    for m in chat:
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        aliased.append(m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning})
    chat = aliased
    final = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final = chat[-1].get(field)
        if final is None:
            raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue!')
        fields = [field] if field not in _REASONING_FIELDS else [f for f in _REASONING_FIELDS if chat[-1].get(f) == final]
        if not any(f in template for f in fields):
            raise ValueError(f'continue_final_message is set to "{field}" but this is not an accepted field in the '
                             f'chat_template')
        if isinstance(final, (list, tuple)):
            for block in reversed(final):
                if "text" in block:
                    final = block["text"]
                    block["text"] = block["text"] + _CONTINUE_TAG
                    break
            else:
                raise ValueError("continue_final_message is set but we could not find any text to continue in the "
                                 "final message!")
        else:
            for f in fields:
                chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    text = _compile(template).render(messages=chat, tools=tools, documents=documents,
                                     add_generation_prompt=add_generation_prompt, **variables)
    if continue_final_message:
        tag = _CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise ValueError("continue_final_message is set but the final message does not appear in the chat after "
                             f"applying the chat template. Final message to continue: {final.strip()}")
        at = text.rindex(tag)
        text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text


@lru_cache(maxsize=16)
def _compile(template: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (marks assistant text): renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # not jinja's own: that one escapes HTML characters
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        from datetime import datetime

        return datetime.now().strftime(fmt)

    class PlainDict:
        """``dict(...)`` and ``dict.fromkeys`` in a template, nothing more of the type."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class Namespace(jinja2.utils.Namespace):
        """jinja's namespace refusing underscore names (no way to CPython internals)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=PlainDict(),
                       namespace=Namespace)
    return env.from_string(template)
