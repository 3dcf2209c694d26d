"""Teacher-forced perplexity over text that ships with the machine, for benchmarks/quantized.py: our engine through
``prompt_logprobs`` and llama.cpp's ``llama-perplexity`` on the same text and GGUF file (where the shared bench kit
built it).

The text: Debian's GPL-3, Apache-2.0 and GFDL-1.3 license files (/usr/share/common-licenses, on every Debian /
Ubuntu machine), joined and tokenized once, cut into consecutive windows of ``WINDOW`` tokens; each window is one
prompt. Two scores from the same windows: every token after the window's first (``every``), and the tokens
``WINDOW / 2 + 1 .. WINDOW - 1`` of each window (``second_half``: the first half is only context), which is what
``llama-perplexity`` scores: it tokenizes the same file without a BOS (the GGUF's ``add_bos_token`` is false), cuts
the same consecutive ``-c WINDOW`` chunks and scores from ``first = n_ctx / 2`` on. With its KV cache in f32 (as
ours) the two second-half numbers differ only by the arithmetic (its Q4_1 x Q8_1 dot products, our GEMMs), as long
as the two tokenizers agree on the text. They do not on SmolLM2 (llama.cpp 0.3.36's vendored build): its ``smollm``
pre-tokenizer keeps a run of spaces before a digit or word whole ("\\n\\n  0" -> "\\n\\n  ", "0"), where the
tokenizer.json's (ours, transformers') leaves the last space to the next piece ("\\n\\n ", " ", "0"); 15,055 tokens
against 15,095, the first difference at token 795. So ``second_half_theirs`` runs our engine on llama.cpp's own ids
(``llama_cpp_tokens``, from ``llama-tokenize``) in the same windows: the same tokens, positions and scored set.
"""
from __future__ import annotations

import math
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.offline import LLM

LICENSE_TEXTS = tuple(Path("/usr/share/common-licenses") / name for name in ("GPL-3", "Apache-2.0", "GFDL-1.3"))
WINDOW = 1024
FIRST_SCORED = WINDOW // 2  # llama-perplexity's ``first``: it scores the tokens after it in each window


@dataclass(frozen=True)
class Perplexity:
    tokens: int  # tokens scored
    value: float


@dataclass(frozen=True)
class WindowScores:
    every: Perplexity  # every token after its window's first
    second_half: Perplexity  # tokens FIRST_SCORED + 1 .. WINDOW - 1 of each window (llama-perplexity's)
    # the same, over the windows of llama.cpp's own tokens of the text (llama_cpp_tokens), where given
    second_half_theirs: Perplexity | None = None


def _perplexity(logprobs: list[float]) -> Perplexity:
    return Perplexity(len(logprobs), math.exp(-sum(logprobs) / len(logprobs)))


def corpus_text() -> str:
    missing = [str(path) for path in LICENSE_TEXTS if not path.is_file()]
    if missing:
        raise FileNotFoundError(f"perplexity text missing: {', '.join(missing)} (Debian's base-files ships them)")
    return "\n\n".join(path.read_text() for path in LICENSE_TEXTS)


def corpus_ids(llm: LLM, text: str) -> list[int]:
    return llm.engine.tokenizer.encode(text, add_special_tokens=False)


def token_windows(ids: list[int], max_windows: int) -> list[list[int]]:
    return [ids[start:start + WINDOW] for start in range(0, len(ids) - WINDOW + 1, WINDOW)][:max_windows]


def _window_logprobs(llm: LLM, windows: list[list[int]]) -> list[list[float]]:
    results = llm.generate(windows, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    # entry k of a window is its token k + 1 (nothing predicts the first)
    return [[entry.logprob for entry in result.prompt_logprobs.entries] for result in results]


def _second_halves(per_window: list[list[float]]) -> Perplexity:
    return _perplexity([lp for window in per_window for lp in window[FIRST_SCORED:]])


def engine_perplexity(llm: LLM, windows: list[list[int]],
                      their_windows: list[list[int]] | None = None) -> WindowScores:
    """Ours over ``windows`` (our tokens), and the second halves over ``their_windows`` (llama.cpp's) if given."""
    per_window = _window_logprobs(llm, windows)
    theirs = None if their_windows is None else _second_halves(_window_logprobs(llm, their_windows))
    return WindowScores(_perplexity([lp for window in per_window for lp in window]), _second_halves(per_window),
                        theirs)


def write_text(text: str, scratch: Path) -> Path:
    path = scratch / "perplexity_text.txt"
    path.write_text(text)
    return path


def llama_cpp_tokens(binary: Path, model: Path, text_file: Path) -> list[int]:
    """``llama-tokenize``'s ids for the file, as llama-perplexity tokenizes it (the model's BOS rule, no special
    tokens parsed)."""
    done = subprocess.run([str(binary), "-m", str(model), "-f", str(text_file), "--ids", "--log-disable"],
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("[")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"llama-tokenize failed ({done.returncode}): {done.stderr[-1000:]}")
    return [int(t) for t in lines[-1].strip("[]").split(",") if t.strip()]


def llama_cpp_perplexity(binary: Path, model: Path, text_file: Path, windows: int, threads: int) -> Perplexity:
    """llama-perplexity's final estimate on the file's first ``windows`` chunks of WINDOW tokens, KV cache in f32."""
    done = subprocess.run([str(binary), "-m", str(model), "-f", str(text_file), "-c", str(WINDOW),
                           "--chunks", str(windows), "-t", str(threads), "-ctk", "f32", "-ctv", "f32"],
                          capture_output=True, text=True, timeout=1800)
    log = done.stdout + done.stderr
    match = re.search(r"Final estimate: PPL = ([\d.]+)", log)
    chunks = re.search(r"calculating perplexity over (\d+) chunks", log)
    if done.returncode != 0 or match is None or chunks is None:
        raise RuntimeError(f"llama-perplexity failed ({done.returncode}): {done.stderr[-1000:]}")
    return Perplexity(int(chunks[1]) * (WINDOW - FIRST_SCORED - 1), float(match[1]))
