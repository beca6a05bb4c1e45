"""The gateway's OutputProcessor driven by a deterministic fake engine.

In the style of vLLM's output processor tests: `FakeEngine` replays premade
`GenerateResponse` sequences (one message per request per step) through the
real processor, parametrized over output kinds and modalities.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY

from gateway.output_processor import (
    NullPayloadAccumulator,
    OutputKind,
    OutputProcessor,
    RequestState,
    make_payload_accumulator,
)
from gateway.outputs import DecoderOutputError, EngineOutput
from omni_common.accumulation import (
    PayloadAccumulator,
    TensorAccumulationStrategy,
    TensorConsolidationError,
)
from omni_common.errors import AlreadyExistsError, InvalidArgumentError
from omni_common.modality import OutputModality
from omni_common.tensor_wire import encode_inline
from omni_serving.v1 import decoder_pb2, payload_pb2

S = TensorAccumulationStrategy
NUM_STEPS = 4


# ---------------------------------------------------------------------------
# Premade engine outputs.


def _payload(tensors: Mapping[str, torch.Tensor], **metadata) -> payload_pb2.MultimodalPayload:
    p = payload_pb2.MultimodalPayload()
    for name, t in tensors.items():
        p.tensors.add(name=name, tensor=encode_inline(t))
    for key, value in metadata.items():
        if isinstance(value, bool):
            p.metadata[key].bool_value = value
        else:
            p.metadata[key].int_value = value
    return p


def audio_step(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + i)
    return torch.rand(240, generator=g) * 2 - 1


def image_step(i: int) -> torch.Tensor:
    return torch.full((1, 3, 4, 4), float(i), dtype=torch.float32)


def latent_step(i: int) -> torch.Tensor:
    return torch.arange(16, dtype=torch.float32).reshape(2, 8) + 100 * i


def tokens_step(i: int) -> list[int]:
    return [10 * i + 1, 10 * i + 2]


def text_step(i: int) -> str:
    return f"w{i} "


# Modality under test -> (tensor key, step tensor, expected concatenation dim) or None for text.
MM_CASES = {
    "audio": ("audio", audio_step, -1),
    "image": ("image", image_step, 0),
    "latent": ("latent", latent_step, 0),
}
MODALITIES = ["audio", "image", "latent", "text", "text+audio"]


def make_script(request_id: str, modality: OutputModality, steps: int = NUM_STEPS):
    """The decoder messages of one request: a payload and/or text per step, then a final one."""
    out = []
    for i in range(steps):
        r = decoder_pb2.GenerateResponse(request_id=request_id, stage_id=1)
        if modality.has_text:
            r.new_token_ids.extend(tokens_step(i))
            r.text_delta = text_step(i)
        tensors = {
            key: fn(i)
            for name, (key, fn, _) in MM_CASES.items()
            if OutputModality[name.upper()] in modality
        }
        if tensors:
            r.multimodal_output.CopyFrom(_payload(tensors, sample_rate=24000))
        out.append(r)
    out.append(
        decoder_pb2.GenerateResponse(
            request_id=request_id, stage_id=1, finished=True, finish_reason="stop"
        )
    )
    return out


class FakeEngine:
    """Replays premade messages: each step yields the next message of every unfinished request."""

    def __init__(self, scripts: Mapping[str, list[decoder_pb2.GenerateResponse]]) -> None:
        self._scripts = {rid: list(msgs) for rid, msgs in scripts.items()}

    def step(self) -> list[decoder_pb2.GenerateResponse]:
        batch = [msgs.pop(0) for msgs in self._scripts.values() if msgs]
        return batch

    def run(self, processor: OutputProcessor):
        outputs: dict[str, list[EngineOutput]] = {rid: [] for rid in self._scripts}
        failures = {}
        while batch := self.step():
            result = processor.process_outputs(batch)
            for o in result.outputs:
                outputs[o.request_id].append(o)
            for f in result.failures:
                failures[f.request_id] = f.error
        return outputs, failures


def _cat(values: list[torch.Tensor], dim: int) -> torch.Tensor:
    return torch.cat(values, dim=dim)


def _expected_tensor(modality_name: str, steps: int = NUM_STEPS) -> tuple[str, torch.Tensor]:
    key, fn, dim = MM_CASES[modality_name]
    return key, _cat([fn(i) for i in range(steps)], dim)


def _join_delta(outputs: list[EngineOutput], key: str, dim: int) -> torch.Tensor:
    pieces = [
        o.multimodal.tensors[key] for o in outputs if o.multimodal and key in o.multimodal.tensors
    ]
    return torch.cat(pieces, dim=dim)


# ---------------------------------------------------------------------------
# The matrix: output kind x modality.


@pytest.mark.parametrize("kind", list(OutputKind), ids=lambda k: k.name)
@pytest.mark.parametrize("modality_text", MODALITIES)
def test_replay_through_processor(kind: OutputKind, modality_text: str) -> None:
    modality = OutputModality.from_string(modality_text)
    processor = OutputProcessor()
    ids = ["req-a", "req-b"]
    for rid in ids:
        processor.add_request(rid, modality, kind)
    outputs, failures = FakeEngine({rid: make_script(rid, modality) for rid in ids}).run(processor)

    assert not failures, f"{failures=}"
    assert processor.get_num_unfinished_requests() == 0
    for rid in ids:
        outs = outputs[rid]
        assert outs[-1].finished and outs[-1].finish_reason == "stop", f"{outs[-1]=}"
        assert all(not o.finished for o in outs[:-1])
        want_count = 1 if kind is OutputKind.FINAL_ONLY else NUM_STEPS + 1
        assert len(outs) == want_count, f"got={len(outs)}, want={want_count}"

        if modality.has_text:
            want_text = "".join(text_step(i) for i in range(NUM_STEPS))
            want_ids = [t for i in range(NUM_STEPS) for t in tokens_step(i)]
            if kind is OutputKind.DELTA:
                got_text = "".join(o.text for o in outs)
                got_ids = [t for o in outs for t in o.token_ids]
            else:
                got_text, got_ids = outs[-1].text, outs[-1].token_ids
            assert got_text == want_text, f"{got_text=}, {want_text=}"
            assert got_ids == want_ids, f"{got_ids=}, {want_ids=}"
        else:
            assert all(o.text == "" and o.token_ids == [] for o in outs)

        mm_names = [n for n in MM_CASES if OutputModality[n.upper()] in modality]
        if not mm_names:
            assert all(o.multimodal is None for o in outs), "text-only output carries a payload"
        for name in mm_names:
            key, want = _expected_tensor(name)
            dim = MM_CASES[name][2]
            got = (
                _join_delta(outs, key, dim)
                if kind is OutputKind.DELTA
                else outs[-1].multimodal.tensors[key]
            )
            assert torch.equal(got, want), (
                f"{key}: got shape {tuple(got.shape)}, want {tuple(want.shape)}"
            )
            if kind is OutputKind.CUMULATIVE:
                # Every intermediate output is a prefix of the whole.
                for step, o in enumerate(outs[:-1]):
                    prefix = _cat([MM_CASES[name][1](i) for i in range(step + 1)], dim)
                    assert torch.equal(o.multimodal.tensors[key], prefix), f"{key} step {step}"
            meta = (
                outs[-1].multimodal.metadata
                if kind is not OutputKind.DELTA
                else outs[0].multimodal.metadata
            )
            assert meta == {"sample_rate": 24000}, f"{meta=}"


def test_multimodal_read_only_from_its_channel_and_pooling_untouched() -> None:
    processor = OutputProcessor()
    processor.add_request("r", OutputModality.AUDIO, OutputKind.CUMULATIVE)
    embedding = torch.arange(8, dtype=torch.float32)
    msg = decoder_pb2.GenerateResponse(
        request_id="r",
        multimodal_output=_payload({"audio": audio_step(0)}),
        pooling_output=encode_inline(embedding),
        finished=True,
    )
    (out,) = processor.process_outputs([msg]).outputs
    assert list(out.multimodal.tensors) == ["audio"], "pooling output leaked into the payload"
    assert torch.equal(out.pooling_output, embedding)


def test_pooling_only_request_passes_embedding_through() -> None:
    processor = OutputProcessor()
    processor.add_request("emb", OutputModality.TEXT, OutputKind.FINAL_ONLY)
    embedding = torch.ones(4, dtype=torch.float32)
    msg = decoder_pb2.GenerateResponse(
        request_id="emb", pooling_output=encode_inline(embedding), finished=True
    )
    (out,) = processor.process_outputs([msg]).outputs
    assert out.multimodal is None and torch.equal(out.pooling_output, embedding)


# ---------------------------------------------------------------------------
# Strategies chosen once per modality, overridable per key.


def test_factory_picks_null_object_for_text_only() -> None:
    state = RequestState.from_new_request(
        "t", OutputModality.TEXT, OutputKind.DELTA, arrival_time=0.0
    )
    assert isinstance(state.multimodal, NullPayloadAccumulator)
    audio = make_payload_accumulator(OutputModality.AUDIO, {})
    assert isinstance(audio, PayloadAccumulator) and audio.default_strategy is S.CONCAT_LAST
    image = make_payload_accumulator(OutputModality.IMAGE, {})
    assert image.default_strategy is S.CONCAT_DIM0


def test_text_only_request_drops_multimodal() -> None:
    processor = OutputProcessor()
    processor.add_request("t", OutputModality.TEXT, OutputKind.DELTA)
    msg = decoder_pb2.GenerateResponse(
        request_id="t",
        new_token_ids=[1],
        text_delta="a",
        multimodal_output=_payload({"audio": audio_step(0)}),
    )
    (out,) = processor.process_outputs([msg]).outputs
    assert out.multimodal is None and out.text == "a"


def test_processor_level_key_override() -> None:
    processor = OutputProcessor(key_strategies={"audio": S.APPEND_LIST})
    processor.add_request("r", OutputModality.AUDIO, OutputKind.FINAL_ONLY)
    outputs, _ = FakeEngine({"r": make_script("r", OutputModality.AUDIO)}).run(processor)
    got = outputs["r"][-1].multimodal.tensors["audio"]
    assert isinstance(got, list) and len(got) == NUM_STEPS, f"{type(got)=}"
    assert all(torch.equal(p, audio_step(i)) for i, p in enumerate(got))


def test_request_level_key_override_replace() -> None:
    processor = OutputProcessor()
    processor.add_request(
        "r", OutputModality.LATENT, OutputKind.FINAL_ONLY, key_strategies={"latent": S.REPLACE}
    )
    outputs, _ = FakeEngine({"r": make_script("r", OutputModality.LATENT)}).run(processor)
    got = outputs["r"][-1].multimodal.tensors["latent"]
    assert torch.equal(got, latent_step(NUM_STEPS - 1)), "REPLACE should keep only the last latent"


def test_mixed_keys_each_use_their_strategy() -> None:
    """A text+audio+image request: audio grows on its last dim, image on dim 0."""
    modality = OutputModality.TEXT | OutputModality.AUDIO | OutputModality.IMAGE
    processor = OutputProcessor()
    processor.add_request("r", modality, OutputKind.FINAL_ONLY)
    outputs, failures = FakeEngine({"r": make_script("r", modality)}).run(processor)
    assert not failures
    tensors = outputs["r"][-1].multimodal.tensors
    assert torch.equal(tensors["audio"], _expected_tensor("audio")[1])
    assert torch.equal(tensors["image"], _expected_tensor("image")[1])


# ---------------------------------------------------------------------------
# Errors.


def _skipped_metric(key: str) -> float:
    return REGISTRY.get_sample_value("omni_gateway_skipped_tensors_total", {"key": key}) or 0.0


@pytest.mark.parametrize("kind", list(OutputKind), ids=lambda k: k.name)
def test_accumulation_error_skips_tensor_and_request_continues(kind: OutputKind) -> None:
    processor = OutputProcessor()
    processor.add_request("r", OutputModality.AUDIO, kind)
    script = make_script("r", OutputModality.AUDIO)
    # Step 1 sends a 2-D chunk that cannot join 1-D audio along its last dim.
    script[1].multimodal_output.CopyFrom(_payload({"audio": torch.zeros(2, 10)}))
    before = _skipped_metric("audio")

    outputs, failures = FakeEngine({"r": script}).run(processor)

    assert not failures, f"{failures=}"
    assert processor.stats.skipped_tensors == 1, f"{processor.stats=}"
    assert _skipped_metric("audio") - before == 1
    want = torch.cat([audio_step(i) for i in range(NUM_STEPS) if i != 1])
    outs = outputs["r"]
    got = (
        _join_delta(outs, "audio", -1)
        if kind is OutputKind.DELTA
        else outs[-1].multimodal.tensors["audio"]
    )
    assert torch.equal(got, want), f"got {tuple(got.shape)}, want {tuple(want.shape)}"
    assert outs[-1].finished


class _BrokenAccumulator(PayloadAccumulator):
    """Merges nothing: stands in for pieces that cannot be consolidated."""

    def consolidate(self):
        raise TensorConsolidationError("audio", "pieces cannot be merged (test)")

    take_delta = consolidate


@pytest.mark.parametrize("kind", list(OutputKind), ids=lambda k: k.name)
def test_consolidation_error_fails_only_that_request(kind: OutputKind) -> None:
    def factory(modality, strategies):
        if factory.calls == 0:
            factory.calls += 1
            return _BrokenAccumulator(S.CONCAT_LAST, strategies)
        return make_payload_accumulator(modality, strategies)

    factory.calls = 0
    processor = OutputProcessor(payload_accumulator_factory=factory)
    processor.add_request("bad", OutputModality.AUDIO, kind)
    processor.add_request("good", OutputModality.AUDIO, kind)
    scripts = {rid: make_script(rid, OutputModality.AUDIO) for rid in ("bad", "good")}

    outputs, failures = FakeEngine(scripts).run(processor)

    assert set(failures) == {"bad"}, f"{failures=}"
    assert "audio" in str(failures["bad"]) and "cannot be merged" in str(failures["bad"])
    assert processor.stats.failed_consolidations == 1
    assert outputs["bad"] == [], "a failed request must produce no output"
    assert outputs["good"][-1].finished
    assert torch.equal(
        outputs["good"][-1].multimodal.tensors["audio"]
        if kind is not OutputKind.DELTA
        else _join_delta(outputs["good"], "audio", -1),
        _expected_tensor("audio")[1],
    )


def test_other_errors_propagate() -> None:
    processor = OutputProcessor()
    processor.add_request("r", OutputModality.AUDIO, OutputKind.DELTA)
    bad = decoder_pb2.GenerateResponse(
        request_id="r", multimodal_output=_payload({"audio": audio_step(0)})
    )
    bad.multimodal_output.tensors[0].tensor.inline_data = b"\x00" * 3  # wrong byte length
    with pytest.raises(DecoderOutputError, match="inline_data"):
        processor.process_outputs([bad])


def test_duplicate_request_and_unknown_outputs() -> None:
    processor = OutputProcessor()
    processor.add_request("r", OutputModality.TEXT)
    with pytest.raises(AlreadyExistsError):
        processor.add_request("r", OutputModality.TEXT)
    assert processor.abort_requests(["r", "nope"]) == ["r"]
    result = processor.process_outputs(
        [decoder_pb2.GenerateResponse(request_id="r", text_delta="x")]
    )
    assert result.outputs == [] and processor.stats.dropped_outputs == 1


def test_output_kind_from_proto() -> None:
    assert OutputKind.from_proto(0) is OutputKind.DELTA
    assert OutputKind.from_proto(3) is OutputKind.FINAL_ONLY
    with pytest.raises(InvalidArgumentError, match="output_kind"):
        OutputKind.from_proto(9)


def test_gateway_ttfp_measured_on_first_packet() -> None:
    clock = iter(np.arange(0.0, 10.0, 0.5)).__next__
    processor = OutputProcessor(clock=clock)
    processor.add_request("r", OutputModality.AUDIO, OutputKind.DELTA)  # t=0.0
    outputs, _ = FakeEngine({"r": make_script("r", OutputModality.AUDIO)}).run(processor)
    assert outputs["r"][0].metrics.ttfp_ms == pytest.approx(500.0), f"{outputs['r'][0].metrics=}"
