"""Lengths, caps, finish reasons, the runaway guard, modalities, instructions,
model defaults and ListModels, on real processes (fake engine).

Three fake-engine decoders on Unix sockets: ``tts`` (async path, the
in-process builder), ``omni`` (sync path), and ``tts`` with the runaway
guard off; a gateway in front of each of the first two. The fake talker
makes ``4 + 2 * len(text bytes)`` frames of 1920 samples (12.5 frames per
second) and ends them with "stop"; a prompt with ``FAKE_LOOP_MARKER`` never
ends by itself and repeats a 3-frame cycle after 8 frames.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from fakes import remove_dir, short_socket_dir

from decoder_svc.backend import RequestSpec
from decoder_svc.lengths import (
    DeploymentSettings,
    EngineFacts,
    Options,
    RepetitionGuard,
    deployment_modalities,
)
from decoder_svc.servicer import spec_from_pb
from decoder_svc.testing.fake_engine import FAKE_LOOP_MARKER, FakeBackend
from omni_common.errors import InvalidArgumentError
from omni_common.modality import OutputModality
from omni_common.server import wait_for_health_sync
from omni_serving.v1 import (
    common_pb2,
    decoder_pb2,
    decoder_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    payload_pb2,
)

REPO = Path(__file__).resolve().parents[1]
SPF = 1920  # samples per codec frame
RATE = 24_000

SHORT_PARAGRAPH = (
    "The committee met on Tuesday to review the budget. After a long discussion, "
    "they agreed to fund the new library wing, to repair the old bridge, and to "
    "hire two more teachers for the autumn term. The vote was close, but the mood "
    "in the room was hopeful."
)
LONG_PARAGRAPH = (
    "When the storm finally passed, the villagers came out of their houses to survey "
    "the damage. Fences lay flat across the fields, the river had climbed over its banks, "
    "and the old oak by the church had lost its largest branch. Yet nobody had been hurt. "
    "By noon the baker had lit his ovens again, the children were racing paper boats along "
    "the flooded lane, and the mayor was already drawing up a list of repairs, starting "
    "with the bridge that carried the road to the market town on the far side of the hill."
)


def natural_frames(text: str) -> int:
    return 4 + 2 * len(text.encode())


# ---------------------------------------------------------------------------
# Processes.


class Proc:
    """A service process in its own session, stopped by its pid."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            argv, env={**os.environ, **env}, cwd=REPO, start_new_session=True
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait(10)


@dataclass
class Stack:
    tts_decoder: str
    omni_decoder: str
    noguard_decoder: str
    tts_gateway: str
    omni_gateway: str


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    run_dir = short_socket_dir()
    env = {"PYTHONUNBUFFERED": "1", "TMPDIR": str(run_dir)}
    procs: list[Proc] = []
    tag = f"len{os.getpid()}"

    def decoder(name: str, profile: str, *extra: str) -> str:
        target = f"unix://{run_dir / (name + '.sock')}"
        procs.append(Proc([
            sys.executable, "-m", "decoder_svc", "--listen", target, "--engine", "fake", "--profile", profile,
            "--deployment", f"{tag}{name}", "--log-level", "WARNING", *extra,
        ], env))  # fmt: skip
        return target

    def gateway(name: str, decoder_target: str) -> str:
        target = f"unix://{run_dir / (name + '.sock')}"
        procs.append(Proc([
            sys.executable, "-m", "gateway", "--listen", target, "--decoder", decoder_target,
            "--log-level", "WARNING",
        ], env))  # fmt: skip
        return target

    try:
        tts = decoder("dtts", "tts", "--in-process-builder")
        omni = decoder("domni", "omni")
        noguard = decoder("dnoguard", "tts", "--repetition-window-s", "0")
        for target in (tts, omni, noguard):
            wait_for_health_sync(target, 120)
        gw_tts, gw_omni = gateway("gtts", tts), gateway("gomni", omni)
        for target in (gw_tts, gw_omni):
            wait_for_health_sync(target, 60)
        yield Stack(tts, omni, noguard, gw_tts, gw_omni)
    finally:
        for p in procs:
            p.stop()
        remove_dir(run_dir)


