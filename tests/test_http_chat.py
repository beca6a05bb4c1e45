"""``POST /v1/chat/completions`` through the official `openai` client.

The text and audio of a chat completion must equal, byte for byte, what
gRPC ``Generate`` returns for the same prompt, seed and sampling settings:
on the three real services with the fake engine's omni profile (thinker ->
talker -> code2wav), and (``vllm``) on the tiny Qwen3-Omni checkpoint.
Field validation runs against `FakeDecoder`, a test double.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import wave
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest
from fakes import FakeDecoder, FakeDecoderConfig, GatewayThread

from gateway.audio import pcm16le
from omni_common.tensor_wire import decode_inline
from omni_serving.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from omni_stack.config import StackConfig
from omni_stack.stack import Stack

CHAT = "/v1/chat/completions"
PROMPT = "Tell me about the weather today"


@dataclass
class Generated:
    text: str
    tokens: int
    pcm: bytes
    finish_reason: str


def grpc_generate(
    target: str,
    prompt: str,
    modalities: str,
    seed: int,
    *,
    max_tokens: int = 0,
    instructions: str = "",
    voice: str = "",
    messages: list[tuple[str, str]] | None = None,
) -> Generated:
    """What gRPC Generate returns, as the chat endpoint asks for it (delta outputs,
    the model's sampling defaults); with `messages` ((role, text) turns) instead of `prompt`."""
    request = gateway_pb2.OmniGatewayServiceGenerateRequest(
        prompt="" if messages else prompt,
        messages=[common_pb2.ChatMessage(role=r, content=[common_pb2.ContentPart(text=t)])
                  for r, t in messages or []],
        output_modalities=modalities,
        output_kind=gateway_pb2.OUTPUT_KIND_DELTA,
        voice=voice,
        instructions=instructions,
        sampling_params=common_pb2.SamplingParams(
            seed=seed, max_tokens=max_tokens, model_defaults=True
        ),
    )
    text, tokens, pcm, finish = [], 0, [], ""
    with grpc.insecure_channel(target) as channel:
        stub = gateway_pb2_grpc.OmniGatewayServiceStub(channel)
        for response in stub.Generate(request, timeout=300):
            output = response.output
            text.append(output.text.text)
            tokens += len(output.text.token_ids)
            for named in output.multimodal.tensors:
                if named.name == "audio":
                    pcm.append(pcm16le(decode_inline(named.tensor)))
            if output.finished:
                finish = output.finish_reason
    return Generated("".join(text), tokens, b"".join(pcm), finish)


def sdk(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)


def chat_stream(port: int, **kwargs) -> tuple[Generated, list]:
    """Stream a completion with the SDK; (what it carried, every chunk)."""
    chunks = list(sdk(port).chat.completions.create(stream=True, **kwargs))
    text, pcm, finish = [], [], ""
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        if delta.content:
            text.append(delta.content)
        if delta.audio is not None:
            audio = delta.audio
            text.append(audio.transcript or "")
            if audio.data:
                pcm.append(base64.b64decode(audio.data))
        if choice.finish_reason:
            finish = choice.finish_reason
    usage = chunks[-1].usage
    tokens = usage.completion_tokens if usage is not None else -1
    return Generated("".join(text), tokens, b"".join(pcm), finish), chunks


def post(port: int, body: object) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", CHAT, body=raw, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def start_stack(tmp_path_factory, profile: str, **config) -> Stack:
    stack = Stack(
        StackConfig(
            profile=profile,
            runtime_dir=str(tmp_path_factory.mktemp("rt")),
            port=0,
            http_port=0,
            log_level="WARNING",
            **config,
        )
    )
    stack.start(timeout_s=config.get("startup_timeout", 300))
    return stack


@pytest.fixture(scope="module")
def omni(tmp_path_factory) -> Iterator[Stack]:
    stack = start_stack(tmp_path_factory, "omni", engine="fake")
    yield stack
    assert stack.stop() == []


def check_stream_equals_grpc(stack: Stack, seed: int, max_tokens: int | None = None, prompt_tokens: int = 0) -> None:
    """The SDK's stream equals gRPC Generate; its usage counts ``prompt_tokens``
    (the prompt in the model's chat template; 0 with the fake engine, which
    does not tokenize) and the reply's tokens."""
    extra = {} if max_tokens is None else {"max_completion_tokens": max_tokens}
    (card,) = sdk(stack.cfg.http_port).models.list().data
    voice = (card.model_extra or {})["voices"][-1]
    got, chunks = chat_stream(
        stack.cfg.http_port,
        model="omni",
        messages=[{"role": "user", "content": PROMPT}],
        modalities=["text", "audio"],
        audio={"voice": voice, "format": "pcm16"},
        seed=seed,
        stream_options={"include_usage": True},
        **extra,
    )
    want = grpc_generate(
        stack.gateway_target, PROMPT, "text+audio", seed, max_tokens=max_tokens or 0, voice=voice
    )
    assert want.text and want.pcm, "gRPC Generate produced no text or no audio"
    assert got.text == want.text
    assert len(got.pcm) == len(want.pcm) and got.pcm == want.pcm
    assert got.finish_reason == want.finish_reason
    assert got.tokens == want.tokens
    # OpenAI's shape: role first, then audio deltas with one id, the expiry
    # in the last audio update, the finish chunk, the usage chunk.
    assert chunks[0].choices[0].delta.role == "assistant"
    ids = {c.choices[0].delta.audio.id for c in chunks if c.choices and c.choices[0].delta.audio}
    assert len(ids) == 1
    last_audio = [c for c in chunks if c.choices and c.choices[0].delta.audio][-1]
    assert last_audio.choices[0].delta.audio.expires_at is not None
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.total_tokens) == (prompt_tokens, prompt_tokens + want.tokens), usage
    assert all(c.choices[0].delta.content is None for c in chunks[1:] if c.choices)


