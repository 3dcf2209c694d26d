"""Structured output through the engine (real xgrammar, real tokenizers, real models): every constrained output
validates (JSON schema, any JSON object, regex, choice, EBNF grammar) at temperature 0 and 1; free rows beside
constrained ones give exactly their tokens alone; n-gram and MTP speculation give exactly the tokens without it;
preemption rebuilds the matcher and abort releases it, leaving no block behind; a grammar that does not compile, or
not in time, ends its request before any step with an error naming the field (the others run); compiled sampler
regions (aot_eager) give the eager tokens; two tensor-parallel ranks give one rank's."""
from __future__ import annotations

import json
import re
from concurrent.futures import Future

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backend_lib.core.config import EngineConfig
from backend_lib.core.outputs import SessionControl
from backend_lib.core.request import RequestStatus
from backend_lib.core.sampling_params import SamplingParams
from backend_lib.engine.llm_engine import LLMEngine
from backend_lib.engine.offline import LLM
from backend_lib.structured_output.constraints import parse_constraint
from backend_lib.tools.tiny import make_tiny
from backend_lib.worker.compiled_sampler import CompiledSampler
from tests.helpers.engines import drive, final_outputs, full_texts, make_engine

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
# Compact JSON with bounded strings: a random tiny model cannot pad it with whitespace until max_tokens.
TINY_SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                                "tag": {"enum": ["red", "green", "blue"]},
                                                "ok": {"type": "boolean"}},
               "required": ["id", "tag", "ok"], "additionalProperties": False}
REGEX = r"[a-z]{2,6}-[0-9]{1,3}"
CHOICES = ["alpha", "beta", "gamma delta"]
GRAMMAR = 'root ::= "(" num (" + " num)? ")"\nnum ::= [1-9] [0-9]?'


def _c(request: dict):
    return parse_constraint(request)


def _validator(kind: str):
    """A check that raises unless ``text`` is an output the constraint allows."""
    def check(text: str) -> None:
        if kind == "json":
            jsonschema.validate(json.loads(text), TINY_SCHEMA)
        elif kind == "person":
            jsonschema.validate(json.loads(text), PERSON)
        elif kind == "json_object":
            assert isinstance(json.loads(text), dict)
        elif kind == "regex":
            assert re.fullmatch(REGEX, text), text
        elif kind == "choice":
            assert text in CHOICES, text
        else:
            assert re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)?\)", text), text
    return check


TINY_CONSTRAINTS = {
    "json": _c({"structured_outputs": {"json": TINY_SCHEMA, "disable_any_whitespace": True}}),
    "regex": _c({"guided_regex": REGEX}),
    "choice": _c({"guided_choice": CHOICES}),
    "grammar": _c({"structured_outputs": {"grammar": GRAMMAR}}),
}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny("llama", tmp_path_factory.mktemp("so_llama"))


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory):
    return make_tiny("deepseek_v3", tmp_path_factory.mktemp("so_mtp"), seed=7, mtp_layers=1)


def _llm(path, **settings) -> LLM:
    return LLM(config=EngineConfig.from_flat({"model": str(path), "max_model_len": 256, "num_blocks": 128,
                                              "max_num_batched_tokens": 64, **settings}))


def _workload() -> tuple[list[list[int]], list[SamplingParams], list[str | None]]:
    """Every constraint greedy and at temperature 1 under three seeds, and free rows (greedy and sampled)."""
    prompts, params, kinds = [], [], []
    for n, (kind, constraint) in enumerate(TINY_CONSTRAINTS.items()):
        for temperature, seed in [(0.0, None), (1.0, 1), (1.0, 2), (1.0, 3)]:
            prompts.append([5 + n, 9, 17 + (seed or 0), 30])
            params.append(SamplingParams(max_tokens=80, temperature=temperature, seed=seed,
                                         structured_outputs=constraint))
            kinds.append(kind)
    for i, temperature in enumerate((0.0, 0.0, 1.0, 1.0)):
        prompts.append([40 + i, 41, 42])
        params.append(SamplingParams(max_tokens=20, temperature=temperature, seed=i, ignore_eos=True))
        kinds.append(None)
    return prompts, params, kinds


def _check_valid(results, params, kinds) -> None:
    for result, p, kind in zip(results, params, kinds):
        assert result.error is None
        if kind is None:
            assert len(result.token_ids) == p.max_tokens
            continue
        assert result.finish_reason == "stop", (kind, result.text)  # the grammar terminated, not max_tokens
        _validator(kind)(result.text)