def speak(target: str, text: str, **kw) -> tuple[int, str, list[gateway_pb2.SpeakResponse]]:
    """(samples, finish_reason of the final chunk, chunks)."""
    instructions = kw.pop("instructions", "")
    sampling = common_pb2.SamplingParams(**kw)
    with grpc.insecure_channel(target) as ch:
        stub = gateway_pb2_grpc.OmniGatewayServiceStub(ch)
        chunks = list(stub.Speak(
            gateway_pb2.SpeakRequest(text=text, sampling_params=sampling, instructions=instructions), timeout=120))  # fmt: skip
    assert chunks and chunks[-1].final and not any(c.final for c in chunks[:-1])
    assert all(not c.finish_reason for c in chunks[:-1])
    return sum(len(c.audio) // 2 for c in chunks), chunks[-1].finish_reason, chunks


def generate(
    target: str, prompt: str, modalities: str, **kw
) -> list[gateway_pb2.OmniRequestOutput]:
    instructions = kw.pop("instructions", "")
    req = gateway_pb2.OmniGatewayServiceGenerateRequest(
        prompt=prompt,
        output_modalities=modalities,
        sampling_params=common_pb2.SamplingParams(**kw),
        instructions=instructions,
        output_kind=gateway_pb2.OUTPUT_KIND_DELTA,
    )
    with grpc.insecure_channel(target) as ch:
        outs = [
            r.output for r in gateway_pb2_grpc.OmniGatewayServiceStub(ch).Generate(req, timeout=120)
        ]
    assert outs and outs[-1].finished and not any(o.finished for o in outs[:-1])
    return outs


def generate_samples(outs: list[gateway_pb2.OmniRequestOutput]) -> int:
    return sum(
        len(t.tensor.inline_data) // 4
        for o in outs
        for t in o.multimodal.tensors
        if t.name == "audio"
    )


def decoder_generate(target: str, **fields) -> list[decoder_pb2.GenerateResponse]:
    with grpc.insecure_channel(target) as ch:
        stub = decoder_pb2_grpc.DecoderServiceStub(ch)
        return list(stub.Generate(decoder_pb2.GenerateRequest(**fields), timeout=120))


def decoder_samples(resps: list[decoder_pb2.GenerateResponse]) -> int:
    return sum(
        len(t.tensor.inline_data) // 4
        for r in resps
        for t in r.multimodal_output.tensors
        if t.name == "audio"
    )


def refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    return info.value


# ---------------------------------------------------------------------------
# Lengths.


def test_a_long_paragraph_comes_back_whole_with_stop(stack: Stack) -> None:
    frames = natural_frames(SHORT_PARAGRAPH)
    assert frames / 12.5 < 60  # within the default cap
    samples, reason, _ = speak(stack.tts_gateway, SHORT_PARAGRAPH, seed=1)
    assert (samples, reason) == (frames * SPF, "stop")

    # 456 characters: longer than the default 60 s on the fake engine; whole
    # with a cap above its length, cut at exactly 60 s without one.
    assert len(LONG_PARAGRAPH) > 450 and natural_frames(LONG_PARAGRAPH) / 12.5 > 60
    samples, reason, _ = speak(stack.tts_gateway, LONG_PARAGRAPH, seed=1, max_audio_seconds=120)
    assert (samples, reason) == (natural_frames(LONG_PARAGRAPH) * SPF, "stop")
    samples, reason, _ = speak(stack.tts_gateway, LONG_PARAGRAPH, seed=1)
    assert (samples, reason) == (60 * RATE, "length")


@pytest.mark.parametrize("seconds", [2.0, 1.01, 0.3, 7.77])
def test_max_audio_seconds_caps_within_one_frame_with_length(stack: Stack, seconds: float) -> None:
    samples, reason, _ = speak(
        stack.tts_gateway, SHORT_PARAGRAPH, seed=2, max_audio_seconds=seconds
    )
    assert reason == "length"
    assert seconds * RATE - SPF < samples <= seconds * RATE
    assert samples == math.floor(seconds * 12.5 + 1e-6) * SPF


def test_max_tokens_caps_codec_frames_on_tts(stack: Stack) -> None:
    samples, reason, _ = speak(stack.tts_gateway, SHORT_PARAGRAPH, seed=3, max_tokens=10)
    assert (samples, reason) == (10 * SPF, "length")
    # the tighter of the two caps wins
    samples, reason, _ = speak(
        stack.tts_gateway, SHORT_PARAGRAPH, seed=3, max_tokens=40, max_audio_seconds=1
    )
    assert (samples, reason) == (12 * SPF, "length")
    # a cap above the natural length: "stop"
    samples, reason, _ = speak(stack.tts_gateway, "hi", seed=3, max_tokens=100)
    assert (samples, reason) == (natural_frames("hi") * SPF, "stop")


def test_omni_caps_text_and_audio_separately(stack: Stack) -> None:
    prompt = "tell me a story"
    text_tokens = 8 + len(prompt) // 2  # the fake thinker's reply length
    outs = generate(stack.omni_gateway, prompt, "text+audio", seed=4)
    reply = "".join(o.text.text for o in outs)
    assert len(reply) == text_tokens
    # the talker speaks the reply: 4 + 2 * tokens frames, no longer fixed at 64
    assert generate_samples(outs) == (4 + 2 * text_tokens) * SPF
    assert outs[-1].finish_reason == "stop"

    outs = generate(stack.omni_gateway, prompt, "text+audio", seed=4, max_audio_seconds=1)
    assert generate_samples(outs) == 12 * SPF and outs[-1].finish_reason == "length"

    # max_tokens caps the text; the speech of cut text ends "length"
    outs = generate(stack.omni_gateway, prompt, "text+audio", seed=4, max_tokens=5)
    assert len("".join(o.text.text for o in outs)) == 5
    assert generate_samples(outs) == (4 + 2 * 5) * SPF
    assert outs[-1].finish_reason == "length"


def test_text_only_on_omni_returns_the_thinkers_text_and_no_audio(stack: Stack) -> None:
    outs = generate(stack.omni_gateway, "what is the time", "text", seed=5)
    both = generate(stack.omni_gateway, "what is the time", "text+audio", seed=5)
    text = "".join(o.text.text for o in outs)
    assert text and text == "".join(o.text.text for o in both)
    assert generate_samples(outs) == 0
    assert all(o.stage_id == 0 for o in outs)  # it stopped after the thinker
    assert outs[-1].finish_reason == "stop"
    outs = generate(stack.omni_gateway, "what is the time", "text", seed=5, max_tokens=3)
    assert len("".join(o.text.text for o in outs)) == 3 and outs[-1].finish_reason == "length"


def test_a_stop_sequence_ends_the_text_and_its_speech(stack: Stack) -> None:
    """The fake thinker writes one character per token: the text ends where
    the sequence begins, and the talker is handed the tokens before it (and
    the one it begins in, as the reply's unspoken last): 4 + 2 x tokens frames."""
    prompt = "tell me a story"
    full = "".join(o.text.text for o in generate(stack.omni_gateway, prompt, "text", seed=4))
    stop = full[6:9]
    at = full.find(stop)
    outs = generate(stack.omni_gateway, prompt, "text+audio", seed=4, stop=["never: 0", stop])
    assert "".join(o.text.text for o in outs) == full[:at]
    assert outs[-1].finish_reason == "stop"
    assert generate_samples(outs) == (4 + 2 * (at + 1)) * SPF
    text_only = generate(stack.omni_gateway, prompt, "text", seed=4, stop=[stop])
    assert "".join(o.text.text for o in text_only) == full[:at]
    assert sum(len(o.text.token_ids) for o in text_only) == at  # the token the stop begins in kept no text
    assert text_only[-1].finish_reason == "stop"
    # a sequence that never appears changes nothing
    outs = generate(stack.omni_gateway, prompt, "text+audio", seed=4, stop=["0"])
    assert "".join(o.text.text for o in outs) == full and generate_samples(outs) == (4 + 2 * len(full)) * SPF


def test_stop_sequences_are_refused_where_no_text_stage_reads_them(stack: Stack) -> None:
    err = refused(lambda: generate(stack.tts_gateway, "hello there", "audio", stop=["x"]))
    assert "sampling_params.stop: this deployment (profile tts) has no text stage" in err.details()
    err = refused(lambda: speak(stack.omni_gateway, "hello there", stop=["x"]))
    assert "sampling_params.stop: speech speaks the text as written" in err.details()
    for stops, field in [(["a", "b", "c", "d", "e"], "sampling_params.stop"), (["ok", ""], "sampling_params.stop[1]")]:
        err = refused(lambda stops=stops: generate(stack.omni_gateway, "hello", "text", stop=stops))
        assert err.details().startswith(f"{field}: "), err.details()
        err = refused(lambda stops=stops: decoder_generate(
            stack.omni_decoder, request_id="r", prompt="hello", sampling_params=common_pb2.SamplingParams(stop=stops)))
        assert err.details().startswith(f"{field}: "), err.details()
    err = refused(lambda: decoder_generate(stack.omni_decoder, request_id="r", prompt="hello", verbatim=True,
                                           sampling_params=common_pb2.SamplingParams(stop=["x"])))
    assert err.details().startswith("sampling_params.stop: a text spoken as written"), err.details()


# ---------------------------------------------------------------------------
# The runaway guard.


def test_a_looping_codec_stream_ends_with_repetition(stack: Stack) -> None:
    text = f"{FAKE_LOOP_MARKER} hello"
    samples, reason, _ = speak(stack.tts_gateway, text, seed=6)
    assert reason == "repetition"
    # 8 frames, then the 3-frame cycle until the last 50 frames (4 s) are periodic
    assert samples == (8 + 3 + 47) * SPF

    outs = generate(stack.omni_gateway, text, "text+audio", seed=6)
    assert outs[-1].finish_reason == "repetition"
    assert generate_samples(outs) == (8 + 3 + 47) * SPF

    # the guard off: the cap ends it
    resps = decoder_generate(
        stack.noguard_decoder, request_id="loop-noguard", prompt=text,
        sampling_params=common_pb2.SamplingParams(max_audio_seconds=6))  # fmt: skip
    assert resps[-1].finished and resps[-1].finish_reason == "length"
    assert decoder_samples(resps) == 75 * SPF

    # the decoder's info and metrics still count it as finished
    with grpc.insecure_channel(stack.tts_decoder) as ch:
        info = decoder_pb2_grpc.DecoderServiceStub(ch).GetDecoderInfo(
            decoder_pb2.GetDecoderInfoRequest()
        )
    assert info.active_requests == 0


def test_repetition_guard_unit() -> None:
    rng = np.random.default_rng(0)
    speech = rng.integers(0, 2048, 400).tolist()
    guard = RepetitionGuard(50, 8)
    assert not guard.push(speech)
    # a pause: one code repeated for 3 s (37 frames) inside speech does not trip it
    paused = speech[:100] + [7] * 37 + speech[100:200] + [3, 4] * 18 + speech[200:]
    assert not RepetitionGuard(50, 8).push(paused)
    # a silence past the window does (period 1), and so does a cycle of 8
    guard = RepetitionGuard(50, 8)
    assert guard.push(speech[:100] + [7] * 50) and guard.period == 1 and guard.frames == 150
    cycle = list(range(100, 108))
    guard = RepetitionGuard(50, 8)
    assert guard.push(speech[:30] + cycle * 7) and guard.period == 8
    # a cycle longer than max_period does not count
    assert not RepetitionGuard(50, 8).push(speech[:30] + list(range(9)) * 20)
    with pytest.raises(ValueError):
        RepetitionGuard(10, 8)


# ---------------------------------------------------------------------------
# Modalities, instructions, validation.


@pytest.mark.parametrize("modalities", ["text", "image", "latent", "text+audio"])
def test_a_modality_the_deployment_cannot_produce_is_refused(stack: Stack, modalities: str) -> None:
    err = refused(lambda: generate(stack.tts_gateway, "hello", modalities))
    assert err.details().startswith(
        "output_modalities: this deployment (profile tts) produces audio;"
    )
    # the decoder refuses it too
    err = refused(lambda: decoder_generate(
        stack.tts_decoder, request_id=f"mod-{modalities}", prompt="hello",
        output_modalities=OutputModality.from_string(modalities).to_proto()))  # fmt: skip
    assert err.details().startswith(
        "output_modalities: this deployment (profile tts) produces audio;"
    )
    if modalities in ("image", "latent"):
        err = refused(lambda: generate(stack.omni_gateway, "hello", f"{modalities}+audio"))
        assert "produces text+audio" in err.details()


def test_a_conversation_is_refused_by_a_decoder_without_a_text_stage(stack: Stack) -> None:
    turn = common_pb2.ChatMessage(role="user", content=[common_pb2.ContentPart(text="hello")])
    err = refused(lambda: decoder_generate(stack.tts_decoder, request_id="conv", messages=[turn]))
    assert err.details().startswith("messages: this deployment (profile tts) speaks its input as is"), err.details()


def test_instructions_refused_on_tts_and_taken_on_omni(stack: Stack) -> None:
    err = refused(
        lambda: decoder_generate(
            stack.tts_decoder, request_id="instr", prompt="hello", instructions="speak slowly"
        )
    )
    assert err.details().startswith(
        "instructions: this deployment (profile tts) does not take instructions"
    )
    # omni: the thinker's prompt holds them (the fake thinker's reply length follows its prompt)
    plain = generate(stack.omni_gateway, "hello", "text", seed=7)
    styled = generate(
        stack.omni_gateway, "hello", "text", seed=7, instructions="speak slowly and warmly"
    )
    assert len("".join(o.text.text for o in plain)) == 8 + len("hello") // 2
    assert (
        len("".join(o.text.text for o in styled)) == 8 + len("speak slowly and warmly\nhello") // 2
    )


def test_speak_takes_no_instructions_on_any_deployment(stack: Stack) -> None:
    """Speak speaks its text as written: no text stage could read instructions."""
    for target in (stack.tts_gateway, stack.omni_gateway):
        err = refused(lambda t=target: speak(t, "hello", instructions="speak slowly"))
        assert err.details().startswith("instructions: speech speaks the text as written"), err.details()


def test_speak_on_omni_speaks_the_text_as_written(stack: Stack) -> None:
    """One deployment, both routes: Speak on omni skips the thinker and gives
    the audio the tts deployment gives (the fake talker speaks what it reads)."""
    _, reason, on_omni = speak(stack.omni_gateway, "hello there", seed=11)
    _, _, on_tts = speak(stack.tts_gateway, "hello there", seed=11)
    assert reason == "stop"
    assert b"".join(c.audio for c in on_omni) == b"".join(c.audio for c in on_tts)
    # max_tokens caps a spoken text's codec frames, not the thinker's text tokens
    with grpc.insecure_channel(stack.omni_gateway) as ch:
        (card,) = gateway_pb2_grpc.OmniGatewayServiceStub(ch).ListModels(gateway_pb2.ListModelsRequest()).models
    assert card.limits.max_text_tokens > 0
    _, _, uncapped = speak(stack.omni_gateway, "hello there", seed=11, max_tokens=card.limits.max_text_tokens + 1)
    assert b"".join(c.audio for c in uncapped) == b"".join(c.audio for c in on_omni)
    # the decoder's own refusals of a text spoken as written
    turn = common_pb2.ChatMessage(role="user", content=[common_pb2.ContentPart(text="hi")])
    for fields, name in (
        ({"messages": [turn]}, "messages"),
        ({"prompt": "hi", "instructions": "calm"}, "instructions"),
        ({"prompt": "hi", "output_modalities": OutputModality.TEXT.to_proto()}, "output_modalities"),
        ({"prompt": "hi", "task": common_pb2.REQUEST_TASK_EMBED}, "task"),
    ):
        err = refused(lambda f=fields: decoder_generate(stack.omni_decoder, request_id="verb", verbatim=True, **f))
        assert err.details().startswith(f"{name}: a text spoken as written (verbatim)"), err.details()


def test_fake_thinker_prompt_holds_the_instructions() -> None:
    backend = FakeBackend(role="thinker")
    backend.add_request(RequestSpec(request_id="a", prompt="hello", instructions="be brief"))
    assert bytes(backend._waiting[0].prompt_ids) == b"be brief\nhello"


def test_chat_prompt_puts_instructions_in_a_system_turn(tmp_path: Path) -> None:
    """Qwen3-Omni: the instructions are the system turn of the thinker's chat prompt."""
    from types import SimpleNamespace

    from decoder_svc.qwen3_omni.engine import ChatPrompts
    from decoder_svc.qwen3_omni.tiny import _ID, _tokenizer

    _tokenizer().save_pretrained(tmp_path)
    prompts = ChatPrompts(
        SimpleNamespace(path=tmp_path, config={"im_end_token_id": _ID["<|im_end|>"]}),
        max_model_len=2048,
    )
    plain = prompts.chat(RequestSpec(request_id="a", prompt="Hello world")).prompt_token_ids
    styled = prompts.chat(
        RequestSpec(request_id="b", prompt="Hello world", instructions="Speak in a calm voice.")
    ).prompt_token_ids
    tok = prompts.tokenizer
    text = tok.decode(styled)
    assert text.startswith(
        "<|im_start|>system\nSpeak in a calm voice.<|im_end|>\n<|im_start|>user\nHello world"
    )
    assert (
        styled[len(styled) - len(plain) :] == plain
    )  # the user turn and the generation prompt follow
    instr = tok("Speak in a calm voice.", add_special_tokens=False)["input_ids"]
    assert any(styled[i : i + len(instr)] == instr for i in range(len(styled)))


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (-1.0, "must be >= 0"),
        (float("nan"), "finite"),
        (float("inf"), "finite"),
        (301.0, "maximum of 300 s"),
    ],
)
def test_bad_max_audio_seconds_is_refused_naming_the_field(
    stack: Stack, value: float, fragment: str
) -> None:
    err = refused(lambda: speak(stack.tts_gateway, "hello", max_audio_seconds=value))
    assert (
        err.details().startswith("sampling_params.max_audio_seconds: ")
        and fragment in err.details()
    )
    err = refused(
        lambda: decoder_generate(
            stack.tts_decoder,
            request_id=f"bad-{value}",
            prompt="hello",
            sampling_params=common_pb2.SamplingParams(max_audio_seconds=value),
        )
    )
    assert err.details().startswith("sampling_params.max_audio_seconds: ")


