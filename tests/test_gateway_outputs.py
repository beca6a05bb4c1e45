"""OmniRequestOutput: one flat shape for every path, never nested."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from gateway.audio import STREAMING_WAV_DATA_BYTES, pcm16le, wav_header
from gateway.outputs import (
    IMAGE_KEY,
    EngineOutput,
    MultimodalPayload,
    OmniRequestOutput,
    RequestMetrics,
    wrap_output,
)
from omni_common.accumulation import TensorConsolidationError
from omni_common.modality import OutputModality
from omni_common.tensor_wire import decode_inline, encode_inline
from omni_serving.v1 import common_pb2, decoder_pb2, gateway_pb2, payload_pb2


def speech_output() -> OmniRequestOutput:
    audio = torch.linspace(-1, 1, 48)
    engine_output = EngineOutput(
        request_id="speech-1",
        stage_id=2,
        multimodal=MultimodalPayload({"audio": audio}, {"sample_rate": 24000}),
        finished=True,
        finish_reason="stop",
        metrics=RequestMetrics(ttfp_ms=12.5, rtf=0.3),
    )
    return OmniRequestOutput.from_engine_output(engine_output, 2, OutputModality.AUDIO)


def image_output() -> OmniRequestOutput:
    images = [torch.full((3, 4, 4), float(i)) for i in range(2)]
    return OmniRequestOutput.from_diffusion("image-1", images, stage_id=0)


def test_image_and_speech_outputs_have_the_same_flat_shape() -> None:
    speech, image = speech_output(), image_output()
    assert type(speech) is type(image) is OmniRequestOutput
    for out in (speech, image):
        for f in dataclasses.fields(out):
            value = getattr(out, f.name)
            assert not isinstance(value, OmniRequestOutput), f"{f.name} nests an output"
        assert isinstance(out.multimodal, MultimodalPayload)
        assert out.finished
    # Both read their data from the same field.
    assert speech.multimodal.primary_tensor.shape == (48,)
    assert image.multimodal.primary_tensor.shape == (2, 3, 4, 4)
    assert torch.equal(image.multimodal.tensors[IMAGE_KEY][1], image.images[1])
    assert speech.output_modality is OutputModality.AUDIO
    assert image.output_modality is OutputModality.IMAGE

    # And the same wire message type, each tensor under its own key.
    for out, key, shape in ((speech, "audio", [48]), (image, IMAGE_KEY, [2, 3, 4, 4])):
        pb = out.to_pb()
        assert type(pb) is gateway_pb2.OmniRequestOutput
        (named,) = pb.multimodal.tensors
        assert named.name == key and list(named.tensor.shape) == shape, f"{named.name=}"
    assert list(speech.to_pb().output_modalities) == [payload_pb2.OUTPUT_MODALITY_AUDIO]


def test_wrap_output_of_wrapped_output_does_not_nest() -> None:
    inner = speech_output()
    outer = wrap_output(inner, 7, OutputModality.AUDIO)
    assert outer is inner, "wrapping an OmniRequestOutput must return it, not a wrapper"
    assert outer.stage_id == 7
    again = OmniRequestOutput.from_engine_output(outer, 9, OutputModality.TEXT)
    assert again is inner and again.stage_id == 9
    image = image_output()
    assert wrap_output(image, 3, OutputModality.IMAGE) is image and image.stage_id == 3


def test_from_engine_output_accepts_raw_decoder_message() -> None:
    audio = torch.linspace(-0.5, 0.5, 16)
    msg = decoder_pb2.GenerateResponse(
        request_id="r",
        stage_id=1,
        new_token_ids=[5, 6],
        text_delta="hi",
        finished=True,
        finish_reason="length",
        metrics=common_pb2.RequestMetrics(num_steps=3),
    )
    msg.multimodal_output.tensors.add(name="audio", tensor=encode_inline(audio))
    msg.multimodal_output.metadata["sample_rate"].int_value = 24000
    out = wrap_output(msg, 1, OutputModality.TEXT | OutputModality.AUDIO)
    assert out.text == "hi" and out.token_ids == [5, 6]
    assert torch.equal(out.multimodal.tensors["audio"], audio)
    assert out.multimodal.metadata == {"sample_rate": 24000}
    assert out.metrics.num_steps == 3 and out.finish_reason == "length"


def test_from_engine_output_refuses_unknown_types() -> None:
    with pytest.raises(TypeError, match="dict"):
        OmniRequestOutput.from_engine_output({"audio": 1}, 0, OutputModality.AUDIO)


def test_to_pb_round_trip_of_payload() -> None:
    payload = MultimodalPayload(
        {"audio": torch.arange(4, dtype=torch.float32), "codes": [torch.ones(2), torch.zeros(3)]},
        {"sample_rate": 24000, "last": True, "scale": 0.5, "voice": "alice"},
    )
    back = MultimodalPayload.from_pb(payload.to_pb())
    assert torch.equal(back.tensors["audio"], payload.tensors["audio"])
    assert [t.tolist() for t in back.tensors["codes"]] == [[1.0, 1.0], [0.0, 0.0, 0.0]]
    assert back.metadata == payload.metadata
    assert type(back.metadata["last"]) is bool


def test_text_and_pooling_in_pb() -> None:
    out = OmniRequestOutput(
        request_id="t",
        output_modality=OutputModality.TEXT,
        text="abc",
        token_ids=[1, 2, 3],
        pooling_output=torch.ones(3),
    )
    pb = out.to_pb()
    assert pb.text.text == "abc" and list(pb.text.token_ids) == [1, 2, 3]
    assert torch.equal(decode_inline(pb.pooling_output), torch.ones(3))
    assert not pb.HasField("multimodal")


def test_from_diffusion_refuses_unstackable_images() -> None:
    with pytest.raises(TensorConsolidationError, match="image"):
        OmniRequestOutput.from_diffusion("x", [torch.zeros(3, 4, 4), torch.zeros(3, 5, 5)])


def test_pcm16_clips_and_is_little_endian() -> None:
    pcm = pcm16le(torch.tensor([0.0, 1.0, -1.0, 2.0, -3.0, 0.5, float("nan")]))
    values = np.frombuffer(pcm, dtype="<i2").tolist()
    assert values == [0, 32767, -32767, 32767, -32767, 16384, 0], f"{values=}"


def test_wav_header_sizes() -> None:
    header = wav_header(24000, 100)
    assert len(header) == 44 and header[:4] == b"RIFF" and header[8:16] == b"WAVEfmt "
    assert int.from_bytes(header[4:8], "little") == 136
    assert int.from_bytes(header[40:44], "little") == 100
    # Streaming: the length is unknown, so both size fields hold the largest
    # values that still fit 32 bits, and the data size is a whole number of samples.
    streaming = wav_header(24000)
    riff, data = (int.from_bytes(streaming[a : a + 4], "little") for a in (4, 40))
    assert data == STREAMING_WAV_DATA_BYTES and data % 2 == 0
    assert riff == 36 + data == 0xFFFFFFFE, f"{riff=:#x}"
    assert streaming[:36] == wav_header(24000, data)[:36]
