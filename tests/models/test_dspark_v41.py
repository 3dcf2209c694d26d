"""Our DeepSeek-V4.1 DSpark drafter (backend_lib/models/dspark/deepseek_v41.py) against the plain-torch oracle
(tests/helpers/dspark_v41_reference.py) on the tiny checkpoint ``make-tiny --arch deepseek_v41 --dspark`` writes,
fp32, random weights: the target's captured features, the block's states and logits, the Markov drafts and the
confidences."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from backend_lib.models.dspark.deepseek_v41 import load_v41_drafter
from backend_lib.models.dspark.v41_config import V41DSparkArgs
from backend_lib.models.loading.loader import load_model
from backend_lib.tools.tiny import make_tiny
from tests.helpers.deepseek_v41_cases import tokens
from tests.helpers.dspark_v41_reference import ReferenceV41DSpark
from tests.helpers.paged_runner import HybridPagedRunner

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/models/conftest.py

TOL = 1e-5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny("deepseek_v41", tmp_path_factory.mktemp("v41_dspark"), seed=5, dspark=True)
    model = load_model(str(path), torch.float32, progress=False)
    model.qat = False
    return path, model, load_v41_drafter(model, str(path)), ReferenceV41DSpark(path)


def test_features_block_drafts_and_confidence_equal_the_oracle(tiny):
    _check_against_the_oracle(*tiny)


def test_fp8_fp4_drafter_equals_the_oracle_over_dequantized_weights(tmp_path):
    """fp8 projections (32x32 ue8m0 blocks, kept fp8) and fp4 routed experts (kept packed) in the draft blocks."""
    path = make_tiny("deepseek_v41", tmp_path, seed=5, dspark=True, fp8=True, fp4_experts=True)
    model = load_model(str(path), torch.float32, progress=False)
    model.qat = False
    drafter = load_v41_drafter(model, str(path))
    assert drafter.mtp[0].attn.wq_a.weight.dtype == torch.float8_e4m3fn and drafter.mtp[0].ffn.packed_fp4
    _check_against_the_oracle(path, model, drafter, ReferenceV41DSpark(path))


def _check_against_the_oracle(path, model, drafter, ref):
    ids = tokens(29, 4)
    p = len(ids) - 1  # the anchor: ids[p] at position p, the target ran 0 .. p - 1
    model.capture_layer_ids = drafter.d.target_layer_ids
    HybridPagedRunner(model, num_blocks=16).step([], [("r", ids[:p])])
    _, expected_features = ref.target.features(torch.tensor(ids[:p]))
    features = model.captured_hidden
    # the target's streams (magnitudes ~25) carry its own summation-order noise: relative here; the drafter's math
    # below reads the same features on both sides
    assert ((features - expected_features).abs().max() / expected_features.abs().max()) <= TOL
    lo, B = p - model.args.sliding_window, drafter.d.block_size
    with torch.no_grad():
        main_x = drafter.project_context(features[lo:p])
        context = [k[None] for k in drafter.context_kv(main_x, torch.arange(lo, p))]
        block = torch.tensor([[ids[p]] + [drafter.d.noise_token_id] * (B - 1)])
        h, normed = drafter.block_hidden(model, block, p + torch.arange(B)[None], context,
                                         torch.ones(1, p - lo, dtype=torch.bool))
        base = model.compute_logits(normed[0])[None]
        drafts, conf = drafter.draft(base, h, torch.tensor([ids[p]]), heads=True)
    ref_h, ref_base = ref.block(features[lo:p], torch.arange(lo, p), block[0], p + torch.arange(B))
    assert (h[0] - ref_h).abs().max() <= TOL * ref_h.abs().max()  # pre-norm streams, magnitudes ~60
    assert (base[0] - ref_base).abs().max() <= TOL
    ref_drafts, ref_conf, _ = ref.heads(ref_h, ref_base, ids[p])
    assert drafts[0].tolist() == ref_drafts
    assert (conf[0] - ref_conf).abs().max() <= TOL


def test_dflash_is_the_plain_argmax_and_bad_fields_are_refused_by_name(tiny):
    _, model, drafter, _ = tiny
    base, hidden = torch.randn(2, 4, model.args.vocab_size), torch.randn(2, 4, model.args.hidden_size)
    drafts, conf = drafter.draft(base, hidden, torch.tensor([5, 6]), heads=False)
    assert conf is None and torch.equal(drafts, base.argmax(-1))
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        V41DSparkArgs.from_text_config({})
    with pytest.raises(ValueError, match="dspark_target_layer_ids"):
        replace(drafter.d, target_layer_ids=(model.args.num_hidden_layers,)).check_target(model.args)