def test_max_tokens_above_the_text_cap_is_refused(stack: Stack) -> None:
    err = refused(lambda: generate(stack.omni_gateway, "hello", "text", max_tokens=9000))
    assert err.details().startswith(
        "sampling_params.max_tokens: 9000 is above this deployment's maximum of 8191"
    )
    err = refused(
        lambda: decoder_generate(
            stack.omni_decoder,
            request_id="big",
            prompt="hello",
            sampling_params=common_pb2.SamplingParams(max_tokens=9000),
        )
    )
    assert err.details().startswith("sampling_params.max_tokens: ")


def test_decoder_refuses_caps_beyond_the_context_at_startup(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "decoder_svc", "--engine", "fake", "--listen", f"unix://{tmp_path / 'd.sock'}",
         "--deployment", f"lenbad{os.getpid()}", "--max-audio-seconds", "1000"],
        cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    assert run.returncode != 0
    assert (
        "--max-audio-seconds: 1000 s is 12500 codec frames, beyond the talker's context of 8192 tokens"
        in (run.stderr + run.stdout)
    )


# ---------------------------------------------------------------------------
# model_defaults, limits, ListModels.


def test_model_defaults_take_the_models_sampling_defaults() -> None:
    settings = DeploymentSettings.build(
        profile="tts", output_modalities=OutputModality.AUDIO, supports_instructions=False,
        facts=EngineFacts(12.5, 2048, 0, 0.9, 0.8, 50, "m"),
    )  # fmt: skip

    def spec(**sp) -> RequestSpec:
        req = decoder_pb2.GenerateRequest(
            request_id="r", prompt="hi", sampling_params=common_pb2.SamplingParams(**sp)
        )
        return spec_from_pb(req, "audio", settings)

    greedy = spec(seed=1)
    assert (greedy.temperature, greedy.top_p, greedy.top_k) == (0.0, 1.0, 0)
    defaults = spec(seed=1, model_defaults=True)
    assert (round(defaults.temperature, 6), round(defaults.top_p, 6), defaults.top_k) == (
        0.9,
        0.8,
        50,
    )
    given = spec(seed=1, model_defaults=True, temperature=0.5, top_k=5)
    assert (given.temperature, round(given.top_p, 6), given.top_k) == (0.5, 0.8, 5)


