"""What a conversation asks of the thinker, served and checked: audio parts and stop sequences.

On the tiny checkpoint (its audio tower in the released layout), an omni
stack on vLLM takes audio parts (gRPC ``ContentPart.audio``, HTTP chat
``input_audio``) and stop sequences (``SamplingParams.stop``, chat ``stop``):

- parity with the reference: transformers' processor and
  ``Qwen3OmniMoeForConditionalGeneration.generate(return_audio=True)`` fed
  the same samples give the same greedy thinker ids and the same waveform
  (max abs diff <= 1e-4); the served prompt's token count (audio tokens
  included) is the reference processor's; the audio tower's output matches
  ``get_audio_features``;
- bad audio (corrupt, cut short, a format named wrongly, too long, too many
  parts, on a deployment that reads none) is refused with INVALID_ARGUMENT /
  400 naming the part's field, and the stack keeps serving;
- a stop sequence ends the text where it begins, and the speech equals the
  reference speaking the reply cut there (its thinker's reply fixed to the
  tokens before the sequence and the one it begins in, never spoken).
"""

from __future__ import annotations

import base64
import io
import json
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
import soundfile as sf
import torch

from omni_common.media import resample
from omni_serving.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.test_parity import _run_reference as _run_fixed_reply  # the reference with a given reply
from tests.test_parity import _stack

pytest.importorskip("vllm")
pytestmark = [pytest.mark.parity, pytest.mark.vllm, pytest.mark.e2e]

THINKER_TOKENS = 8
TALKER_FRAMES = 24  # the served cap; the reference runs one more (it drops its last step's frame)
RATE = 16000


def _clip(seconds: float, seed: int) -> np.ndarray:
    """A speech-like test clip at 16 kHz: a few harmonics under an envelope, some noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    f0 = 120 + 60 * rng.random()
    x = sum(np.sin(2 * np.pi * f0 * k * t + rng.random() * 6) / k for k in range(1, 6))
    x = x * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t)) * 0.2 + rng.standard_normal(t.size) * 0.01
    return x.astype(np.float32)


def _wav(samples: np.ndarray, rate: int = RATE, subtype: str = "FLOAT") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV", subtype=subtype)
    return buf.getvalue()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, checkpoint):
    s = _stack(tmp_path_factory, checkpoint, "omni", False)
    yield s
    assert s.stop() == []


def _run_reference(ref, messages: list[dict], clips: list[np.ndarray], voice: str):
    """(prompt tokens, thinker reply ids, waveform) of the reference for a conversation with audio."""
    text = ref.proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = ref.proc(text=text, audio=clips, return_tensors="pt")
    n = int(inputs["input_ids"].shape[1])
    with torch.no_grad():
        seqs, wav = ref.model.generate(
            **inputs, speaker=voice, return_audio=True,
            thinker_max_new_tokens=THINKER_TOKENS, thinker_do_sample=False,
            thinker_eos_token_id=ref.cfg.im_end_token_id,
            talker_do_sample=False, talker_max_new_tokens=TALKER_FRAMES + 1,
        )
    return n, seqs[0, n:].tolist(), wav.reshape(-1).float().numpy()


def _part(p) -> common_pb2.ContentPart:  # noqa: ANN001
    if isinstance(p, str):
        return common_pb2.ContentPart(text=p)
    if isinstance(p, common_pb2.ImageContent):
        return common_pb2.ContentPart(image=p)
    return common_pb2.ContentPart(audio=p)


def _generate(target: str, turns: list[tuple[str, list]], voice: str = "ethan", timeout: float = 300):
    """Generate's final output for a conversation whose parts are text or AudioContent."""
    with grpc.insecure_channel(target) as ch:
        stub = gateway_pb2_grpc.OmniGatewayServiceStub(ch)
        req = gateway_pb2.OmniGatewayServiceGenerateRequest(
            voice=voice, output_modalities="text+audio", output_kind=gateway_pb2.OUTPUT_KIND_FINAL_ONLY,
            messages=[common_pb2.ChatMessage(role=r, content=[_part(p) for p in parts]) for r, parts in turns],
            sampling_params=common_pb2.SamplingParams(temperature=0, max_tokens=THINKER_TOKENS,
                                                      max_audio_seconds=TALKER_FRAMES / 12.5))
        return [r.output for r in stub.Generate(req, timeout=timeout)][-1]