@pytest.mark.e2e
def test_sdk_stream_text_and_audio_equal_grpc_generate(omni: Stack) -> None:
    check_stream_equals_grpc(omni, seed=7)
    check_stream_equals_grpc(omni, seed=8)


@pytest.mark.e2e
def test_sdk_whole_wav_equals_grpc_generate(omni: Stack) -> None:
    completion = sdk(omni.cfg.http_port).chat.completions.create(
        model="omni",
        messages=[
            {"role": "assistant", "content": "Hello, how can I help?"},
            {"role": "user", "content": [{"type": "text", "text": PROMPT}]},
        ],
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "wav"},
        seed=3,
    )
    # every turn reaches the model, as gRPC Generate's messages
    want = grpc_generate(omni.gateway_target, "", "text+audio", 3, voice="alloy",
                         messages=[("assistant", "Hello, how can I help?"), ("user", PROMPT)])
    assert want.text != grpc_generate(omni.gateway_target, PROMPT, "text+audio", 3, voice="alloy").text
    message = completion.choices[0].message
    assert message.content is None
    assert message.audio.transcript == want.text
    with wave.open(io.BytesIO(base64.b64decode(message.audio.data))) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        assert w.readframes(w.getnframes()) == want.pcm
    assert completion.choices[0].finish_reason == want.finish_reason
    assert completion.usage.completion_tokens == want.tokens
    assert completion.object == "chat.completion"


@pytest.mark.e2e
def test_text_only_and_token_cap(omni: Stack) -> None:
    client = sdk(omni.cfg.http_port)
    completion = client.chat.completions.create(
        model="omni", messages=[{"role": "user", "content": PROMPT}], seed=5
    )
    want = grpc_generate(omni.gateway_target, PROMPT, "text", 5)
    assert completion.choices[0].message.content == want.text
    assert completion.choices[0].message.audio is None
    assert completion.choices[0].finish_reason == "stop" == want.finish_reason
    capped = client.chat.completions.create(
        model="omni", messages=[{"role": "user", "content": PROMPT}], seed=5, max_tokens=3
    )
    assert capped.choices[0].message.content == want.text[:3]
    assert capped.choices[0].finish_reason == "length"
    assert capped.usage.completion_tokens == 3
    streamed, _ = chat_stream(
        omni.cfg.http_port,
        model="omni",
        messages=[{"role": "user", "content": PROMPT}],
        seed=5,
        max_completion_tokens=3,
    )
    assert (streamed.text, streamed.finish_reason) == (want.text[:3], "length")


