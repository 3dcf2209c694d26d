"""The engine: requests in, text deltas out. ``llm_engine.py`` (``LLMEngine``: prepare, add, step, abort), its
thread and streams (``async_engine.py``), offline batch generation (``offline.py``), tokenizers and streaming text
(``tokenizer.py``, ``detokenizer.py``), the checks of one request (``limits.py``), refusals (``errors.py``) and
fault injection (``faults.py``). It drives the scheduler (core) and the executor (worker)."""