def test_limits_follow_the_context_and_options() -> None:
    produced, instructions = deployment_modalities(["thinker", "talker"])
    assert produced == OutputModality.TEXT | OutputModality.AUDIO and instructions
    assert deployment_modalities(["talker"]) == (OutputModality.AUDIO, False)
    facts = EngineFacts(12.5, 2048, 2048, 0.9, 1.0, 50, "tiny")
    s = DeploymentSettings.build(
        profile="omni", output_modalities=produced, supports_instructions=True, facts=facts
    )
    assert (s.max_audio_seconds, s.default_audio_seconds) == (163.76, 60.0)
    assert (s.default_text_tokens, s.max_text_tokens, s.context_tokens) == (512, 2047, 2048)
    assert (s.repetition_window, s.repetition_max_period) == (50, 8)
    assert s.audio_frames(0) == 750 and s.audio_frames(2) == 25 and s.audio_frames(0.01) == 1
    small = DeploymentSettings.build(
        profile="omni",
        output_modalities=produced,
        supports_instructions=True,
        facts=EngineFacts(12.5, 400, 256, 0.9, 1.0, 50, "x"),
    )
    assert (small.max_audio_seconds, small.default_audio_seconds, small.default_text_tokens) == (
        31.92,
        31.92,
        255,
    )
    for options, name in [
        (Options(max_audio_seconds=200), "--max-audio-seconds"),
        (Options(default_audio_seconds=200), "--default-audio-seconds"),
        (Options(default_text_tokens=5000), "--default-text-tokens"),
        (Options(repetition_window_s=0.5), "--repetition-window-s"),
    ]:
        with pytest.raises(InvalidArgumentError) as info:
            DeploymentSettings.build(
                profile="omni",
                output_modalities=produced,
                supports_instructions=True,
                facts=facts,
                options=options,
            )
        assert str(info.value).startswith(name + ":")
    off = DeploymentSettings.build(
        profile="omni",
        output_modalities=produced,
        supports_instructions=True,
        facts=facts,
        options=Options(repetition_window_s=0),
    )
    assert off.new_guard() is None


