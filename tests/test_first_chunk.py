"""The first audio chunk: chosen per request by load, or fixed by the request.

* Units: the chunk boundaries with a first chunk, the profile's
  ``first_chunk_by_load`` (lookup and refusals), the shipped profiles.
* code2wav on a thread and in a worker process (fake engine's vocoder, exact
  under any chunking): a request's first chunk sets its chunks, the rest end
  where the ramp's do, and the audio is the same.
* The real stack (fake engine, a profile with a load table): a lone request
  gets the first step's chunk, one that starts with two others in flight gets
  the next step's; a request's own ``first_chunk_frames`` wins; the chunk
  frames are reported in the metrics; out-of-range values are refused naming
  the field on gRPC (gateway and decoder) and HTTP.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml

from decoder_svc.code2wav.chunking import SAMPLES_PER_FRAME, chunk_boundaries
from decoder_svc.code2wav.pool import Code2WavProcessPool
from decoder_svc.code2wav.thread import Code2WavWorker
from decoder_svc.profile import PROFILE_DIR, StageConfig, load_profile
from decoder_svc.testing.fake_engine import FAKE_LOOP_MARKER, FAKE_SLOW_MARKER, FakeVocoderFactory
from omni_common.errors import InvalidArgumentError
from omni_serving.v1 import common_pb2, decoder_pb2, decoder_pb2_grpc, gateway_pb2, gateway_pb2_grpc


def first(n: int, gen) -> list[int]:
    return [next(gen) for _ in range(n)]


def test_boundaries_with_a_first_chunk_then_the_ramps() -> None:
    assert first(4, chunk_boundaries((5, 10), 25)) == [5, 15, 40, 65]
    assert first(4, chunk_boundaries((5, 10), 25, 2)) == [2, 5, 15, 40]
    assert first(4, chunk_boundaries((5, 10), 25, 1)) == [1, 5, 15, 40]
    assert first(3, chunk_boundaries((5, 10), 25, 5)) == [5, 15, 40]
    assert first(3, chunk_boundaries((5, 10), 25, 7)) == [7, 15, 40]
    assert first(3, chunk_boundaries((5, 10), 25, 25)) == [25, 40, 65]
    assert first(3, chunk_boundaries((), 25, 3)) == [3, 25, 50]


def test_first_chunk_for_load_steps_at_the_table_entries() -> None:
    stage = StageConfig(0, "code2wav", "generation", first_chunk_by_load=((12, 2), (40, 1)))
    got = {n: stage.first_chunk_for_load(n) for n in (0, 1, 11, 12, 39, 40, 64, 1000)}
    assert got == {0: 5, 1: 5, 11: 5, 12: 2, 39: 2, 40: 1, 64: 1, 1000: 1}
    assert StageConfig(0, "code2wav", "generation").first_chunk_for_load(64) == 5  # no table: the ramp
    assert StageConfig(0, "c", "generation", initial_chunk_ramp=()).first_chunk_for_load(1) == 25


@pytest.mark.parametrize("name", ["tts", "omni"])
def test_shipped_profiles_shrink_the_first_chunk_under_load(name: str) -> None:
    gen = load_profile(name).stages[-1]
    assert gen.first_chunk_by_load == ((12, 2), (40, 1))
    assert [gen.first_chunk_for_load(n) for n in (1, 8, 16, 64)] == [5, 5, 2, 1]


def _profile_with(tmp_path: Path, table, stage: int = -1) -> Path:
    raw = yaml.safe_load((PROFILE_DIR / "tts.yaml").read_text())
    raw["stages"][stage]["first_chunk_by_load"] = table
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize(
    ("table", "stage", "says"),
    [
        ([[4, 2]], 0, "only the generation stage"),
        ([[4, 2], [4, 1]], -1, "strictly ascending"),
        ([[8, 2], [4, 1]], -1, "strictly ascending"),
        ([[4, 26]], -1, "at most codec_chunk_frames (25)"),
        ([[4, 0]], -1, "pairs of integers >= 1"),
        ([[4]], -1, "pairs of integers >= 1"),
        ([[4, True]], -1, "pairs of integers >= 1"),
        ("4:2", -1, "pairs of integers >= 1"),
    ],
)
def test_bad_tables_are_refused_naming_the_key(tmp_path: Path, table, stage: int, says: str) -> None:
    path = _profile_with(tmp_path, table, stage)
    index = stage % 2
    with pytest.raises(InvalidArgumentError) as err:
        load_profile(str(path))
    assert err.value.field == f"stages[{index}].first_chunk_by_load"
    assert says in str(err.value)


# -- code2wav with a first chunk (thread and worker process) -------------------------


class Chunks:
    def __init__(self) -> None:
        self.by_request: dict[str, list[np.ndarray]] = {}
        self.ended: dict[str, str] = {}
        self.done = threading.Condition()

    def emit(self, rid: str, audio: np.ndarray, last: bool, reason: str) -> None:
        with self.done:
            if audio.size:
                self.by_request.setdefault(rid, []).append(np.array(audio, copy=True))
            if last:
                self.ended[rid] = reason
                self.done.notify_all()

    def wait(self, rids: set[str]) -> None:
        with self.done:
            assert self.done.wait_for(lambda: rids <= set(self.ended), 60), f"ended: {sorted(self.ended)}"


def _run(stage, chunks: Chunks, codes: np.ndarray, firsts: dict[str, int]) -> None:
    stage.start()
    try:
        for rid, f in firsts.items():
            for i in range(0, len(codes), 3):  # frames arrive 3 at a time
                stage.frames(rid, "default", codes[i : i + 3], f)
            stage.finish(rid, "default", "stop")
        chunks.wait(set(firsts))
    finally:
        stage.stop()


@pytest.mark.parametrize("where", ["thread", "process"])
def test_code2wav_cuts_the_first_chunk_asked_and_the_audio_is_the_same(where: str, tmp_path: Path) -> None:
    cfg = load_profile("tts").stages[-1]
    vocoder = FakeVocoderFactory()
    rng = np.random.default_rng(5)
    codes = rng.integers(0, vocoder.codebook_size, size=(47, vocoder.num_codebooks), dtype=np.int64)
    firsts = {"ramp": 0, "two": 2, "one": 1, "seven": 7}
    chunks = Chunks()
    if where == "thread":
        stage = Code2WavWorker(cfg, chunks.emit, vocoder=vocoder)
    else:
        stage = Code2WavProcessPool(cfg, chunks.emit, vocoder=vocoder, shm_prefix=f"fc{tmp_path.name[-8:]}")
    _run(stage, chunks, codes, firsts)
    frames = {rid: [a.size // SAMPLES_PER_FRAME for a in got] for rid, got in chunks.by_request.items()}
    assert frames == {
        "ramp": [5, 10, 25, 7],
        "two": [2, 3, 10, 25, 7],
        "one": [1, 4, 10, 25, 7],
        "seven": [7, 8, 25, 7],
    }
    whole = {rid: np.concatenate(got).tobytes() for rid, got in chunks.by_request.items()}
    assert len(set(whole.values())) == 1, "the fake vocoder's audio does not depend on the chunks"


# -- the real stack -----------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from omni_stack.config import StackConfig
    from omni_stack.stack import Stack

    tmp = tmp_path_factory.mktemp("fc")
    profile = _profile_with(tmp, [[1, 3], [3, 1]])
    s = Stack(StackConfig(engine="fake", profile=str(profile), runtime_dir=str(tmp / "rt"), port=0, http_port=0,
                          log_level="WARNING", extra_decoder_args=["--repetition-window-s", "0"]))
    s.start()
    yield s
    assert s.stop() == []


def speak(stub, text: str, seed: int = 7, first_chunk_frames: int = 0, max_audio_seconds: float = 0.0):
    return stub.Speak(gateway_pb2.SpeakRequest(
        text=text, sampling_params=common_pb2.SamplingParams(
            seed=seed, first_chunk_frames=first_chunk_frames, max_audio_seconds=max_audio_seconds)), timeout=60)


def test_a_request_under_load_gets_a_smaller_first_chunk_and_its_own_choice_wins(stack) -> None:
    with grpc.insecure_channel(stack.gateway_target) as ch:
        stub = gateway_pb2_grpc.OmniGatewayServiceStub(ch)
        alone = list(speak(stub, "a lone request"))
        assert alone[0].metrics.first_chunk_frames == 3  # one request in flight: the first step's 3 frames
        assert len(alone[0].audio) == 3 * SAMPLES_PER_FRAME * 2
        assert all(c.metrics.first_chunk_frames == 3 for c in alone)

        # Two requests that do not end by themselves hold the load at 2 ...
        # (slowed: at full speed the fake spoke their 1,500 frames in about 0.6 s)
        holders = [
            speak(stub, f"hold {k} {FAKE_LOOP_MARKER}{FAKE_SLOW_MARKER}", max_audio_seconds=120)
            for k in range(2)
        ]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            firsts = list(pool.map(next, holders))
        assert [c.metrics.first_chunk_frames for c in firsts] == [3, 3]
        try:
            # ... so a third one starts with three in flight: the table's next step, 1 frame.
            loaded = list(speak(stub, "a lone request"))
            pinned = list(speak(stub, "a lone request", first_chunk_frames=4))
            for h in holders:
                assert not next(h).final, "a holder ended before the loaded requests were done"
        finally:
            for h in holders:
                h.cancel()
    assert loaded[0].metrics.first_chunk_frames == 1 and len(loaded[0].audio) == SAMPLES_PER_FRAME * 2
    assert pinned[0].metrics.first_chunk_frames == 4 and len(pinned[0].audio) == 4 * SAMPLES_PER_FRAME * 2
    pcm = [b"".join(c.audio for c in chunks) for chunks in (alone, loaded, pinned)]
    assert len(pcm[0]) > 4 * SAMPLES_PER_FRAME * 2
    assert pcm[0] == pcm[1] == pcm[2], "the fake vocoder's audio does not depend on the first chunk"
    with urllib.request.urlopen(stack.service("decoder").metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    counts = {m.group(1): float(m.group(2))
              for m in re.finditer(r'^omni_decoder_first_chunks_total\{frames="(\d+)"\} (\S+)$', text, re.M)}
    assert counts.get("3", 0) >= 3 and counts.get("1", 0) >= 1 and counts.get("4", 0) >= 1, counts


def test_out_of_range_first_chunks_are_refused_naming_the_field(stack) -> None:
    with grpc.insecure_channel(stack.decoder_target) as ch:
        dec = decoder_pb2_grpc.DecoderServiceStub(ch)
        info = dec.GetDecoderInfo(decoder_pb2.GetDecoderInfoRequest())
        assert info.limits.max_first_chunk_frames == 25
        with pytest.raises(grpc.RpcError) as err:
            list(dec.Generate(decoder_pb2.GenerateRequest(
                request_id="too-big", prompt="hello",
                sampling_params=common_pb2.SamplingParams(first_chunk_frames=26)), timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling_params.first_chunk_frames" in err.value.details()
    with grpc.insecure_channel(stack.gateway_target) as ch:
        with pytest.raises(grpc.RpcError) as err:
            list(speak(gateway_pb2_grpc.OmniGatewayServiceStub(ch), "hello", first_chunk_frames=26))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling_params.first_chunk_frames" in err.value.details()
        assert "maximum of 25" in err.value.details()

    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", stack.cfg.http_port, timeout=30)
    try:
        for value, status in ((26, 400), (-1, 400), (0, 200), (2, 200)):
            body = {"model": "fake", "input": "hello", "voice": "default", "response_format": "pcm",
                    "first_chunk_frames": value}
            conn.request("POST", "/v1/audio/speech", body=json.dumps(body),
                         headers={"Content-Type": "application/json"})
            reply = conn.getresponse()
            content = reply.read()
            assert reply.status == status, (value, reply.status, content[:300])
            if status == 400:
                error = json.loads(content)["error"]
                assert error["param"] == "first_chunk_frames" and "first_chunk_frames" in error["message"], error
            else:
                assert len(content) > 2 * SAMPLES_PER_FRAME * 2
    finally:
        conn.close()
