"""Tokenizer: text <-> token ids for the engine, built from a GGUF file's metadata or a Hugging Face directory.

Encoding and decoding run in the Rust ``tokenizers`` package. A GGUF file carries no ``tokenizer.json``, so
``from_gguf`` rebuilds an equivalent pipeline from llama.cpp's ``tokenizer.ggml.*`` keys, matching what
transformers builds for the same file (our oracle): byte-level BPE for ``gpt2`` files (SmolLM2, Llama-3, Qwen2)
and SentencePiece-style BPE with byte fallback for ``llama`` files. Chat templates render with a sandboxed
jinja2 environment configured like transformers', so ``apply_chat_template`` gives the same ids.

The streaming pieces (incremental detokenizer, stop strings) live in ``backend_lib.engine.detokenizer``, which
uses this module's ``Tokenizer``, never the reverse.
"""
from __future__ import annotations

import json
import os
from types import MappingProxyType
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as RustTokenizer

from backend_lib.core.errors import RequestError

__all__ = ["Tokenizer"]

# llama.cpp token types (gguf.TokenType): only these two become added tokens.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Pre-tokenizer split patterns, keyed by ``tokenizer.ggml.pre``. Files whose ``pre`` is not listed here (e.g.
# SmolLM2's "smollm", or "gpt2") use the GPT-2 pattern built into ByteLevel, as transformers does.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = MappingProxyType({
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT, "pixtral": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
})
_SUPPORTED_GGUF_MODELS = ("gpt2", "llama")


@dataclass(frozen=True)
class _Specials:
    """Special-token strings and ids a tokenizer exposes to the engine and to chat templates."""

    tokens: dict[str, str] = field(default_factory=dict)  # bos_token / eos_token / unk_token / pad_token -> text
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    extra_eos_ids: frozenset[int] = frozenset()