def test_decoder_info_and_list_models(stack: Stack) -> None:
    with grpc.insecure_channel(stack.tts_decoder) as ch:
        tts = decoder_pb2_grpc.DecoderServiceStub(ch).GetDecoderInfo(
            decoder_pb2.GetDecoderInfoRequest()
        )
    with grpc.insecure_channel(stack.omni_decoder) as ch:
        omni = decoder_pb2_grpc.DecoderServiceStub(ch).GetDecoderInfo(
            decoder_pb2.GetDecoderInfoRequest()
        )
    assert (tts.model, omni.model) == ("fake", "fake")
    assert list(tts.output_modalities) == [payload_pb2.OUTPUT_MODALITY_AUDIO]
    assert list(omni.output_modalities) == [
        payload_pb2.OUTPUT_MODALITY_TEXT,
        payload_pb2.OUTPUT_MODALITY_AUDIO,
    ]
    assert (tts.supports_instructions, omni.supports_instructions) == (False, True)
    expected = common_pb2.DeploymentLimits(
        default_audio_seconds=60, max_audio_seconds=300, context_tokens=8192, audio_frames_per_second=12.5,
        default_temperature=0.9, default_top_p=1.0, default_top_k=50, max_first_chunk_frames=25)  # fmt: skip
    assert tts.limits == expected
    expected.default_text_tokens, expected.max_text_tokens = 512, 8191
    # the fake thinker takes audio parts (decoder_svc.testing.fake_engine)
    expected.max_input_audio_parts, expected.max_input_audio_seconds = 4, 60
    assert omni.limits == expected

    for target, info in ((stack.tts_gateway, tts), (stack.omni_gateway, omni)):
        with grpc.insecure_channel(target) as ch:
            resp = gateway_pb2_grpc.OmniGatewayServiceStub(ch).ListModels(
                gateway_pb2.ListModelsRequest(), timeout=10
            )
        (card,) = resp.models
        assert card.id == "fake" and card.profile == info.profile
        assert list(card.output_modalities) == list(info.output_modalities)
        assert list(card.voices) == list(info.voices) and "default" in card.voices
        assert card.sample_rate_hz == 24000
        assert card.limits == info.limits
        assert card.supports_instructions == info.supports_instructions


