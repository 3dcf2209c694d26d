"""DeepSeek-V4.1's vision tower, aligner, span and preprocessing against the plain-torch oracle
(tests/helpers/deepseek_v41_vision_reference.py) on a tiny checkpoint ``make-tiny --arch deepseek_v41 --vision``
writes; bad images refused naming the field and the limit."""
from __future__ import annotations

import io
import json

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from backend_lib.core.errors import RequestError
from backend_lib.models.deepseek_v41.vision.config import VisionArgs
from backend_lib.models.deepseek_v41.vision.encoder import V41VisionEncoder, is_vision_tensor
from backend_lib.models.deepseek_v41.vision.preprocess import ImageLimits, preprocess, to_patches
from backend_lib.models.deepseek_v41.vision.span import span_roles
from backend_lib.tools.tiny import make_tiny
from tests.helpers import deepseek_v41_vision_reference as ref

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/models/conftest.py

LIMITS = ImageLimits(max_image_bytes=1 << 20, max_image_pixels=1 << 20)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = make_tiny("deepseek_v41", tmp_path_factory.mktemp("v41_vision"), vision=True, num_shards=1)
    config = json.loads((out / "config.json").read_text())
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return config, tensors


def _args(config) -> VisionArgs:
    return VisionArgs.from_dict(config["vision_config"], config["text_config"]["hidden_size"])


def _encoder(config, tensors, dtype=torch.float32) -> V41VisionEncoder:
    enc = V41VisionEncoder(_args(config), dtype)
    enc.load_weights(tensors.items())
    return enc


def _picture(width: int, height: int, seed: int = 0) -> Image.Image:
    gen = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8).numpy())


def _png(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def test_make_tiny_writes_the_release_vision_names(tiny):
    config, tensors = tiny
    names = {n for n in tensors if is_vision_tensor(n)}
    assert {"vision.patch_embed.proj.weight", "vision.blocks.1.attn.wqkv.bias", "vision.blocks.0.mlp.w1.weight",
            "vision.norm.weight", "aligner.w1.weight", "aligner.w2.bias", "image_start", "image_newline",
            "image_end", "image_pad"} <= names
    assert config["vision_config"]["patch_size"] == 14 and config["vision_config"]["downsample_ratio"] == 3
    assert tensors["aligner.w1.weight"].shape == (config["text_config"]["hidden_size"],
                                                  config["vision_config"]["hidden_size"] * 9)


def test_span_embeddings_equal_the_oracle_fp32(tiny):
    """A 4x5 patch grid: the aligner pads it to 6x6 (a 2x2 span), so padding, unfold order and both RoPE axes
    count; every span position (rows and delimiters) within 1e-5."""
    config, tensors = tiny
    enc = _encoder(config, tensors)
    patches = torch.randn(20, 3, 14, 14, generator=torch.Generator().manual_seed(1))
    ours = enc.span_embeddings(patches, 4, 5)
    want = ref.image_span(tensors, config["vision_config"], patches, 4, 5)
    assert ours.shape == want.shape == (2 * 3 + 2, config["text_config"]["hidden_size"])
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5)
    assert span_roles(2, 2).tolist() == ref.span_types(2, 2)


def test_span_embeddings_bf16_track_the_oracle(tiny):
    config, tensors = tiny
    enc = _encoder(config, tensors, torch.bfloat16)
    patches = torch.randn(21, 3, 14, 14, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    ours = enc.span_embeddings(patches, 3, 7).float()
    want = ref.image_span(tensors, config["vision_config"], patches, 3, 7).float()
    assert ours.dtype == torch.float32 and enc.vision.norm.weight.dtype == torch.float32
    assert (ours - want).abs().max() < 0.05 * want.abs().max()


@pytest.mark.parametrize("size", [(37, 23), (300, 20), (20, 300), (401, 187), (97, 131), (640, 17)])
def test_preprocessing_equals_the_reference(tiny, size):
    """Odd sizes and aspects: an upscale to min_pixels, a wide image past max_wh_ratio (resized), a tall one (not
    clamped, padded), spans shrunk to max_image_tokens; grids and every bf16 value equal."""
    config, _ = tiny
    image = _picture(*size)
    got = preprocess(_png(image), "image[0]", _args(config), LIMITS)
    patches, n_vit_h, n_vit_w, n_llm_h, n_llm_w = ref.load_image(image, config["vision_config"])
    assert (got.n_vit_h, got.n_vit_w, got.n_llm_h, got.n_llm_w) == (n_vit_h, n_vit_w, n_llm_h, n_llm_w)
    assert got.num_tokens == len(ref.span_types(n_llm_h, n_llm_w)) <= config["vision_config"]["max_image_tokens"]
    assert torch.equal(got.patches, patches)


def test_preprocessing_decodes_jpeg_webp_and_greyscale(tiny):
    config, _ = tiny
    a = _args(config)
    for fmt, image in (("JPEG", _picture(50, 60)), ("WEBP", _picture(71, 33)), ("PNG", _picture(40, 40).convert("L"))):
        data = _png(image, fmt)
        got = preprocess(data, "image[1]", a, LIMITS)
        want = ref.load_image(Image.open(io.BytesIO(data)), config["vision_config"])[0]
        assert torch.equal(got.patches, want), fmt
    assert to_patches(_picture(40, 40), a).digest == ""


def test_bad_images_are_refused_naming_the_field_and_limit(tiny):
    config, _ = tiny
    a = _args(config)
    png = _png(_picture(64, 64))
    cases = [(b"this is text, not an image", None, "not a PNG"), (png[: len(png) // 2], None, "truncated"),
             (_png(_picture(64, 64), "BMP"), None, "not a PNG")]
    for data, limit, words in cases:
        with pytest.raises(RequestError, match=words) as err:
            preprocess(data, "image[2]", a, LIMITS)
        assert err.value.field == "image[2]" and err.value.limit == limit
    with pytest.raises(RequestError, match="max_image_bytes") as err:
        preprocess(png, "image[0]", a, ImageLimits(max_image_bytes=100, max_image_pixels=1 << 20))
    assert err.value.limit == "max_image_bytes"
    with pytest.raises(RequestError, match="max_image_pixels") as err:
        preprocess(png, "image[0]", a, ImageLimits(max_image_bytes=1 << 20, max_image_pixels=64 * 63))
    assert err.value.limit == "max_image_pixels"


def test_digest_keys_bytes_and_settings(tiny):
    config, _ = tiny
    a = _args(config)
    one, two = _png(_picture(30, 30, 1)), _png(_picture(30, 30, 2))
    d1 = preprocess(one, "image", a, LIMITS).digest
    assert d1 == preprocess(one, "image", a, LIMITS).digest != preprocess(two, "image", a, LIMITS).digest
    other = VisionArgs.from_dict({**config["vision_config"], "max_image_tokens": 30}, a.text_hidden_size)
    assert preprocess(one, "image", other, LIMITS).digest != d1
