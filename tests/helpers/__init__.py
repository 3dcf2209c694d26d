"""What tests share (test modules import from here, never from each other: tests/test_import_graph.py checks it).

engines: the one small-engine builder (make_engine) and drive-to-completion loop (drive). triton_server: the e2e
tests' tritonserver fixture and clients. v4_reference / engram_reference / deepseek_v41_reference (+ its parts):
plain-torch oracles of DeepSeek-V4, Engram and DeepSeek-V4.1; dspark_reference: DeepSpec's drafter heads.
greedy_agreement: transformers' greedy continuation and bf16 near-tie bounds. paged_runner, attention_batches: model-
and kernel-level inputs built by hand. scheduler_model: a scheduler without a model. grammar_sampling: random walks
through grammar masks. screen_cases, fuzz_values: shared cases and hypothesis values.
"""
