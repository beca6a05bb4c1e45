"""The plain-torch Qwen3-Omni Code2Wav against the transformers reference.

The reference is a tiny ``Qwen3OmniMoeCode2Wav`` built from ``REFERENCE_CONFIG``
(the released layout at toy widths: 2 layers, hidden 128, head_dim 64, GQA
2 heads on 1 KV head, sliding window 72, upsampling 2*2 then 8*5*4*3, so 1920
samples per frame and a 555-sample tail). Its weights are replaced by the
seeded unit-gain ``random_tensors`` (the reference's own init gives audio near
the denormal range) and both models load the same tensors by their released
names.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from decoder_svc.qwen3_omni.code2wav import (
    Code2Wav,
    decode_with_left_context,
    random_tensors,
)

REFERENCE_CONFIG = dict(
    codebook_size=2048,
    num_quantizers=16,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,  # head_dim 64, as released
    num_key_value_heads=1,
    intermediate_size=256,
    sliding_window=72,
    upsampling_ratios=(2, 2),
    upsample_rates=(8, 5, 4, 3),
    decoder_dim=96,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
SEED = 1234
FRAMES = (1, 7, 60, 200)  # 200 > sliding_window * num_hidden_layers


def _reference_class():
    try:
        import torchvision  # noqa: F401
    except (ImportError, RuntimeError):
        # transformers imports torchvision when it is installed; a build that does
        # not match torch fails at import, and Code2Wav needs none of it. Hidden
        # before transformers first looks for it.
        sys.modules["torchvision"] = None  # type: ignore[assignment]
    pytest.importorskip("transformers")
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeCode2WavConfig,
    )
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    return Qwen3OmniMoeCode2WavConfig, Qwen3OmniMoeCode2Wav


def _build(overrides: dict | None = None, seed: int = SEED):
    """(reference module, our module, config dict, tensors) sharing the same weights."""
    config_cls, model_cls = _reference_class()
    ref_config = config_cls(**{**REFERENCE_CONFIG, **(overrides or {})})
    config = ref_config.to_dict()
    tensors = random_tensors(config, seed=seed)
    ref = model_cls(ref_config).eval()
    ref.load_state_dict({k.removeprefix("code2wav."): v for k, v in tensors.items()}, strict=True)
    return ref, Code2Wav.from_config_and_tensors(config, tensors), config, tensors


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """These are many small ops: one intra-op thread is faster and steadier than two
    on a shared 2-core machine (OpenMP barriers stall when the other core is busy)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def models():
    return _build()


@pytest.fixture(scope="module")
def codes():
    gen = torch.Generator().manual_seed(7)
    return torch.randint(0, 2048, (max(FRAMES), 16), generator=gen)


@pytest.fixture(scope="module")
def whole(models, codes):
    """Our whole-sequence decode of the first T frames, per T."""
    _, ours, _, _ = models
    return {t: ours.decode(codes[:t]) for t in FRAMES}


def reference_decode(ref, codes: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return ref(codes.t().unsqueeze(0))[0, 0]


def test_geometry(models):
    _, ours, _, _ = models
    assert ours.samples_per_frame == 1920
    assert ours.tail_samples == 555  # 8*60 + 5*12 + 4*3 + 3
    assert ours.sample_rate == 24000
    assert ours.num_quantizers == 16


@pytest.mark.parametrize("frames", FRAMES)
def test_decode_matches_reference(models, codes, whole, frames):
    ref, ours, _, _ = models
    expected = reference_decode(ref, codes[:frames])
    got = whole[frames]
    assert got.dtype == torch.float32
    assert got.shape == expected.shape == (frames * 1920 - 555,)
    assert 0.02 < got.pow(2).mean().sqrt() < 0.5  # a real signal, not clamped flat
    assert (got - expected).abs().max().item() <= 1e-5


def test_tail_is_derived_from_config():
    """Another upsampling layout: length and samples still follow the reference."""
    ref, ours, _, _ = _build(
        {"upsampling_ratios": (3,), "upsample_rates": (5, 2), "decoder_dim": 32}, seed=5
    )
    assert ours.samples_per_frame == 30
    assert ours.tail_samples == 5 * 2 + 2
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 2048, (40, 16), generator=gen)
    expected = reference_decode(ref, codes)
    got = ours.decode(codes)
    assert got.shape == expected.shape == (40 * 30 - 12,)
    assert (got - expected).abs().max().item() <= 1e-5
    stream = ours.new_stream()
    pieces = [stream.push(codes[i : i + 3]) for i in range(0, 40, 3)]
    assert (torch.cat(pieces) - got).abs().max().item() <= 1e-4