def test_tiny_outputs_validate_and_free_rows_are_unchanged(tiny_llama):
    prompts, params, kinds = _workload()
    with _llm(tiny_llama) as llm:
        results = llm.generate(prompts, params)
        _check_valid(results, params, kinds)
        free = [i for i, k in enumerate(kinds) if k is None]
        alone = llm.generate([prompts[i] for i in free], [params[i] for i in free])
        assert [r.token_ids for r in alone] == [results[i].token_ids for i in free]
        # A constrained request alone gives its tokens in the batch (rows never interact).
        assert llm.generate([prompts[5]], [params[5]])[0].token_ids == results[5].token_ids
        llm.engine.scheduler.check_integrity()
        assert llm.engine.stats().kv_blocks_used == 0


def test_smollm2_json_schema_greedy_and_sampled(smollm2_path):
    person = _c({"structured_outputs": {"json": PERSON}})
    prompt = [{"role": "user", "content": "Describe a person as a JSON object with a name and an age."}]
    params = [SamplingParams(max_tokens=80, temperature=t, seed=s, structured_outputs=person)
              for t, s in [(0.0, None), (1.0, 11), (1.0, 12), (1.0, 13)]]
    params.append(SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=_c({"structured_outputs": {
        "json_object": True}})))
    with LLM(config=EngineConfig.from_flat({"model": smollm2_path, "num_blocks": 128, "max_num_seqs": 8})) as llm:
        results = llm.generate([prompt] * len(params), params)
    for result in results[:4]:
        assert result.finish_reason == "stop", result.text
        jsonschema.validate(json.loads(result.text), PERSON)
    assert results[4].finish_reason == "stop" and isinstance(json.loads(results[4].text), dict)


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 3},
                                  {"method": "mtp", "num_speculative_tokens": 2}])
def test_speculation_gives_the_tokens_without_it(tiny_llama, tiny_mtp, spec):
    path = tiny_mtp if spec["method"] == "mtp" else tiny_llama
    prompts, params, kinds = _workload()
    # Repetitive prompts so that n-gram drafts match.
    prompts = [p * 3 for p in prompts]
    with _llm(path) as plain:
        expected = plain.generate(prompts, params)
    with _llm(path, **spec) as llm:
        results = llm.generate(prompts, params)
        stats = llm.engine.stats()
        llm.engine.scheduler.check_integrity()
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    _check_valid(results, params, kinds)
    assert stats.spec_draft_tokens > 0 and stats.kv_blocks_used == 0


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v4"])
def test_tiny_deepseek_outputs_validate_and_mtp_gives_the_same_tokens(arch, tmp_path):
    """The same grammars on the DeepSeek backbones (V4: the hybrid cache; both with MTP drafts checked against none)."""
    path = make_tiny(arch, tmp_path / arch, seed=8, mtp_layers=1)
    prompts, params, kinds = _workload()
    with _llm(path) as plain:
        expected = plain.generate(prompts, params)
    _check_valid(expected, params, kinds)
    with _llm(path, method="mtp", num_speculative_tokens=2) as llm:
        results = llm.generate(prompts, params)
        llm.engine.scheduler.check_integrity()
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]


def test_preemption_rebuilds_the_matcher(tiny_llama):
    prompts, params, kinds = _workload()
    with _llm(tiny_llama) as llm:
        expected = llm.generate(prompts, params)
    with _llm(tiny_llama, num_blocks=24, block_size=4, max_num_batched_tokens=32) as llm:
        results = llm.generate(prompts, params)
        stats = llm.engine.stats()
        llm.engine.scheduler.check_integrity()
    assert stats.num_preemptions > 0 and stats.kv_blocks_used == 0
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]


ENGINE = {"max_model_len": 256, "num_blocks": 64}



def test_abort_mid_grammar_releases_the_matcher(tiny_llama):
    engine = make_engine(tiny_llama, ENGINE)
    params = SamplingParams(max_tokens=80, temperature=1.0, seed=3, structured_outputs=TINY_CONSTRAINTS["json"])
    engine.add_request("a", [5, 6, 7], params)
    engine.add_request("b", [8, 9], params)
    request = engine.scheduler.get_request("a")
    while request.num_output_tokens < 2:
        engine.step()
    assert request.grammar.matcher is not None
    matcher = request.grammar.matcher
    final = engine.abort("a")
    assert final.finish_reason == "abort" and request.grammar.matcher is None and matcher.released
    finals = final_outputs(drive(engine))
    assert finals["b"].finish_reason == "stop"
    assert engine.scheduler.get_request("b") is None
    engine.scheduler.check_integrity()
    assert engine.stats().kv_blocks_used == 0
    engine.close()