@pytest.mark.e2e
def test_system_message_is_the_instructions(omni: Stack) -> None:
    style = "Answer cheerfully."
    got, _ = chat_stream(
        omni.cfg.http_port,
        model="omni",
        messages=[
            {"role": "system", "content": style},
            {"role": "user", "content": PROMPT},
        ],
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "pcm16"},
        seed=2,
    )
    want = grpc_generate(
        omni.gateway_target, PROMPT, "text+audio", 2, instructions=style, voice="alloy"
    )
    assert (got.text, got.pcm, got.finish_reason) == (want.text, want.pcm, want.finish_reason)


@pytest.mark.e2e
def test_models_card_of_the_omni_profile(omni: Stack) -> None:
    (card,) = sdk(omni.cfg.http_port).models.list().data
    extra = card.model_extra or {}
    assert extra["profile"] == "omni"
    assert extra["modalities"] == ["text", "audio"]
    assert extra["supports_instructions"] is True
    assert extra["limits"]["max_text_tokens"] > 0 and extra["limits"]["max_audio_seconds"] > 0


@pytest.mark.e2e
def test_modalities_the_deployment_cannot_produce_are_400(tmp_path_factory) -> None:
    stack = start_stack(tmp_path_factory, "tts", engine="fake")
    try:
        with pytest.raises(openai.BadRequestError) as info:
            sdk(stack.cfg.http_port).chat.completions.create(
                model="tts",
                messages=[{"role": "user", "content": "hello"}],
                modalities=["text", "audio"],
                audio={"voice": "alloy", "format": "wav"},
            )
        error = info.value.response.json()["error"]
        assert error["param"] == "modalities", error
        # Audio alone it can produce: the spoken text, no transcript.
        completion = sdk(stack.cfg.http_port).chat.completions.create(
            model="tts",
            messages=[{"role": "user", "content": "hello"}],
            modalities=["audio"],
            audio={"voice": "alloy", "format": "pcm16"},
            seed=1,
        )
        want = grpc_generate(stack.gateway_target, "hello", "audio", 1, voice="alloy")
        assert base64.b64decode(completion.choices[0].message.audio.data) == want.pcm
    finally:
        assert stack.stop() == []


# --- validation, against the FakeDecoder test double ------------------------------


@pytest.fixture
def gateway(sock_dir: Path) -> Iterator[tuple[GatewayThread, FakeDecoder]]:
    with (
        FakeDecoder(sock_dir / "decoder.sock", FakeDecoderConfig(num_chunks=3)) as fake,
        GatewayThread(
            fake.target, sock_dir, http_host="127.0.0.1", http_port=0, max_text_chars=100
        ) as gw,
    ):
        yield gw, fake


