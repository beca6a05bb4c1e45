"""Code2Wav streams decoded together (``push_many``): each stream's audio is its
own, whichever streams shared its forward.

Streams start at different times and advance by different chunk sizes (a
ramp, random sizes, single frames), so one forward mixes first pushes with
streams whose attention window is full and rows of different lengths. Each
stream's audio is compared with its whole-sequence decode (the 1e-4 contract
of every chunking, tests/test_code2wav_neural.py) and with the same stream
pushed alone.
"""

from __future__ import annotations

import random

import pytest
import torch

from decoder_svc.qwen3_omni.code2wav import Code2Wav, random_tensors
from decoder_svc.qwen3_omni.code2wav_batch import InvalidRow, push_many
from tests.test_code2wav_neural import REFERENCE_CONFIG

STREAMS = 6
FRAMES = 160  # > sliding window (72) + a ramp: full caches next to empty ones


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(overrides: dict | None = None) -> Code2Wav:
    config = {**REFERENCE_CONFIG, **(overrides or {})}
    return Code2Wav.from_config_and_tensors(config, random_tensors(config, seed=7))


@pytest.fixture(scope="module")
def model() -> Code2Wav:
    return _model()


def _codes(n: int, seed: int, frames: int = FRAMES) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 2048, (frames, 16), generator=gen) for _ in range(n)]


def _schedule(kind: int, rng: random.Random) -> list[int]:
    if kind == 0:
        return [5, 10] + [25] * FRAMES
    if kind == 1:
        return [rng.randint(1, 30) for _ in range(FRAMES)]
    return [1] * 6 + [rng.randint(3, 12) for _ in range(FRAMES)]


def _run_batched(model: Code2Wav, codes: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """Every stream's audio, decoded in turns: each turn one forward over a
    random subset of the streams that have frames left (a stream joins at its
    own turn: staggered starts)."""
    rng = random.Random(seed)
    plans = [_schedule(i % 3, rng) for i in range(len(codes))]
    starts = [rng.randint(0, 8) for _ in codes]  # turns before a stream's first push
    streams = [model.new_stream() for _ in codes]
    done = [0] * len(codes)
    pieces: list[list[torch.Tensor]] = [[] for _ in codes]
    turn = 0
    while any(d < c.shape[0] for d, c in zip(done, codes, strict=True)):
        rows = [
            i for i, c in enumerate(codes)
            if done[i] < c.shape[0] and turn >= starts[i] and rng.random() < 0.8
        ]
        turn += 1
        if not rows:
            continue
        blocks = []
        for i in rows:
            n = plans[i].pop(0)
            blocks.append(codes[i][done[i] : done[i] + n])
            done[i] = min(done[i] + n, codes[i].shape[0])
        for i, piece in zip(rows, push_many([streams[i] for i in rows], blocks), strict=True):
            pieces[i].append(piece)
    return [torch.cat(p) for p in pieces]


def test_each_stream_of_a_batch_matches_its_whole_decode_and_its_solo_stream(model):
    codes = _codes(STREAMS, seed=3)
    batched = _run_batched(model, codes, seed=11)
    for i, c in enumerate(codes):
        whole = model.decode(c)
        assert batched[i].shape == whole.shape, (i, batched[i].shape, whole.shape)
        err = (batched[i] - whole).abs().max().item()
        assert err <= 1e-4, f"stream {i}: {err} from its whole decode"
        solo = model.new_stream()
        alone = torch.cat([solo.push(c[s : s + 7]) for s in range(0, c.shape[0], 7)])
        assert (batched[i] - alone).abs().max().item() <= 1e-4, f"stream {i}: differs from alone"


def test_batch_composition_does_not_change_a_stream(model):
    """The same streams in two different random groupings give the same audio
    (within float rounding: the batch shape changes the kernels' blocking)."""
    codes = _codes(4, seed=5, frames=90)
    a = _run_batched(model, codes, seed=1)
    b = _run_batched(model, codes, seed=2)
    for i in range(4):
        assert (a[i] - b[i]).abs().max().item() <= 1e-4, i


def test_layout_with_kernel_equal_stride_and_another_tail():
    """Another upsampling layout (a transposed conv without history, another
    tail): still the whole decode."""
    model = _model({"upsampling_ratios": (3,), "upsample_rates": (5, 2), "decoder_dim": 32})
    codes = _codes(3, seed=9, frames=60)
    batched = _run_batched(model, codes, seed=4)
    for i, c in enumerate(codes):
        assert (batched[i] - model.decode(c)).abs().max().item() <= 1e-4, i


def test_a_bad_row_is_named_and_no_stream_changes(model):
    codes = _codes(3, seed=13, frames=20)
    streams = [model.new_stream() for _ in codes]
    push_many(streams, [c[:5] for c in codes])
    before = [(s.frames, s.samples, s._transformer.position) for s in streams]
    bad = codes[1][5:10].clone()
    bad[0, 3] = 5000
    with pytest.raises(InvalidRow) as err:
        push_many(streams, [codes[0][5:10], bad, codes[2][5:10]])
    assert err.value.index == 1 and "[0, 2048)" in str(err.value), str(err.value)
    assert [(s.frames, s.samples, s._transformer.position) for s in streams] == before
    # the streams go on as if the failed call never happened
    rest = push_many(streams, [c[5:] for c in codes])
    for i, c in enumerate(codes):
        ref = model.new_stream()
        expected = torch.cat([ref.push(c[:5]), ref.push(c[5:])])[-rest[i].shape[0] :]
        assert (rest[i] - expected).abs().max().item() <= 1e-4, i


def test_mixed_models_and_counts_are_refused(model):
    other = _model({"decoder_dim": 32})
    with pytest.raises(ValueError, match="one model"):
        push_many([model.new_stream(), other.new_stream()], _codes(2, seed=1, frames=3))
    with pytest.raises(ValueError, match="2 streams but 1"):
        push_many([model.new_stream(), model.new_stream()], _codes(1, seed=1, frames=3))
