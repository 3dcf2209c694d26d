"""The fixed offline workload every engine runs: 32 chat prompts of mixed length, 128 new tokens each, greedy, EOS
ignored, so every engine produces exactly the same number of tokens.

A copy of the shared bench kit's definition (../shared/bench/workload.py, which the peers' scripts there read), kept
here so that every benchmark runs from a clone; the two must stay equal for our numbers and the peers' to compare.
"""
from pathlib import Path

WORKLOAD_FILE = Path(__file__)  # for --workload defaults and scripts that run in a peer's venv
TOPICS = ["the sea", "a robot learning to paint", "the history of bread", "a city under snow", "quantum computing",
          "a lighthouse keeper", "the first moon landing", "how bees communicate", "a jazz musician", "volcanoes",
          "a library at night", "the silk road", "a chess tournament", "rainforest frogs", "an old bicycle",
          "the northern lights"]
NEW_TOKENS = 128


def prompts():
    out = []
    for i in range(32):
        t = TOPICS[i % len(TOPICS)]
        extra = " Include details about its colours, its sounds and the people involved." * (i % 4)
        out.append([{"role": "user", "content": f"Write a short story about {t}.{extra}"}])
    return out


# The engine settings of benchmarks that measure our fp32 / bf16 engine against fp32 peers and earlier results: the
# bundled file is Q4_1, which weight_format's default (auto) would run packed (benchmarks/quantized.py measures that).
FLOAT_WEIGHTS = {"weight_format": "dequantize"}