class Tokenizer:
    """Encode / decode / chat-template rendering over a ``tokenizers.Tokenizer`` backend."""

    def __init__(self, backend: RustTokenizer, specials: _Specials, chat_template: str | None) -> None:
        self._backend = backend
        self.bos_token_id: int | None = specials.bos_token_id
        self.eos_token_id: int | None = specials.eos_token_id
        eos = {specials.eos_token_id} if specials.eos_token_id is not None else set()
        self.eos_token_ids: frozenset[int] = frozenset(eos | set(specials.extra_eos_ids))
        self.chat_template: str | None = chat_template
        self._special_tokens = dict(specials.tokens)
        self._compiled_template: jinja2.Template | None = None

    # ------------------------------------------------------------------ loading

    @classmethod
    def load(cls, path: str) -> "Tokenizer":
        """A ``.gguf`` file or a Hugging Face directory holding ``tokenizer.json``."""
        if os.path.isdir(path):
            return cls.from_pretrained(path)
        if os.path.isfile(path) and path.endswith(".gguf"):
            return cls.from_gguf(path)
        raise ValueError(f"tokenizer path must be a .gguf file or a directory with tokenizer.json, got {path!r}")

    @classmethod
    def from_gguf(cls, path: str) -> "Tokenizer":
        """Rebuild the tokenizer described by the ``tokenizer.ggml.*`` metadata of a GGUF file."""
        meta = _read_gguf_tokenizer_metadata(path)
        kind = meta.get("tokenizer.ggml.model")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = meta.get("tokenizer.ggml.merges")
        if kind == "gpt2":
            backend = _byte_level_bpe(tokens, merges, meta.get("tokenizer.ggml.pre"))
            add_bos_default = False
        elif kind == "llama":
            backend = _sentencepiece_bpe(tokens, merges, meta.get("tokenizer.ggml.scores"))
            # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
            add_bos_default = True
        else:
            raise ValueError(
                f"unsupported GGUF tokenizer model tokenizer.ggml.model={kind!r}; supported: {_SUPPORTED_GGUF_MODELS}"
            )
        _add_gguf_added_tokens(backend, tokens, token_types, byte_level=(kind == "gpt2"))

        def token_at(key: str) -> str | None:
            index = meta.get(f"tokenizer.ggml.{key}")
            return tokens[index] if index is not None and 0 <= index < len(tokens) else None

        special_tokens = {name: token_at(key) for name, key in (
            ("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
            ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))}
        special_tokens = {name: text for name, text in special_tokens.items() if text is not None}
        bos_id = meta.get("tokenizer.ggml.bos_token_id")
        eos_id = meta.get("tokenizer.ggml.eos_token_id")
        # llama.cpp also ends generation at end-of-turn / end-of-message tokens (e.g. Llama-3's <|eot_id|>).
        extra = {meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta}
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        _set_post_processor(backend, special_tokens.get("bos_token") if add_bos else None,
                            special_tokens.get("eos_token") if add_eos else None)
        specials = _Specials(special_tokens, bos_id, eos_id, frozenset(extra))
        return cls(backend, specials, meta.get("tokenizer.chat_template"))

    @classmethod
    def from_pretrained(cls, directory: str) -> "Tokenizer":
        """A Hugging Face tokenizer directory: tokenizer.json, tokenizer_config.json, generation_config.json."""
        tokenizer_file = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise ValueError(f"tokenizer directory {directory!r} has no tokenizer.json")
        backend = RustTokenizer.from_file(tokenizer_file)
        config = _read_json(os.path.join(directory, "tokenizer_config.json"))
        special_map = _read_json(os.path.join(directory, "special_tokens_map.json"))
        special_tokens: dict[str, str] = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            text = _token_text(config.get(name, special_map.get(name)))
            if text is not None:
                special_tokens[name] = text
        # As in transformers 5, tokenizer.json's post-processor alone decides which specials encode() adds:
        # tokenizer_config.json's add_bos_token / add_eos_token are ignored when tokenizer.json exists.
        bos_id = _token_id(backend, special_tokens.get("bos_token"))
        eos_id = _token_id(backend, special_tokens.get("eos_token"))
        generation = _read_json(os.path.join(directory, "generation_config.json"))
        gen_eos = generation.get("eos_token_id")
        extra = {gen_eos} if isinstance(gen_eos, int) else set(gen_eos or [])
        specials = _Specials(special_tokens, bos_id, eos_id, frozenset(extra))
        return cls(backend, specials, _read_chat_template(directory, config))

    # ------------------------------------------------------------------ text <-> ids

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def get_vocab(self, with_added_tokens: bool = True) -> dict[str, int]:
        """Token (as the tokenizer model spells it: byte-level ``Ġa``, SentencePiece ``▁a``) -> id; the grammar
        compiler builds its vocabulary from it."""
        return self._backend.get_vocab(with_added_tokens=with_added_tokens)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise RequestError("text_input", f"text must be a str, got {type(text).__name__}")
        try:  # tokenizers raises TypeError on a lone surrogate (e.g. a JSON "\ud800" escape in messages)
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise RequestError("text_input", f"text is not valid Unicode: lone surrogate {text[exc.start]!r} at "
                               f"{exc.start}") from None
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def save_pretrained(self, directory: str) -> None:
        """A Hugging Face tokenizer directory (tokenizer.json + tokenizer_config.json), e.g. for tools that load
        tokenizers with transformers' AutoTokenizer while this machine cannot reach the hub."""
        os.makedirs(directory, exist_ok=True)
        self._backend.save(os.path.join(directory, "tokenizer.json"))
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        for name, token_id in (("bos_token", self.bos_token_id), ("eos_token", self.eos_token_id)):
            if token_id is not None:
                config[name] = self._backend.id_to_token(token_id)
        if self.chat_template:
            config["chat_template"] = self.chat_template
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as out:
            json.dump(config, out)

    # ------------------------------------------------------------------ chat

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        """The chat template rendered to text (with its special tokens written out); ``tools`` are the OpenAI
        request's function tools, given to the template as transformers gives them (templates without tool support
        ignore them)."""
        if self.chat_template is None:
            raise RequestError("messages", "this tokenizer has no chat_template; send a plain prompt instead of "
                               "messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages", "messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise RequestError("messages", f"messages[{index}] must be a dict with a string 'role', got "
                                   f"{message!r}")
        if self._compiled_template is None:
            self._compiled_template = _compile_chat_template(self.chat_template)
        # Templates test for missing keys, so None values (as OpenAI-style clients send) are dropped.
        cleaned = [{key: value for key, value in message.items() if value is not None} for message in messages]
        try:
            return self._compiled_template.render(
                messages=cleaned, tools=tools or None, documents=None, add_generation_prompt=add_generation_prompt,
                **self._special_tokens)  # tools / documents are defined (None when absent) as transformers passes them
        except (jinja2.TemplateError, TypeError) as exc:
            # The messages do not fit the template (a missing field, roles it refuses via raise_exception, a value
            # of a type it cannot format): the client's input, so a ValueError naming it, not an internal error.
            raise RequestError("messages", f"messages do not fit the model's chat template: {exc}") from exc

    def with_chat_template(self, chat_template: str | None) -> "Tokenizer":
        """The same tokenizer with another chat template (a deployment's override); the backend is shared."""
        specials = _Specials(self._special_tokens, self.bos_token_id, self.eos_token_id, self.eos_token_ids)
        return Tokenizer(self._backend, specials, chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> list[int]:
        # The template writes BOS itself where the model wants one, so no specials are added on encode.
        return self.encode(self.render_chat(messages, add_generation_prompt, tools), add_special_tokens=False)


# ---------------------------------------------------------------------- GGUF helpers


def _read_gguf_tokenizer_metadata(path: str) -> dict[str, Any]:
    from backend_lib.models.loading.gguf_file import GGUFFile  # only GGUF loading needs it

    metadata = {name: value for name, value in GGUFFile(path).fields.items()
                if name.startswith("tokenizer.") or name == "general.architecture"}
    if "tokenizer.ggml.tokens" not in metadata:
        raise ValueError(f"GGUF file {path!r} has no tokenizer.ggml.tokens metadata")
    return metadata


def _byte_level_bytes_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level_bpe(tokens: list[str], merges: list[str] | None, pre: str | None) -> RustTokenizer:
    if merges is None:
        raise ValueError("GGUF tokenizer.ggml.model='gpt2' needs tokenizer.ggml.merges, which the file lacks")
    spelling = _byte_level_bytes_alphabet()
    alphabet = set(spelling.values())
    # A token written outside the byte alphabet (a mislabelled added token) is respelled byte by byte.
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    backend = RustTokenizer(models.BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                                       end_of_word_suffix="", fuse_unk=False))
    split = _PRE_TOKENIZER_SPLITS.get(pre or "")
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(tokens: list[str], merges: list[str] | None, scores: list[float] | None) -> RustTokenizer:
    """SentencePiece BPE (Llama-2 / Mistral style): '▁' for spaces, <0xNN> byte-fallback tokens."""
    vocab = {token: index for index, token in enumerate(tokens)}
    if merges is not None:
        pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    elif scores is not None:
        pairs = _merges_from_scores(vocab, dict(zip(tokens, scores)))
    else:
        raise ValueError("GGUF tokenizer.ggml.model='llama' needs tokenizer.ggml.merges or tokenizer.ggml.scores")
    backend = RustTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True, dropout=None))
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(content=" ", left=1),
    ])
    return backend


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every (left, right) split of a vocabulary token into two vocabulary tokens, best-scored merge first."""
    candidates: list[tuple[str, str, float]] = []
    for merged, score in scores.items():
        local = [(merged[:i], merged[i:], score) for i in range(1, len(merged))
                 if merged[:i] in vocab and merged[i:] in vocab]
        local.sort(key=lambda item: (vocab[item[0]], vocab[item[1]]))
        candidates.extend(local)
    candidates.sort(key=lambda item: (item[2], len(item[0]), len(item[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]


def _add_gguf_added_tokens(backend: RustTokenizer, tokens: list[str], token_types: list[int],
                           byte_level: bool) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens: both match whole."""
    alphabet = set(_byte_level_bytes_alphabet().values()) if byte_level else None
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, token_types)
        # In a byte-level vocabulary a "control" token outside the byte alphabet is a llama.cpp mislabel.
        if kind == _TOKEN_TYPE_CONTROL and (alphabet is None or set(token) <= alphabet)
    ]
    if control:
        backend.add_special_tokens(control)
    user = [AddedToken(token, normalized=False, special=False)
            for token, kind in zip(tokens, token_types) if kind == _TOKEN_TYPE_USER_DEFINED]
    if user:
        backend.add_tokens(user)


# ---------------------------------------------------------------------- shared helpers


def _set_post_processor(backend: RustTokenizer, bos: str | None, eos: str | None) -> None:
    """encode(add_special_tokens=True) adds ``bos`` before and ``eos`` after the text when given."""
    single = " ".join(part for part in (f"{bos}:0" if bos else "", "$A:0", f"{eos}:0" if eos else "") if part)
    pair = single + " " + " ".join(
        part for part in (f"{bos}:1" if bos else "", "$B:1", f"{eos}:1" if eos else "") if part)
    specials = []
    for text in dict.fromkeys(t for t in (bos, eos) if t):
        token_id = backend.token_to_id(text)
        if token_id is None:
            raise ValueError(f"special token {text!r} is not in the vocabulary")
        specials.append((text, token_id))
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _token_id(backend: RustTokenizer, text: str | None) -> int | None:
    return backend.token_to_id(text) if text is not None else None


def _read_chat_template(directory: str, config: dict[str, Any]) -> str | None:
    jinja_file = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as handle:
            return handle.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {entry["name"]: entry["template"] for entry in template}
        return named.get("default")
    return template


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes; templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_chat_template(template: str) -> jinja2.Template:
    """A sandboxed environment set up like transformers' so templates render to the same text."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)