def _schedules(frames: int) -> dict[str, list[int]]:
    ramp = [1, 1, 5, 10, 25, 25]
    gen = torch.Generator().manual_seed(frames)
    random = torch.randint(1, 31, (frames,), generator=gen).tolist()
    return {"ramp": ramp + [25] * frames, "random": random, "single": [1] * frames}


@pytest.mark.parametrize("frames", FRAMES)
@pytest.mark.parametrize("schedule", ["ramp", "random", "single"])
def test_stream_matches_whole(models, codes, whole, frames, schedule):
    _, ours, _, _ = models
    spf, tail = ours.samples_per_frame, ours.tail_samples
    stream = ours.new_stream()
    pieces, start = [], 0
    for size in _schedules(frames)[schedule]:
        if start >= frames:
            break
        end = min(start + size, frames)
        piece = stream.push(codes[start:end])
        assert piece.dtype == torch.float32
        # exactly the samples that became final
        assert piece.shape[0] == (end - start) * spf - (tail if start == 0 else 0)
        assert stream.frames == end
        pieces.append(piece)
        start = end
    streamed = torch.cat(pieces)
    assert streamed.shape == whole[frames].shape
    assert (streamed - whole[frames]).abs().max().item() <= 1e-4


def test_stream_state_is_bounded(models, codes):
    """After many frames the carried state does not grow: a push costs its own frames."""
    _, ours, _, _ = models
    stream = ours.new_stream()
    for start in range(0, 200, 10):
        stream.push(codes[start : start + 10])
    transformer = stream._transformer
    assert transformer.position == 200
    for cache in transformer.caches:
        assert cache.keys is not None and cache.keys.shape[2] == 72 - 1
        assert cache.values is not None and cache.values.shape[2] == 72 - 1

    def histories(node):
        if hasattr(node, "streams"):
            for child in node.streams:
                yield from histories(child)
        for attr in ("inner", "dwconv"):
            if hasattr(node, attr):
                yield from histories(getattr(node, attr))
        if getattr(node, "history", None) is not None:
            yield node.history.shape[-1]

    sizes = list(histories(stream._convs))
    assert sizes and max(sizes) <= 6 * 9  # the widest: kernel 7, dilation 9


def test_push_rejects_bad_codes(models):
    _, ours, _, _ = models
    stream = ours.new_stream()
    with pytest.raises(ValueError):
        stream.push(torch.zeros(0, 16, dtype=torch.long))
    with pytest.raises(ValueError):
        stream.push(torch.zeros(3, 15, dtype=torch.long))
    with pytest.raises(ValueError):
        ours.decode(torch.full((3, 16), 2048))
    with pytest.raises(ValueError):
        ours.decode(torch.zeros(3, 16))
    assert stream.frames == 0


def test_loads_from_a_whole_checkpoint(models, codes, whole):
    _, _, config, tensors = models
    checkpoint = {
        **tensors,
        "thinker.model.norm.weight": torch.ones(4),
        "talker.model.norm.weight": torch.ones(4),
    }
    half = {k: v.to(torch.bfloat16) for k, v in checkpoint.items()}
    model = Code2Wav.from_config_and_tensors(config, half)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    unprefixed = {k.removeprefix("code2wav."): v for k, v in tensors.items()}
    same = Code2Wav.from_config_and_tensors(config, unprefixed, prefix="")
    assert torch.equal(same.decode(codes[:7]), whole[7])


def test_load_rejects_missing_key(models):
    _, _, config, tensors = models
    key = "code2wav.pre_transformer.layers.1.mlp.up_proj.weight"
    broken = {k: v for k, v in tensors.items() if k != key}
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        Code2Wav.from_config_and_tensors(config, broken)