@pytest.mark.parametrize("request_fields, field", [
    ({"guided_regex": "[0-9"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": {"type": "object", "not": {"required": ["a"]}}}}, "structured_outputs.json"),
])
def test_a_grammar_that_does_not_compile_is_refused_naming_the_field(tiny_llama, request_fields, field):
    engine = make_engine(tiny_llama, ENGINE)
    engine.add_request("bad", [5, 6], SamplingParams(max_tokens=5, structured_outputs=_c(request_fields)))
    engine.add_request("good", [5, 6], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    finals = final_outputs(drive(engine))
    bad = finals["bad"]
    assert bad.finish_reason == "error" and bad.rejected and bad.error.startswith(field), bad.error
    assert bad.num_output_tokens == 0 and bad.metrics.first_scheduled_time is None  # before any step
    assert finals["good"].num_output_tokens == 5 and not finals["good"].rejected
    assert engine.stats().kv_blocks_used == 0
    engine.close()


def test_a_grammar_past_its_time_limit_is_refused_and_others_run(tiny_llama):
    engine = make_engine(tiny_llama, ENGINE, compile_timeout_s=0.001)
    schema = {"type": "object", "properties": {f"field_{i}": {"type": "string", "pattern": f"[a-z]{{{i}}}x+"}
                                               for i in range(1, 40)}}
    engine.add_request("slow", [5, 6], SamplingParams(max_tokens=5, structured_outputs=_c({"guided_json": schema})))
    engine.add_request("free", [5, 6], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    finals = final_outputs(drive(engine))
    assert finals["slow"].rejected and finals["slow"].error.startswith("guided_json")
    assert "compile_timeout_s" in finals["slow"].error
    assert finals["free"].num_output_tokens == 5
    engine.close()


def test_a_request_waits_for_its_grammar_while_others_run(tiny_llama):
    engine = make_engine(tiny_llama, ENGINE)
    constrained = engine.prepare_request("c", engine.take_in([5, 6], SamplingParams(
        max_tokens=30, temperature=0.0, structured_outputs=TINY_CONSTRAINTS["regex"])))
    compiled = constrained.grammar.future.result(timeout=60)
    constrained.grammar.future = Future()  # the compile is held back until the test releases it
    engine.add_prepared(constrained)
    engine.add_request("free", [7, 8], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    request = engine.scheduler.get_request("c")
    for _ in range(3):
        engine.step()
    assert request.status is RequestStatus.WAITING_FOR_GRAMMAR and request.num_computed_tokens == 0
    assert engine.scheduler.get_request("free").num_output_tokens == 3  # the other request ran meanwhile
    constrained.grammar.future.set_result(compiled)
    finals = final_outputs(drive(engine))
    assert finals["c"].finish_reason == "stop" and finals["free"].num_output_tokens == 30
    engine.close()


def test_compiled_sampler_region_gives_the_eager_tokens(tiny_llama):
    prompts, params, kinds = _workload()
    with _llm(tiny_llama) as llm:
        expected = llm.generate(prompts, params)
    with _llm(tiny_llama, compile_backend="aot_eager", batch_buckets="1,2,4,8,16", width_buckets="4,16",
              prefill_buckets="8", max_num_seqs=16, compile_progress=False) as llm:
        results = llm.generate(prompts, params)
        sampler = llm.engine.runner.sampler
    assert isinstance(sampler, CompiledSampler)
    assert any(key[-1] == "masked" for key in sampler.stats.compiled_keys)  # constrained batches ran in a graph
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]


@pytest.mark.slow
def test_two_ranks_give_one_ranks_tokens(tiny_llama):
    prompts, params, kinds = _workload()
    with _llm(tiny_llama) as llm:
        expected = llm.generate(prompts, params)
    with _llm(tiny_llama, tensor_parallel_size=2) as llm:
        results = llm.generate(prompts, params)
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    _check_valid(results, params, kinds)


def test_a_constraint_applies_to_one_session_turn(tiny_llama):
    engine = make_engine(tiny_llama, ENGINE)
    choice = SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=TINY_CONSTRAINTS["choice"])
    engine.add_request("t1", [5, 6, 7], choice, session=SessionControl("s", start=True))
    outputs = drive(engine)
    first = final_outputs(outputs)["t1"]
    assert first.finish_reason == "stop" and full_texts(outputs)["t1"] in CHOICES
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request("t2", [8, 9], free, session=SessionControl("s"))
    request = engine.scheduler.get_request("t2")
    assert request.grammar is None and request.num_history_tokens > 0
    second = final_outputs(drive(engine))["t2"]
    assert second.finish_reason == "length" and second.num_output_tokens == 12  # not held to the first turn's choices
    engine.add_request("t3", [10], choice, session=SessionControl("s", end=True))
    outputs = drive(engine)
    assert final_outputs(outputs)["t3"].finish_reason == "stop" and full_texts(outputs)["t3"] in CHOICES
    engine.scheduler.check_integrity()
    assert engine.stats().kv_blocks_used == 0
    engine.close()


def test_min_tokens_does_not_fight_the_grammar(tiny_llama):
    """min_tokens past what the grammar allows: the grammar's end wins (its stop tokens are not blocked)."""
    with _llm(tiny_llama) as llm:
        result = llm.generate([[5, 6]], SamplingParams(max_tokens=40, min_tokens=30, temperature=0.0,
                                                       structured_outputs=TINY_CONSTRAINTS["choice"]))[0]
    assert result.error is None and result.finish_reason == "stop" and result.text in CHOICES


# ---- fuzzing: random small constraints through the engine ------------------------------------------------------

_PIECES = st.sampled_from(["[a-c]{1,3}", "(x|yz)", "[0-9]{2}", "-", "(ab)?", "[a-z]", " "])
_REGEXES = st.lists(_PIECES, min_size=1, max_size=4).map("".join)
_CHOICES = st.lists(st.text(alphabet="abc xyz01", min_size=1, max_size=6), min_size=1, max_size=4)
_SCHEMAS = st.fixed_dictionaries({"type": st.just("object"), "additionalProperties": st.just(False)}).flatmap(
    lambda base: st.dictionaries(st.sampled_from(["a", "b", "c"]), st.sampled_from([
        {"type": "boolean"}, {"enum": ["x", "y"]}, {"type": "integer", "minimum": 0, "maximum": 9}]),
        min_size=1, max_size=3).map(lambda props: {**base, "properties": props, "required": sorted(props)}))


@pytest.fixture(scope="module")
def fuzz_engine(tiny_llama):
    engine = make_engine(tiny_llama, ENGINE, max_num_seqs=4, method="ngram", num_speculative_tokens=2)
    yield engine
    engine.close()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(_REGEXES.map(lambda r: ("regex", r)), _CHOICES.map(lambda c: ("choice", c)),
                          _SCHEMAS.map(lambda s: ("json", s))), min_size=1, max_size=4),
       st.integers(0, 3), st.booleans())
def test_fuzzed_constraints_finish_validate_and_leak_nothing(fuzz_engine, constraints, abort_at, sampled):
    engine = fuzz_engine
    checks = {}
    for i, (kind, value) in enumerate(constraints):
        field = {"regex": "guided_regex", "choice": "guided_choice", "json": "guided_json"}[kind]
        if kind == "json":
            value = dict(value)
            request = {"structured_outputs": {"json": value, "disable_any_whitespace": True}}
        else:
            request = {field: value}
        params = SamplingParams(max_tokens=24, temperature=1.0 if sampled else 0.0, seed=i,
                                structured_outputs=parse_constraint(request))
        engine.add_request(f"f{i}", [5 + i, 6, 7], params)
        checks[f"f{i}"] = (kind, value)
    aborted, steps = {}, [0]

    def abort_f0(engine: LLMEngine) -> None:  # after step abort_at + 2
        steps[0] += 1
        if steps[0] == abort_at + 3 and engine.scheduler.get_request("f0") is not None:
            aborted["f0"] = engine.abort("f0")
    outputs = drive(engine, on_step=abort_f0, max_steps=500)
    texts, finals = full_texts(outputs), {**final_outputs(outputs), **aborted}
    for rid, (kind, value) in checks.items():
        out = finals[rid]
        assert out.error is None, out.error
        if out.finish_reason != "stop":
            continue  # cut by max_tokens or aborted: a prefix
        if kind == "regex":
            assert re.fullmatch(value, texts[rid]), (value, texts[rid])
        elif kind == "choice":
            assert texts[rid] in value
        else:
            jsonschema.validate(json.loads(texts[rid]), value)
    engine.scheduler.check_integrity()
    assert engine.stats().kv_blocks_used == 0