USER = [{"role": "user", "content": "hi"}]
AUDIO = {"modalities": ["text", "audio"], "audio": {"voice": "alice", "format": "pcm16"}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": USER}, "model"),
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": "hi"}, "messages"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),  # not the user's
        ({"model": "m", "messages": [*USER, {"role": "assistant", "content": "x"}]}, "messages[1].role"),
        (  # an earlier audio reply without its transcript: audio is not kept
            {"model": "m", "messages": [{"role": "assistant", "audio": {"id": "a1"}}, *USER]},
            "messages[0].content",
        ),
        (  # the conversation's text, all turns together, within the limit (100 here)
            {"model": "m", "messages": [{"role": "user", "content": "x" * 60}, {"role": "assistant", "content": "y"},
                                        {"role": "user", "content": "z" * 40}]},
            "messages[2].content",
        ),
        ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"model": "m", "messages": [{"content": "x"}]}, "messages[0].role"),
        ({"model": "m", "messages": [{"role": "user"}]}, "messages[0].content"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"model": "m", "messages": [{"role": "user", "content": ""}]}, "messages[0].content"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x" * 101}]},
            "messages[0].content",
        ),
        (
            {
                "model": "m",
                "messages": [{"role": "user", "content": [{"type": "file", "file": {}}]}],
            },
            "messages[0].content[0].type",
        ),
        *[  # image parts: checked by the gateway, then against the deployment (the fake one reads no images)
            ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", **part}]}]},
             "messages[0].content[0].image_url" + suffix)
            for part, suffix in [
                ({}, ""),
                ({"image_url": {}}, ".url"),
                ({"image_url": {"url": "https://example.com/cat.png"}}, ".url"),  # nothing is fetched
                ({"image_url": {"url": "data:image/png;base64,%%%"}}, ".url"),
                ({"image_url": {"url": "data:image/png;base64,iVBORw0KGgo=", "detail": "huge"}}, ".detail"),
                ({"image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}, ""),  # fine here; no image input there
            ]
        ],
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages[0].content[0].text",
        ),
        *[  # audio parts: checked by the gateway, then against the deployment (the fake one reads no audio)
            ({"model": "m", "messages": [{"role": "user", "content": [{"type": "input_audio", **part}]}]},
             "messages[0].content[0].input_audio" + suffix)
            for part, suffix in [
                ({}, ""),
                ({"input_audio": {"data": "bm90IGJhc2U2NA", "format": "wav"}}, ".data"),  # unpadded base64
                ({"input_audio": {"data": "AAAA", "format": "aac"}}, ".format"),
                ({"input_audio": {"data": 5, "format": "wav"}}, ".data"),
                ({"input_audio": {"data": "UklGRg==", "format": "wav"}}, ""),  # fine here; no audio input there
            ]
        ],
        ({"model": "m", "messages": ["hi"]}, "messages[0]"),
        ({"model": "m", "messages": USER, "modalities": "text"}, "modalities"),
        ({"model": "m", "messages": USER, "modalities": []}, "modalities"),
        ({"model": "m", "messages": USER, "modalities": ["video"]}, "modalities"),
        ({"model": "m", "messages": USER, "modalities": ["audio"]}, "audio"),
        ({"model": "m", "messages": USER, **AUDIO, "audio": "alice"}, "audio"),
        ({"model": "m", "messages": USER, **AUDIO, "audio": {"format": "wav"}}, "audio.voice"),
        ({"model": "m", "messages": USER, **AUDIO, "audio": {"voice": "alice"}}, "audio.format"),
        (
            {"model": "m", "messages": USER, **AUDIO, "audio": {"voice": "x", "format": "mp3"}},
            "audio.format",
        ),
        (
            {
                "model": "m",
                "messages": USER,
                **AUDIO,
                "audio": {"voice": "alice", "format": "wav"},
                "stream": True,
            },
            "audio.format",
        ),
        (
            {"model": "m", "messages": USER, **AUDIO, "audio": {"voice": "zed", "format": "wav"}},
            "audio.voice",
        ),
        ({"model": "m", "messages": USER, "stream": "yes"}, "stream"),
        (
            {"model": "m", "messages": USER, "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        (
            {
                "model": "m",
                "messages": USER,
                "stream": True,
                "stream_options": {"include_usage": 1},
            },
            "stream_options.include_usage",
        ),
        ({"model": "m", "messages": USER, "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "messages": USER, "max_completion_tokens": "9"}, "max_completion_tokens"),
        ({"model": "m", "messages": USER, "temperature": 3}, "temperature"),
        ({"model": "m", "messages": USER, "top_p": 1.5}, "top_p"),
        ({"model": "m", "messages": USER, "seed": 2**63}, "seed"),
        ({"model": "m", "messages": USER, "n": 2}, "n"),
        (
            {"model": "m", "messages": [{"role": "system", "content": "be brief"}, *USER]},
            "messages",
        ),
    ],
    ids=lambda v: json.dumps(v)[:60] if isinstance(v, dict) else v,
)
def test_bad_fields_are_400_naming_them(gateway, body: dict, param: str) -> None:
    gw, _ = gateway
    status, content = post(gw.http_port, body)
    assert status == 400, content
    error = json.loads(content)["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"a_future_field": [1, 2]}, "a_future_field"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logit_bias": {"50256": -100}}, "logit_bias"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"presence_penalty": False}, "presence_penalty"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"store": True}, "store"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        ({"web_search_options": {}}, "web_search_options"),
    ],
    ids=lambda v: json.dumps(v)[:40] if isinstance(v, dict) else v,
)
def test_fields_the_server_does_not_implement_are_400_naming_them(gateway, extra: dict, param: str) -> None:
    """Never silently ignored: an unknown field, or one of OpenAI's that this
    server does not implement at a value that asks for something."""
    gw, fake = gateway
    before = len(fake.state.requests)
    status, content = post(gw.http_port, {"model": "m", "messages": USER, **extra})
    assert status == 400, content
    error = json.loads(content)["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert len(fake.state.requests) == before, "a refused request reached the decoder"


def test_fields_at_values_that_ask_for_nothing_are_accepted(gateway) -> None:
    gw, _ = gateway
    inert = {"stop": None, "tools": [], "tool_choice": "none", "logprobs": False, "top_logprobs": 0,
             "logit_bias": {}, "frequency_penalty": 0, "presence_penalty": 0.0,
             "response_format": {"type": "text"}, "store": False, "service_tier": "auto",
             "parallel_tool_calls": True, "prompt_cache_key": "k", "safety_identifier": "s", "verbosity": None}
    status, content = post(gw.http_port, {"model": "m", "messages": USER, **inert})
    assert status == 200, content


@pytest.mark.parametrize("stop, param", [(5, "stop"), ([1], "stop[0]"), ([""], "stop[0]"), (["a"] * 5, "stop"),
                                         (["x" * 129], "stop[0]")])
def test_bad_stop_sequences_are_400_naming_them(gateway, stop: object, param: str) -> None:
    gw, fake = gateway
    before = len(fake.state.requests)
    status, content = post(gw.http_port, {"model": "m", "messages": USER, "stop": stop})
    assert status == 400, content
    assert json.loads(content)["error"]["param"] == param, content
    assert len(fake.state.requests) == before, "a refused request reached the decoder"


def test_stop_sequences_reach_the_decoder_where_a_text_stage_reads_them(sock_dir: Path) -> None:
    """A string or an array, as OpenAI takes them: the decoder's
    sampling_params.stop; refused (400 naming stop) without a text stage."""
    for text_stage, stop, sent in ((True, "END", ["END"]), (True, ["a", "b c"], ["a", "b c"]), (False, "END", None)):
        with (
            FakeDecoder(sock_dir / "decoder.sock", FakeDecoderConfig(num_chunks=2,
                                                                     supports_instructions=text_stage)) as fake,
            GatewayThread(fake.target, sock_dir, http_host="127.0.0.1", http_port=0) as gw,
        ):
            status, content = post(gw.http_port, {"model": "m", "messages": USER, "stop": stop})
            if sent is None:
                assert status == 400 and json.loads(content)["error"]["param"] == "stop", content
                assert not fake.state.requests
            else:
                assert status == 200, content
                assert list(fake.state.requests[-1].sampling_params.stop) == sent


def test_a_conversation_reaches_the_decoder_turn_by_turn(sock_dir: Path) -> None:
    """Every turn, in order (developer as system), on a deployment with a
    text stage; refused (400 naming messages) on one without."""
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "answer"}]},
        {"role": "user", "content": "second question"},
    ]
    for text_stage in (True, False):
        with (
            FakeDecoder(sock_dir / "decoder.sock", FakeDecoderConfig(num_chunks=2,
                                                                     supports_instructions=text_stage)) as fake,
            GatewayThread(fake.target, sock_dir, http_host="127.0.0.1", http_port=0) as gw,
        ):
            status, content = post(gw.http_port, {"model": "m", "messages": messages})
            if not text_stage:
                assert status == 400 and json.loads(content)["error"]["param"] == "messages", content
                assert not fake.state.requests
                continue
            assert status == 200, content
            sent = fake.state.requests[-1]
            assert sent.prompt == "" and not sent.instructions
            assert [(m.role, [p.text for p in m.content]) for m in sent.messages] == [
                ("system", ["be brief"]), ("user", ["first question"]), ("assistant", ["first\nanswer"]),
                ("user", ["second question"])]