def test_load_rejects_wrong_shape(models):
    _, _, config, tensors = models
    key = "code2wav.decoder.2.block.1.conv.weight"
    shape = tuple(tensors[key].shape)
    bad = (shape[0], shape[1] + 1, shape[2])
    broken = {**tensors, key: torch.zeros(bad)}
    with pytest.raises(ValueError) as err:
        Code2Wav.from_config_and_tensors(config, broken)
    message = str(err.value)
    assert key in message and str(bad) in message and str(shape) in message


def test_load_rejects_unexpected_key(models):
    _, _, config, tensors = models
    key = "code2wav.decoder.99.conv.weight"
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        Code2Wav.from_config_and_tensors(config, {**tensors, key: torch.zeros(1)})


def test_left_context_measurement(models, codes, whole):
    _, ours, _, _ = models
    full = whole[200]
    # context covering everything before each chunk: each chunk is a prefix decode
    big = decode_with_left_context(ours, codes, chunk=25, left_context=200)
    assert big.shape == full.shape
    assert (big - full).abs().max().item() <= 1e-5
    # 2 * 71 attention frames + a few conv frames: beyond that, no dependence
    beyond = decode_with_left_context(ours, codes, chunk=25, left_context=160)
    assert (beyond - full).abs().max().item() <= 1e-4
    # a short context misses what the transformer still sees
    small = decode_with_left_context(ours, codes, chunk=25, left_context=4)
    assert small.shape == full.shape
    assert (small[: 25 * 1920 - 555] - full[: 25 * 1920 - 555]).abs().max().item() <= 1e-5
    assert (small - full).abs().max().item() > 1e-2


def test_a_stream_on_an_accelerator_keeps_its_work_there(models, codes, monkeypatch):
    """Weights on a device (the fake accelerator of tests/fake_device.py):
    every op runs there, codes are checked on the host and moved once, and
    each push reads its audio back once, as float32 on the host, equal to
    the host model's (within float rounding). (Inference mode becomes no_grad here: the fake
    device's wrapper tensors cannot be inference tensors.)"""
    sys.path.insert(0, str(Path(__file__).parent))
    monkeypatch.setattr(torch, "inference_mode", torch.no_grad)
    from fake_device import FakeDeviceMode, module_to_device

    _, ours, config, tensors = models
    model = module_to_device(Code2Wav.from_config_and_tensors(config, tensors))
    mode = FakeDeviceMode()
    with mode:
        stream = model.new_stream()
        pieces = [stream.push(codes[:3]), stream.push(codes[3:7]), model.decode(codes[:7])]
    assert mode.mixed == [], "ops mixed devices:\n" + "\n".join(mode.mixed)
    assert len(mode.syncs) == 3, f"one device-to-host read per push / decode: {mode.syncs}"
    assert all(type(p) is torch.Tensor and p.dtype == torch.float32 for p in pieces)
    host = ours.new_stream()
    # within float rounding: the fake device's tensors reach the kernels with other strides
    torch.testing.assert_close(torch.cat(pieces[:2]), torch.cat([host.push(codes[:3]), host.push(codes[3:7])]),
                               rtol=0, atol=1e-6)
    torch.testing.assert_close(pieces[2], ours.decode(codes[:7]), rtol=0, atol=1e-6)


def test_bfloat16_weights_decode_close_to_float32(models, codes, whole):
    """dtype bfloat16 (code2wav's `auto` on CUDA; asked for on CPU): the
    weights in bfloat16, the audio float32 on the host, within 0.05 of the
    float32 decode at every sample here (random weights; measured about
    0.01). Streaming in bfloat16 gives its whole decode's samples within the
    same bound."""
    _, _, config, tensors = models
    half = Code2Wav.from_config_and_tensors(config, tensors, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16 and half.device.type == "cpu"
    got = half.decode(codes[:60])
    assert got.dtype == torch.float32 and got.shape == whole[60].shape
    err = (got - whole[60]).abs().max().item()
    assert 0 < err < 0.05, err
    stream = half.new_stream()
    streamed = torch.cat([stream.push(codes[i:i + 20]) for i in range(0, 60, 20)])
    assert (streamed - whole[60][: streamed.shape[0]]).abs().max().item() < 0.05
