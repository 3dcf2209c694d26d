"""The engine: requests in, text deltas out. ``intake.py`` (a request's values -> a validated engine request, every
refusal a typed ``RequestError``), ``llm_engine.py`` (``LLMEngine``: prepare, add, step, abort), its thread and
streams (``async_engine.py``), offline batch generation (``offline.py``), tokenizers and streaming text
(``tokenizer.py``, ``detokenizer.py``) and fault injection (``faults.py``). It drives the scheduler (core) and the
executor (worker)."""