def test_fields_reach_the_decoder(gateway) -> None:
    gw, fake = gateway
    body = {
        "model": "m",
        "messages": [  # one user turn: the prompt
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ],
        "modalities": ["audio", "text"],
        "audio": {"voice": {"id": "bob"}, "format": "wav"},
        "max_tokens": 9,
        "max_completion_tokens": 12,
        "top_p": 0.5,
        "seed": 4,
        "user": "someone",
        "metadata": {"k": "v"},
    }
    status, content = post(gw.http_port, body)
    assert status == 200, content
    sent = fake.state.requests[-1]
    assert sent.prompt == "a\nb" and sent.voice == "bob" and not sent.instructions
    params = sent.sampling_params
    assert (params.max_tokens, params.seed, params.model_defaults) == (12, 4, True)
    assert params.top_p == pytest.approx(0.5)
    # The fake speaks without text: the WAV holds the decoder's audio, exactly.
    message = json.loads(content)["choices"][0]["message"]
    wav = base64.b64decode(message["audio"]["data"])
    speak = gateway_pb2.SpeakRequest(
        text="a\nb", voice="bob", sampling_params=common_pb2.SamplingParams(seed=4)
    )
    assert wav[44:] == b"".join(c.audio for c in gw.stub.Speak(speak, timeout=10))
    assert message["audio"]["transcript"] == "" and message["content"] is None
    # usage: the decoder's prompt token count (the fake's: the prompt's words) and no text tokens
    assert json.loads(content)["usage"] == {"prompt_tokens": 2, "completion_tokens": 0, "total_tokens": 2}
    temperature = {**body, "temperature": 0.0}
    assert post(gw.http_port, temperature)[0] == 200
    params = fake.state.requests[-1].sampling_params
    assert not params.model_defaults and params.temperature == 0.0