def _audio_of(final) -> np.ndarray:  # noqa: ANN001
    parts = [np.frombuffer(t.tensor.inline_data, dtype="<f4") for t in final.multimodal.tensors if t.name == "audio"]
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


CASES = {
    # a question asked aloud, with a text instruction after it
    "audio then text": ([("user", ["AUDIO0", "What is said here?"])], [(1.5, 1)]),
    # audio only, 24 kHz (resampled by the decoder), in a conversation with two clips
    "two clips": ([("system", ["You are a helpful voice."]), ("user", ["AUDIO0"]), ("assistant", ["I heard it."]),
                   ("user", ["Compare with this one:", "AUDIO1"])], [(1.0, 2), (2.0, 3)]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_audio_input_matches_reference(stack, reference, case):
    turns, specs = CASES[case]
    clips = [_clip(seconds, seed) for seconds, seed in specs]
    sent, heard = [], []
    for i, clip in enumerate(clips):
        if i == 1:  # sent at 24 kHz: the decoder resamples; the reference hears the same samples
            at24 = resample(clip, RATE, 24000)
            sent.append(common_pb2.AudioContent(data=_wav(at24, 24000)))
            heard.append(resample(at24, 24000, RATE))
        else:
            sent.append(common_pb2.AudioContent(data=_wav(clip)))
            heard.append(clip)
    # the decoder pads a clip to whole feature frames (160 samples): so does the reference here
    heard = [np.pad(h, (0, -len(h) % 160)) for h in heard]

    def ours(p):  # noqa: ANN001, ANN202
        return sent[int(p[5:])] if p.startswith("AUDIO") else p

    def theirs(p):  # noqa: ANN001, ANN202
        return {"type": "audio"} if p.startswith("AUDIO") else {"type": "text", "text": p}

    n_ref, ids_ref, wav_ref = _run_reference(
        reference, [{"role": r, "content": [theirs(p) for p in parts]} for r, parts in turns], heard, "ethan")
    final = _generate(stack.gateway_target, [(r, [ours(p) for p in parts]) for r, parts in turns])
    assert final.finished
    assert final.metrics.prompt_tokens == n_ref, "the prompt's tokens (audio tokens included) differ"
    assert list(final.text.token_ids) == ids_ref, f"thinker ids differ: {list(final.text.token_ids)} vs {ids_ref}"
    audio = _audio_of(final)
    assert audio.shape == wav_ref.shape, (audio.shape, wav_ref.shape)
    assert float(np.abs(audio - wav_ref).max()) <= 1e-4, "the waveform differs from the reference"


def _image(height: int, width: int, seed: int) -> np.ndarray:
    """A test image: smooth colour gradients and a few shapes (uint8 RGB)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    img = np.stack([np.sin(6 * x + rng.random() * 6), np.cos(5 * y + rng.random() * 6), np.sin(4 * (x + y))], -1)
    return ((img * 0.5 + 0.5) * 255).astype(np.uint8)


def _png(pixels: np.ndarray, fmt: str = "PNG") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


IMAGE_CASES = {
    # an image and a question about it
    "image then text": ([("user", ["IMAGE0", "What is in the picture?"])], [(120, 200, 1)]),
    # two images (one JPEG: the reference sees the decoded pixels) in a conversation (images and audio
    # together: transformers' talker fails on them, Qwen3OmniMoeTalkerConfig has no audio_config)
    "two images": ([("system", ["You are a helpful voice."]), ("user", ["IMAGE0", "and this one"]),
                    ("assistant", ["A chart."]), ("user", ["IMAGE1", "Which one is brighter?"])],
                   [(64, 96, 2), (150, 90, 3)]),
}


@pytest.mark.parametrize("case", sorted(IMAGE_CASES))
def test_image_input_matches_reference(stack, reference, case):
    from PIL import Image

    turns, specs = IMAGE_CASES[case]
    pixels = [_image(h, w, seed) for h, w, seed in specs]
    files = [_png(p, "JPEG" if i == 1 else "PNG") for i, p in enumerate(pixels)]
    seen = [np.asarray(Image.open(io.BytesIO(f)).convert("RGB")) for f in files]  # what the decoder decodes
    clip = _clip(1.0, 9)

    def ours(p):  # noqa: ANN001, ANN202
        if p.startswith("IMAGE"):
            return common_pb2.ContentPart(image=common_pb2.ImageContent(data=files[int(p[5:])]))
        if p.startswith("AUDIO"):
            return common_pb2.ContentPart(audio=common_pb2.AudioContent(data=_wav(clip)))
        return common_pb2.ContentPart(text=p)

    def theirs(p):  # noqa: ANN001, ANN202
        return {"type": "image"} if p.startswith("IMAGE") else {"type": "audio"} if p.startswith("AUDIO") \
            else {"type": "text", "text": p}

    text = reference.proc.apply_chat_template(
        [{"role": r, "content": [theirs(p) for p in parts]} for r, parts in turns], add_generation_prompt=True,
        tokenize=False)
    has_audio = any(p.startswith("AUDIO") for _, parts in turns for p in parts)
    inputs = reference.proc(text=text, images=[Image.fromarray(s) for s in seen],
                            audio=[clip] if has_audio else None, return_tensors="pt")
    n = int(inputs["input_ids"].shape[1])
    with torch.no_grad():
        seqs, wav = reference.model.generate(
            **inputs, speaker="ethan", return_audio=True, thinker_max_new_tokens=THINKER_TOKENS,
            thinker_do_sample=False, thinker_eos_token_id=reference.cfg.im_end_token_id,
            talker_do_sample=False, talker_max_new_tokens=TALKER_FRAMES + 1)
    ids_ref, wav_ref = seqs[0, n:].tolist(), wav.reshape(-1).float().numpy()
    with grpc.insecure_channel(stack.gateway_target) as ch:
        req = gateway_pb2.OmniGatewayServiceGenerateRequest(
            voice="ethan", output_modalities="text+audio", output_kind=gateway_pb2.OUTPUT_KIND_FINAL_ONLY,
            messages=[common_pb2.ChatMessage(role=r, content=[ours(p) for p in parts]) for r, parts in turns],
            sampling_params=common_pb2.SamplingParams(temperature=0, max_tokens=THINKER_TOKENS,
                                                      max_audio_seconds=TALKER_FRAMES / 12.5))
        final = [r.output for r in gateway_pb2_grpc.OmniGatewayServiceStub(ch).Generate(req, timeout=300)][-1]
    assert final.metrics.prompt_tokens == n, "the prompt's tokens (image tokens included) differ"
    assert list(final.text.token_ids) == ids_ref, f"thinker ids differ: {list(final.text.token_ids)} vs {ids_ref}"
    audio = _audio_of(final)
    assert audio.shape == wav_ref.shape, (audio.shape, wav_ref.shape)
    assert float(np.abs(audio - wav_ref).max()) <= 1e-4, "the waveform differs from the reference"


def test_a_text_request_beside_an_image_request_is_unchanged(stack):
    """The talker applies 3-D positions to the rows of a request with images
    only: a text request's audio is the same, bit for bit, alone and in the
    same steps as an image request."""
    import concurrent.futures

    text_turns = [("user", ["Say something about the weather."])]
    alone = _audio_of(_generate(stack.gateway_target, text_turns))
    image = common_pb2.ImageContent(data=_png(_image(120, 200, 5)))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        beside = pool.submit(_generate, stack.gateway_target, [("user", [image, "And this?"])])
        together = _audio_of(_generate(stack.gateway_target, text_turns))
        assert beside.result().finished
    assert alone.size and np.array_equal(alone, together)


def test_bad_images_are_refused_naming_the_part(stack):
    from PIL import Image

    target = stack.gateway_target
    png = _png(_image(40, 60, 6))
    big = io.BytesIO()
    Image.new("1", (6100, 6000)).save(big, format="PNG")  # 36.6 M pixels, a small file
    gif = io.BytesIO()
    Image.fromarray(_image(20, 20, 7)).save(gif, format="GIF")
    cases = [
        (png[: len(png) // 2], "cut short"),
        (b"not an image" * 10, "not an image file"),
        (gif.getvalue(), "GIF"),
        (big.getvalue(), "at most 36000000"),
        (_png(_image(2, 500, 8)), "200 times"),
        (b"", "is empty"),
    ]
    for data, words in cases:
        _refused(target, [("user", ["What is it?", common_pb2.ImageContent(data=data)])],
                 "messages[0].content[1].image.data", words)
    many = [common_pb2.ImageContent(data=png)] * 5
    _refused(target, [("user", many)], "messages[0].content[4].image", "at most 4")
    _idle(stack.decoder_target)
    final = _generate(target, [("user", [common_pb2.ImageContent(data=png), "What is it?"])], timeout=120)
    assert final.finished and final.text.token_ids


def _prefill_rows(thinker, specs) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Run ``specs`` on an in-process thinker (all added before its first step)
    to the end; each request's prefill rows of ``thinker_embed`` (every prompt
    position: its input embeddings, the encoders' output at media positions)."""
    from decoder_svc.qwen3_omni.backends import THINKER_EMBED

    for spec in specs:
        thinker.add_request(spec)
    rows: dict[str, torch.Tensor] = {}
    while thinker.has_unfinished():
        out = thinker.step()
        if out is None or THINKER_EMBED not in out.mm_outputs:
            continue
        embed, _ = out.mm_outputs[THINKER_EMBED]
        for i, rid in enumerate(out.request_ids):
            lo, hi = int(out.query_start_loc[i]), int(out.query_start_loc[i + 1])
            rows.setdefault(rid, embed[lo:hi])
    assert sorted(rows) == sorted(s.request_id for s in specs), "every request prefilled"
    return rows


ENCODER_TOLERANCE = 1e-5
"""The audio tower's output on vLLM against transformers' (float32, CPU): max abs diff."""


def test_the_audio_towers_output_matches_the_reference(checkpoint, reference):
    """The thinker in process (vLLM), two requests with audio in one step: the
    rows it hands the talker at audio positions (its input embeddings there:
    the audio tower's output) equal transformers' ``get_audio_features`` of
    each clip, within ENCODER_TOLERANCE."""
    from decoder_svc.backend import RequestSpec
    from decoder_svc.profile import load_profile
    from decoder_svc.qwen3_omni.engine import build_engine
    from decoder_svc.vllm_engine.engine_factory import get_model_runner
    from omni_common.media import AudioInput

    clips = [_clip(1.0, 6), _clip(2.56, 7)]
    engine = build_engine(load_profile("omni"), checkpoint, max_num_seqs=4)
    try:
        thinker = engine.backends["thinker"]
        # the thinker's M-RoPE lays the T/H/W sections out interleaved, as the
        # reference does (the checkpoint's mrope_interleaved; it matters for
        # image positions, whose three coordinates differ)
        rope = get_model_runner(thinker.engine).model.language_model.model.layers[0].self_attn.rotary_emb
        assert (rope.mrope_section, rope.mrope_interleaved) == ([12, 10, 10], True)
        specs = [engine.prepare(RequestSpec(request_id=f"a{i}", prompt="", max_tokens=1, audio=(clip,),
                                            messages=(("user", (AudioInput(b""), "What is it?")),)))
                 for i, clip in enumerate(clips)]
        rows = _prefill_rows(thinker, specs)
    finally:
        engine.close()
    audio_token = reference.cfg.thinker_config.audio_token_id
    fe = reference.proc.feature_extractor
    for spec in specs:
        feats = fe([spec.audio[0]], sampling_rate=RATE, padding=True, truncation=False, return_attention_mask=True,
                   return_tensors="pt")
        with torch.no_grad():
            ref = reference.model.thinker.get_audio_features(
                feats["input_features"], feature_attention_mask=feats["attention_mask"], return_dict=True
            ).last_hidden_state
        at = [i for i, t in enumerate(spec.prompt_token_ids) if t == audio_token]
        got = rows[spec.request_id][at]
        assert got.shape == ref.shape, (got.shape, ref.shape)
        assert float((got - ref).abs().max()) <= ENCODER_TOLERANCE, spec.request_id


def test_the_vision_towers_output_matches_the_reference(checkpoint, reference):
    """As the audio tower's: two requests with an image in one step; the
    rows at image positions equal transformers' ``get_image_features``
    (its merged patches), within ENCODER_TOLERANCE."""
    from decoder_svc.backend import RequestSpec
    from decoder_svc.profile import load_profile
    from decoder_svc.qwen3_omni.engine import build_engine
    from omni_common.media import ImageInput

    images = [_image(120, 200, 10), _image(64, 96, 11)]
    engine = build_engine(load_profile("omni"), checkpoint, max_num_seqs=4)
    try:
        thinker = engine.backends["thinker"]
        specs = [engine.prepare(RequestSpec(request_id=f"i{i}", prompt="", max_tokens=1, images=(image,),
                                            messages=(("user", (ImageInput(b""), "What is it?")),)))
                 for i, image in enumerate(images)]
        rows = _prefill_rows(thinker, specs)
    finally:
        engine.close()
    from PIL import Image

    image_token = reference.cfg.thinker_config.image_token_id
    for spec, image in zip(specs, images, strict=True):
        inputs = reference.proc.image_processor(images=[Image.fromarray(image)], return_tensors="pt")
        with torch.no_grad():
            ref = reference.model.thinker.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"],
                                                             return_dict=True).pooler_output
        ref = torch.cat(list(ref)) if isinstance(ref, (list, tuple)) else ref
        at = [i for i, t in enumerate(spec.prompt_token_ids) if t == image_token]
        got = rows[spec.request_id][at]
        assert got.shape == ref.shape, (got.shape, ref.shape)
        assert float((got - ref).abs().max()) <= ENCODER_TOLERANCE, spec.request_id


def _idle(target_decoder: str) -> None:
    """Nothing of the refused requests stays: no request running, no arena slot held."""
    from omni_serving.v1 import decoder_pb2, decoder_pb2_grpc

    with grpc.insecure_channel(target_decoder) as ch:
        info = decoder_pb2_grpc.DecoderServiceStub(ch).GetDecoderInfo(decoder_pb2.GetDecoderInfoRequest(), timeout=30)
    assert info.active_requests == 0, info


def _refused(target: str, turns, field: str, words: str) -> None:  # noqa: ANN001
    with pytest.raises(grpc.RpcError) as err:
        _generate(target, turns, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    details = err.value.details()  # the gateway relays the decoder's refusal ("decoder: INVALID_ARGUMENT: ...")
    assert f"{field}: " in details, details
    assert words in details, details


def test_bad_audio_is_refused_naming_the_part_and_the_stack_keeps_serving(stack):
    target = stack.gateway_target
    wav = _wav(_clip(1.0, 4), subtype="PCM_16")
    ask = "What is said?"
    cases = [
        (common_pb2.AudioContent(data=b"this is not audio" * 20), "data", "not an audio file"),
        (common_pb2.AudioContent(data=wav[: len(wav) // 2]), "data", "cut short"),
        (common_pb2.AudioContent(data=wav, format="mp3"), "format", "WAV"),
        (common_pb2.AudioContent(data=wav, format="aiff"), "format", "unknown format"),
        (common_pb2.AudioContent(data=b"\0\0" * 100, format="pcm16"), "sample_rate", "sample rate"),
        (common_pb2.AudioContent(data=b""), "data", "empty"),
        (common_pb2.AudioContent(data=_wav(np.zeros(61 * RATE, np.float32))), "data", "at most 60 s"),
    ]
    for content, field, words in cases:
        _refused(target, [("user", [ask, content])], f"messages[0].content[1].audio.{field}", words)
    many = [common_pb2.AudioContent(data=wav)] * 5
    _refused(target, [("user", many)], "messages[0].content[4].audio", "at most 4")
    _idle(stack.decoder_target)
    # still serving, audio included
    final = _generate(target, [("user", [common_pb2.AudioContent(data=wav), ask])], timeout=120)
    assert final.finished and final.text.token_ids


def test_chat_completions_take_input_audio_and_images(stack):
    url = f"{stack.http_url}/v1/chat/completions"
    wav = _wav(_clip(1.0, 5), subtype="PCM_16")

    def post(content: list) -> tuple[int, dict]:
        body = {"model": "m", "max_completion_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": content}]}
        req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    audio_part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}
    status, out = post([{"type": "text", "text": "What is said?"}, audio_part])
    assert status == 200, out
    text_only_status, text_only = post([{"type": "text", "text": "What is said?"}])
    assert text_only_status == 200, text_only
    # the audio's tokens count in the prompt
    assert out["usage"]["prompt_tokens"] > text_only["usage"]["prompt_tokens"] + 5, (out["usage"], text_only["usage"])
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                      + base64.b64encode(_png(_image(64, 64, 9))).decode()}}
    status, seen = post([{"type": "text", "text": "What is said?"}, image])
    # 64 x 64 pixels: 4 x 4 patches, merged 2 x 2: 4 image tokens, and the vision start and end
    assert status == 200 and seen["usage"]["prompt_tokens"] == text_only["usage"]["prompt_tokens"] + 6, seen
    bad = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav[:2000]).decode(), "format": "wav"}}
    status, err = post([bad])
    assert status == 400 and err["error"]["param"] == "messages[0].content[0].input_audio.data", err
    assert "messages[0].content[0].input_audio.data: is cut short" in err["error"]["message"], err
    status, err = post([{"type": "input_audio", "input_audio": {"data": "not base64!", "format": "wav"}}])
    assert status == 400 and err["error"]["param"] == "messages[0].content[0].input_audio.data", err
    status, err = post([{"type": "input_audio", "input_audio": {"data": "", "format": "aac"}}])
    assert status == 400 and err["error"]["param"] == "messages[0].content[0].input_audio.format", err