def test_every_profile_states_a_finish_reason_on_the_last_output(stack: Stack) -> None:
    for target, modalities in (
        (stack.tts_gateway, "audio"),
        (stack.omni_gateway, "text+audio"),
        (stack.omni_gateway, "audio"),
        (stack.omni_gateway, "text"),
    ):
        outs = generate(target, "a short one", modalities, seed=9)
        assert outs[-1].finish_reason == "stop", (target, modalities)
        assert all(not o.finish_reason for o in outs[:-1])
    for target in (stack.tts_gateway, stack.omni_gateway):
        _, reason, _ = speak(target, "a short one", seed=9)
        assert reason == "stop"


def test_model_defaults_over_grpc_keeps_seeded_outputs_reproducible(stack: Stack) -> None:
    """The fake engine's outputs follow the seed; model_defaults must not break that."""
    a = speak(stack.tts_gateway, "same seed", seed=11, model_defaults=True)[2]
    b = speak(stack.tts_gateway, "same seed", seed=11, model_defaults=True)[2]
    c = speak(stack.tts_gateway, "same seed", seed=12, model_defaults=True)[2]
    pcm = [b"".join(x.audio for x in chunks) for chunks in (a, b, c)]
    assert pcm[0] == pcm[1] and pcm[0] != pcm[2]