def test_mid_stream_failure_raises_in_the_sdk(sock_dir: Path) -> None:
    config = FakeDecoderConfig(num_chunks=10, fail_after=3)
    with (
        FakeDecoder(sock_dir / "d.sock", config) as fake,
        GatewayThread(fake.target, sock_dir, http_host="127.0.0.1", http_port=0) as gw,
    ):
        stream = sdk(gw.http_port).chat.completions.create(
            model="m",
            messages=USER,
            modalities=["audio"],
            audio={"voice": "alice", "format": "pcm16"},
            stream=True,
        )
        with pytest.raises(openai.APIError):
            for _ in stream:
                pass


# --- the real model ---------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.e2e
@pytest.mark.timeout(900)  # a vLLM omni stack started, used and stopped: 290 s on busy cores
def test_vllm_tiny_omni_chat_stream_equals_grpc_generate(tmp_path_factory, tiny_checkpoint) -> None:
    pytest.importorskip("vllm")
    checkpoint = tiny_checkpoint
    # the chat request sets no audio cap: 4 s of audio, not the 60 s default
    stack = start_stack(tmp_path_factory, "omni", engine="vllm", model=str(checkpoint),
                        extra_decoder_args=["--default-audio-seconds", "4"])
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(checkpoint)).apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    try:
        check_stream_equals_grpc(stack, seed=11, max_tokens=6, prompt_tokens=len(ids))
    finally:
        assert stack.stop() == []