def test_a_stop_sequence_ends_the_text_and_the_speech_where_it_begins(stack, reference):
    tok = reference.proc.tokenizer
    text_prompt = "Hello world, this is a test."

    def served(modalities: str, stop: list[str]):  # noqa: ANN202
        with grpc.insecure_channel(stack.gateway_target) as ch:
            req = gateway_pb2.OmniGatewayServiceGenerateRequest(
                prompt=text_prompt, voice="ethan", output_modalities=modalities,
                output_kind=gateway_pb2.OUTPUT_KIND_FINAL_ONLY,
                sampling_params=common_pb2.SamplingParams(temperature=0, max_tokens=16, stop=stop,
                                                          max_audio_seconds=TALKER_FRAMES / 12.5))
            return [r.output for r in gateway_pb2_grpc.OmniGatewayServiceStub(ch).Generate(req, timeout=300)][-1]

    whole = served("text", [])
    ids, text = list(whole.text.token_ids), whole.text.text
    ends = [len(tok.decode(ids[: j + 1], skip_special_tokens=True)) for j in range(len(ids))]
    assert ends[-1] == len(text) and len(ids) >= 8, (ids, text)
    # a sequence that begins inside a token (its second character) and spans the next ones
    k0 = next(j for j in range(3, len(ids) - 2) if ends[j] - ends[j - 1] >= 2)
    stop = text[ends[k0 - 1] + 1: ends[k0 + 1] + 1]
    at = text.find(stop)
    k = next(j for j in range(len(ids)) if ends[j] > at)  # the token the sequence begins in
    text_only = served("text", [stop])
    assert text_only.finish_reason == "stop" and text_only.text.text == text[:at], (text_only.text.text, text, stop)
    cut = served("text+audio", ["never-here", stop])  # (its finish reason is the speech's: it may reach its cap)
    assert cut.text.text == text[:at], (cut.text.text, text[:at])
    assert list(cut.text.token_ids) == ids[: k + 1 if at > (ends[k - 1] if k else 0) else k]
    rendered = tok.apply_chat_template([{"role": "user", "content": text_prompt}], add_generation_prompt=True,
                                       tokenize=True)
    prompt_ids = list(rendered if isinstance(rendered, list) else rendered["input_ids"])
    _, _, wav_ref = _run_fixed_reply(reference, prompt_ids, "ethan", TALKER_FRAMES + 1, 0, ids[: k + 1])
    audio = _audio_of(cut)
    assert audio.shape == wav_ref.shape, (audio.shape, wav_ref.shape)
    assert float(np.abs(audio - wav_ref.numpy()).max()) <= 1e-4, "the speech of the cut reply differs"
