"""Teacher-forced perplexity over text that ships with the machine, for benchmarks/quantized.py: our engine through
``prompt_logprobs`` and llama.cpp's ``llama-perplexity`` on the same text and GGUF file (where the shared bench kit
built it).

The text: Debian's GPL-3, Apache-2.0 and GFDL-1.3 license files (/usr/share/common-licenses, on every Debian /
Ubuntu machine), joined and tokenized once, cut into windows of ``WINDOW`` tokens; each window is one prompt, every
token after its first scored. llama-perplexity takes the same text file and context but scores only the second half
of each window (its first half is context), so its number is comparable in scale, not to the digit.
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


@dataclass(frozen=True)
class Perplexity:
    tokens: int  # tokens scored
    value: float


def corpus_text() -> str:
    missing = [str(path) for path in LICENSE_TEXTS if not path.is_file()]
    if missing:
        raise FileNotFoundError(f"perplexity text missing: {', '.join(missing)} (Debian's base-files ships them)")
    return "\n\n".join(path.read_text() for path in LICENSE_TEXTS)


def token_windows(llm: LLM, text: str, max_windows: int) -> list[list[int]]:
    ids = llm.engine.tokenizer.encode(text, add_special_tokens=False)
    return [ids[start:start + WINDOW] for start in range(0, len(ids) - WINDOW + 1, WINDOW)][:max_windows]


def engine_perplexity(llm: LLM, windows: list[list[int]]) -> Perplexity:
    results = llm.generate(windows, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    logprobs = [entry.logprob for result in results for entry in result.prompt_logprobs.entries]
    return Perplexity(len(logprobs), math.exp(-sum(logprobs) / len(logprobs)))


def llama_cpp_perplexity(binary: Path, model: Path, text: str, windows: int, threads: int,
                         scratch: Path) -> float:
    """llama-perplexity's final estimate on ``text`` in ``windows`` chunks of WINDOW tokens."""
    text_file = scratch / "perplexity_text.txt"
    text_file.write_text(text)
    done = subprocess.run([str(binary), "-m", str(model), "-f", str(text_file), "-c", str(WINDOW),
                           "--chunks", str(windows), "-t", str(threads)], capture_output=True, text=True,
                          timeout=1800)
    match = re.search(r"Final estimate: PPL = ([\d.]+)", done.stdout + done.stderr)
    if done.returncode != 0 or match is None:
        raise RuntimeError(f"llama-perplexity failed ({done.returncode}): {done.stderr[-1000:]}")
    return float(match[1])