def test_a_conversation_in_the_decoders_request():
    """GenerateRequest.messages: (role, text) turns; the prompt an engine
    without a chat template reads is the last user turn; refusals name the field."""

    def turn(role: str, *texts: str) -> common_pb2.ChatMessage:
        return common_pb2.ChatMessage(role=role, content=[common_pb2.ContentPart(text=t) for t in texts])

    req = decoder_pb2.GenerateRequest(request_id="r", messages=[
        turn("system", "be brief"), turn("user", "one"), turn("assistant", "a", "b"), turn("user", "two")])
    spec = spec_from_pb(req, "text+audio")
    assert spec.messages == (("system", "be brief"), ("user", "one"), ("assistant", "a\nb"), ("user", "two"))
    assert spec.prompt == "two" and not spec.instructions
    for fields, field in [
        ({"prompt": "hi", "messages": [turn("user", "x")]}, "messages"),
        ({"instructions": "calm", "messages": [turn("user", "x")]}, "instructions"),
        ({"messages": [turn("user", "x"), turn("assistant", "y")]}, "messages[1].role"),
        ({"messages": [turn("critic", "x")]}, "messages[0].role"),
        ({"messages": [turn("user")]}, "messages[0].content"),
    ]:
        with pytest.raises(InvalidArgumentError) as info:
            spec_from_pb(decoder_pb2.GenerateRequest(request_id="r", **fields), "audio")
        assert info.value.field == field, (fields, str(info.value))
