"""The serving code predictor (``decoder_svc/qwen3_omni/code_predictor.py``)
and its sampler, on CPU float32 with random weights.

- greedy codes equal the previous implementation's (kept in
  ``bench/baselines/code_predictor_v0.py``), bitwise: codes equal, and the
  embedding sums equal bit for bit (the same embeddings added in the same
  order);
- sampled rows follow a row-by-row reference built from transformers' own
  top-k / top-p warpers, filtered ids are never drawn, draw frequencies match
  the probabilities;
- the counter-based noise equals a pure-Python model of the hash (the int64
  arithmetic is exact here), is fixed by (seed, frame, codebook) and changes
  with each of them;
- batch invariance: a seeded request alone and in batches of 7 and 64 (other
  seeds, greedy rows, other top-k) gives the same codes and embedding sums,
  bit for bit, also through the talker's ``sampled_frame_codes``; padding
  rows never change the real rows;
- the device bookkeeping: sampled rows on the fake device (no host sync, no
  op mixing devices) and the CUDA graph runner's static buffers with a fake
  graph (replay equals eager, one capture per bucket and candidate count).
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

from bench.baselines.code_predictor_v0 import CodePredictor as PreviousCodePredictor
from decoder_svc.qwen3_omni.code_predictor import CodePredictor, _GraphRunner, row_tile
from decoder_svc.qwen3_omni.code_sampling import SamplingBatch, group_keys, sample, uniforms
from decoder_svc.qwen3_omni.talker import sampled_frame_codes
from decoder_svc.qwen3_omni.talker_slots import TalkerRequestState, TalkerSlots
from tests.fake_device import FakeDeviceMode, module_to_device, to_device, to_host

V = 2048
TINY = {  # the tiny checkpoint's code predictor (decoder_svc/qwen3_omni/tiny.py)
    "vocab_size": V, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "num_code_groups": 16,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}, "rms_norm_eps": 1e-6,
}
GQA4 = {**TINY, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 1}
MHA = {**TINY, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 32, "num_code_groups": 5}


def released_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Random weights by released name (no prefix), via the previous implementation's parameters."""
    torch.manual_seed(seed)
    prev = PreviousCodePredictor(config)
    with torch.no_grad():
        for name, p in prev.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape))
            else:
                p.normal_(0.0, 0.5 if "embedding" in name else p.shape[-1] ** -0.5 * 1.5)
    return {n: p.detach().clone() for n, p in prev.named_parameters()}


def predictor(config: dict = TINY, seed: int = 0, **kw) -> CodePredictor:
    cp = CodePredictor(config, **kw)
    cp.load(released_weights(config, seed), prefix="")
    return cp


def batch(temperature, top_k, top_p, seed, frame) -> SamplingBatch:
    return SamplingBatch.build(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, frame=frame,
                               vocab_size=V)


# -- shapes, names, greedy ---------------------------------------------------------------------


def test_shapes_and_released_names():
    cp = predictor()
    n, hid = 5, TINY["hidden_size"]
    codes, embed_sum = cp.predict(torch.randn(n, hid), torch.randn(n, hid), SamplingBatch.greedy(n))
    assert codes.shape == (n, 15) and codes.dtype == torch.int64, f"{codes.shape=} {codes.dtype=}"
    assert embed_sum.shape == (n, hid) and embed_sum.dtype == torch.float32
    assert int(codes.min()) >= 0 and int(codes.max()) < V
    want = sum(cp.codec_embedding[g][codes[:, g]] for g in range(15))
    assert torch.allclose(embed_sum, want, atol=1e-5), "the sum is of the chosen codes' embeddings"
    empty = cp.predict(torch.randn(0, hid), torch.randn(0, hid), SamplingBatch.greedy(0))
    assert empty[0].shape == (0, 15) and empty[1].shape == (0, hid)

    weights = released_weights(TINY, 0)
    assert set(weights) == set(cp.released_shapes()), "the released names are exactly the checkpoint's"
    missing = {k: v for k, v in weights.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(KeyError, match="model.layers.1.self_attn.k_proj.weight"):
        CodePredictor(TINY).load(missing, prefix="")
    wrong = {**weights, "lm_head.3.weight": torch.zeros(V, 64)}
    with pytest.raises(ValueError, match=r"lm_head\.3\.weight: shape \(2048, 64\)"):
        CodePredictor(TINY).load(wrong, prefix="")
    with pytest.raises(ValueError, match="sampling: 2 rows for 3"):
        cp.predict(torch.randn(3, hid), torch.randn(3, hid), SamplingBatch.greedy(2))


@pytest.mark.parametrize("config", [TINY, GQA4, MHA], ids=["tiny", "gqa-8-2", "mha"])
@pytest.mark.parametrize("n", [1, 5, 20])
def test_greedy_equals_the_previous_implementation(config, n):
    """Bitwise: equal codes, equal embedding sums (float32, random weights)."""
    weights = released_weights(config, seed=n)
    prev = PreviousCodePredictor(config)
    prev.load(weights, prefix="")
    cp = CodePredictor(config)
    cp.load(weights, prefix="")
    torch.manual_seed(100 + n)
    hidden, emb0 = torch.randn(n, config["hidden_size"]), torch.randn(n, config["hidden_size"])
    want_codes, want_sum = prev.predict(hidden, emb0, temperature=[0.0] * n, top_k=[0] * n, top_p=[1.0] * n,
                                        generators=[None] * n)
    codes, embed_sum = cp.predict(hidden, emb0, SamplingBatch.greedy(n))
    assert torch.equal(codes, want_codes), f"rows differ: {(codes != want_codes).any(1).nonzero().flatten().tolist()}"
    assert torch.equal(embed_sum, want_sum), f"max diff {(embed_sum - want_sum).abs().max().item()}"


# -- the sampler ---------------------------------------------------------------------------------


def reference_row(logits: torch.Tensor, temp: float, k: int, p: float, u: float) -> int:
    """One row the way transformers filters it (its own warpers), then the
    documented draw: the inverse CDF of u over the kept ids in (logit desc,
    id asc) order."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    if temp <= 0:
        return int(logits.argmax())
    x = (logits / temp)[None, :]
    if k > 0:
        x = TopKLogitsWarper(top_k=k)(None, x)
    if p < 1.0:
        x = TopPLogitsWarper(top_p=p)(None, x)
    probs = x[0].softmax(-1)
    order = torch.sort(logits, descending=True, stable=True).indices  # ties: the smaller id first
    probs = probs[order]
    cum = probs.cumsum(-1)
    j = int((cum <= u * float(cum[-1])).sum())
    j = min(j, int((probs > 0).sum()) - 1)
    return int(order[j])


SETTINGS = [(t, k, p) for t in (0.0, 0.7, 1.0, 1.3) for k in (0, 1, 5, 50) for p in (1.0, 0.8, 0.3)]


def test_sampled_rows_follow_transformers_filters_row_by_row():
    torch.manual_seed(3)
    n = len(SETTINGS)
    logits = torch.randn(n, V) * 3
    u = torch.rand(n)
    temp = torch.tensor([s[0] for s in SETTINGS])
    top_k = torch.tensor([s[1] for s in SETTINGS])
    top_p = torch.tensor([s[2] for s in SETTINGS])
    got = sample(logits, temp, top_k, top_p, u, candidates=V)
    want = [reference_row(logits[i], *SETTINGS[i], float(u[i])) for i in range(n)]
    assert got.tolist() == want, [(SETTINGS[i], g, w) for i, (g, w) in enumerate(zip(got.tolist(), want, strict=True)) if g != w]
    # the candidate count never changes a row whose top-k it covers
    rows = [i for i, (t, k, _) in enumerate(SETTINGS) if 0 < k <= 64]
    part = sample(logits[rows], temp[rows], top_k[rows], top_p[rows], u[rows], candidates=64)
    assert part.tolist() == [want[i] for i in rows]


def allowed(logits: torch.Tensor, temp: float, k: int, p: float) -> set[int]:
    """The ids transformers' warpers leave with a non-zero probability."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    x = (logits / temp)[None, :]
    if k > 0:
        x = TopKLogitsWarper(top_k=k)(None, x)
    if p < 1.0:
        x = TopPLogitsWarper(top_p=p)(None, x)
    return set(torch.nonzero(x[0].softmax(-1) > 0).flatten().tolist())


def test_filtered_ids_are_never_drawn():
    torch.manual_seed(4)
    cases = [(1.0, 5, 1.0), (1.0, 0, 0.5), (0.8, 50, 0.8), (1.0, 3, 0.9), (2.0, 0, 0.05)]
    draws = 400
    for temp, k, p in cases:
        logits = torch.randn(V) * 2
        ok = allowed(logits, temp, k, p)
        u = (torch.arange(draws, dtype=torch.float32) + 0.5) / draws  # the whole [0, 1) range
        u = torch.cat([u, torch.tensor([0.0, 1.0 - 2**-24])])
        n = u.shape[0]
        got = sample(logits.expand(n, V), torch.full((n,), temp), torch.full((n,), k), torch.full((n,), p), u,
                     candidates=V if k == 0 else 64)
        drawn = set(got.tolist())
        assert drawn <= ok, f"{temp=} {k=} {p=}: drew filtered ids {sorted(drawn - ok)[:5]}"
        assert len(drawn) > 1 or len(ok) == 1, f"{temp=} {k=} {p=}: one id for {len(ok)} allowed"


def test_draw_frequencies_match_the_probabilities():
    """20,000 draws from 20,000 (seed, frame) streams: each id's frequency
    within 5 standard deviations of its probability."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0] + [-30.0] * (V - 8))
    n = 20_000
    seeds = torch.stack([torch.arange(n) * 7919 % 2**32, torch.arange(n) // 3], dim=1)
    u = uniforms(seeds, torch.arange(n) % 5, group_keys(1))[:, 0]
    got = sample(logits.expand(n, V), torch.ones(n), torch.full((n,), 6), torch.ones(n), u, candidates=64)
    probs = logits[:6].softmax(-1)
    counts = torch.bincount(got, minlength=V).float()
    assert counts[6:].sum() == 0, "ids past top-k 6 drawn"
    freq = counts[:6] / n
    sd = (probs * (1 - probs) / n).sqrt()
    assert ((freq - probs).abs() < 5 * sd).all(), f"{freq.tolist()=} {probs.tolist()=}"


def _py_mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _py_uniform(seed: int, frame: int, group: int) -> float:
    """The noise in plain Python integers (the specification of uniforms)."""
    g = _py_mix32((group + 1) * 0x9E3779B9 & 0xFFFFFFFF)
    k = _py_mix32((seed & 0xFFFFFFFF) ^ 0x5BD1E995)
    k = _py_mix32(k ^ (seed >> 32 & 0xFFFFFFFF))
    k = _py_mix32(k ^ (frame & 0xFFFFFFFF))
    k = _py_mix32(k ^ (frame >> 32 & 0xFFFFFFFF))
    return (_py_mix32(k ^ g) >> 8) * 2.0**-24


def test_noise_is_fixed_by_seed_frame_and_codebook():
    seeds = [0, 1, 7, 2**32 - 1, 2**32, 2**63 + 5, 2**64 - 1]
    frames = [0, 1, 2, 1000]
    rows = [(s, f) for s in seeds for f in frames]
    b = batch([1.0] * len(rows), [50] * len(rows), [0.8] * len(rows), [s for s, _ in rows], [f for _, f in rows])
    u = uniforms(b.seed, b.frame, group_keys(15))
    want = torch.tensor([[_py_uniform(s, f, g) for g in range(15)] for s, f in rows])
    assert torch.equal(u, want), "the tensor hash differs from its integer specification"
    assert torch.equal(uniforms(b.seed, b.frame, group_keys(15)), u), "a fixed key gives a fixed draw"
    flat = u.flatten()
    assert flat.unique().numel() == flat.numel(), "every (seed, frame, codebook) draws differently"
    # the high word of a 64-bit seed matters
    assert not torch.equal(u[rows.index((2**32 - 1, 0))], u[rows.index((2**64 - 1, 0))])
    # uniform on [0, 1): 200k draws
    n = 200_000
    big = uniforms(torch.stack([torch.arange(n), torch.zeros(n, dtype=torch.int64)], 1), torch.zeros(n, dtype=torch.int64),
                   group_keys(1))[:, 0]
    assert 0.0 <= float(big.min()) and float(big.max()) < 1.0
    assert abs(float(big.mean()) - 0.5) < 0.005 and abs(float(big.var()) - 1 / 12) < 0.002
    hist = torch.histc(big, bins=20, min=0.0, max=1.0)
    assert ((hist - n / 20).abs() < 5 * (n / 20) ** 0.5).all(), f"{hist.tolist()=}"


# -- batch invariance -------------------------------------------------------------------------


def _others(n: int, rng: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, list, list, list, list, list]:
    hid = TINY["hidden_size"]
    temps = [0.0 if i % 4 == 0 else 0.9 for i in range(n)]  # a quarter greedy
    top_k = [0 if i % 5 == 1 else (50 if i % 2 else 20) for i in range(n)]  # some rows unfiltered: candidates V
    top_p = [1.0 if i % 3 == 0 else 0.8 for i in range(n)]
    seeds = [1000 + 31 * i for i in range(n)]
    frames = [i % 7 for i in range(n)]
    return torch.randn(n, hid, generator=rng), torch.randn(n, hid, generator=rng), temps, top_k, top_p, seeds, frames


@pytest.fixture
def logits_seen(monkeypatch) -> list[torch.Tensor]:
    """Every logits tensor the predictor hands its sampler (equal codes could
    hide unequal logits: the test compares the logits' bits too)."""
    from decoder_svc.qwen3_omni import code_predictor

    seen: list[torch.Tensor] = []
    real = code_predictor.draw

    def recording(logits, *args, **kwargs):
        seen.append(logits.clone())
        return real(logits, *args, **kwargs)

    monkeypatch.setattr(code_predictor, "draw", recording)
    return seen


@pytest.mark.parametrize("config", [TINY, GQA4], ids=["tiny", "gqa-8-2"])
def test_a_seeded_request_gives_the_same_codes_alone_and_in_batches_of_7_and_64(config, logits_seen):
    """With batch_invariant (the mode that guarantees it)."""
    cp = predictor(config, seed=11, batch_invariant=True)
    hid = config["hidden_size"]
    rng = torch.Generator().manual_seed(12)
    hidden, emb0 = torch.randn(1, hid, generator=rng), torch.randn(1, hid, generator=rng)
    for frame in (0, 3):
        logits_seen.clear()
        alone = cp.predict(hidden, emb0, batch([1.0], [50], [0.8], [2**40 + 9], [frame]))
        alone_logits = torch.stack([x[0] for x in logits_seen])
        for n, at in ((7, 4), (64, 37), (64, 0), (64, 63)):
            h, e, temps, top_k, top_p, seeds, frames = _others(n, rng)
            h[at], e[at] = hidden[0, :hid], emb0[0, :hid]
            temps[at], top_k[at], top_p[at], seeds[at], frames[at] = 1.0, 50, 0.8, 2**40 + 9, frame
            s = batch(temps, top_k, top_p, seeds, frames)
            assert s.candidates == V, "the batch has unfiltered rows (all V candidates; alone: 64)"
            logits_seen.clear()
            codes, embed_sum = cp.predict(h, e, s)
            row_logits = torch.stack([x[at] for x in logits_seen])
            assert torch.equal(row_logits, alone_logits), \
                f"batch {n} row {at}: logits differ by up to {(row_logits - alone_logits).abs().max().item():.3g}"
            assert torch.equal(codes[at], alone[0][0]), f"batch {n} row {at} frame {frame}: {codes[at].tolist()} " \
                                                         f"alone {alone[0][0].tolist()}"
            assert torch.equal(embed_sum[at], alone[1][0]), f"batch {n} row {at}: embedding sums differ"
    # the noise does matter: another frame index or seed draws other codes
    other_frame = cp.predict(hidden, emb0, batch([1.0], [50], [0.8], [2**40 + 9], [1]))[0]
    other_seed = cp.predict(hidden, emb0, batch([1.0], [50], [0.8], [2**40 + 8], [0]))[0]
    first = cp.predict(hidden, emb0, batch([1.0], [50], [0.8], [2**40 + 9], [0]))[0]
    assert not torch.equal(first, other_frame) and not torch.equal(first, other_seed)


def test_padding_rows_never_change_real_rows():
    """The frame function on a bucket whose padding rows hold anything
    (sampled settings, large values) gives the real rows the bits they get
    with zero greedy padding."""
    cp = predictor(seed=5)
    rng = torch.Generator().manual_seed(6)
    h, e, temps, top_k, top_p, seeds, frames = _others(5, rng)
    s = batch(temps, top_k, top_p, seeds, frames)
    want = cp.predict(h, e, s)
    b = cp.bucket(5)
    assert b % cp.row_tile() == 0 and b >= 5
    noisy = batch(temps + [1.0] * (b - 5), top_k + [7] * (b - 5), top_p + [0.5] * (b - 5),
                  seeds + list(range(b - 5)), frames + [9] * (b - 5))
    x = torch.stack((torch.cat([h, 100 * torch.randn(b - 5, h.shape[1], generator=rng)]),
                     torch.cat([e, torch.randn(b - 5, h.shape[1], generator=rng)])), dim=1)
    with torch.inference_mode():
        codes, embed_sum = cp._frame(x, noisy.temperature, noisy.top_k, noisy.top_p, noisy.seed, noisy.frame,
                                     s.candidates)
    assert torch.equal(codes[:5], want[0]) and torch.equal(embed_sum[:5], want[1])


def test_a_bfloat16_predictor_against_float32():
    """The predictor in bfloat16 (the talker's dtype on CUDA, and on CPUs
    with bfloat16): the same frame function, its rows still independent of
    the batch (a request's codes alone in a batch of 3 and inside a batch of
    64), and its greedy codes mostly those of float32 (docs/models.md,
    "bfloat16 against float32", quotes what this prints)."""
    cp32, cp16 = predictor(), predictor().to(torch.bfloat16)
    rng = torch.Generator().manual_seed(11)
    h, e = torch.randn(64, TINY["hidden_size"], generator=rng), torch.randn(64, TINY["hidden_size"], generator=rng)
    want, _ = cp32.predict(h, e, SamplingBatch.greedy(64))
    got, embed_sum = cp16.predict(h, e, SamplingBatch.greedy(64))
    assert embed_sum.dtype == torch.bfloat16 and got.shape == want.shape
    first, every = (got[:, 0] == want[:, 0]).float().mean().item(), (got == want).float().mean().item()
    print(f"bfloat16 predictor at batch 64: codebook 1 equal to float32 in {first:.0%} of rows, "
          f"{every:.0%} of all residual codes")
    assert first >= 0.8 and every >= 0.5, (first, every)  # rounding flips near-ties; the chain carries them on
    temps, seeds = [0.9, 0.0, 1.1] * 22, list(range(66))
    s = batch(temps[:64], [50] * 64, [0.9] * 64, seeds[:64], [3] * 64)
    together, _ = cp16.predict(h, e, s)
    alone, _ = cp16.predict(h[:3], e[:3], batch(temps[:3], [50] * 3, [0.9] * 3, seeds[:3], [3] * 3))
    assert torch.equal(alone, together[:3])


def test_batches_above_the_largest_bucket_run_in_chunks():
    cp = predictor(max_bucket=8, batch_invariant=True)  # rows compared with the same rows alone
    rng = torch.Generator().manual_seed(8)
    h, e, temps, top_k, top_p, seeds, frames = _others(20, rng)
    codes, embed_sum = cp.predict(h, e, batch(temps, top_k, top_p, seeds, frames))
    assert codes.shape == (20, 15)
    for i in (0, 9, 19):
        one = cp.predict(h[i : i + 1], e[i : i + 1], batch(temps[i : i + 1], top_k[i : i + 1], top_p[i : i + 1],
                                                          seeds[i : i + 1], frames[i : i + 1]))
        assert torch.equal(codes[i], one[0][0]) and torch.equal(embed_sum[i], one[1][0]), f"row {i}"


def test_a_lone_request_runs_unpadded_on_cpu_unless_batch_invariant(monkeypatch):
    """Default (no batch_invariant): a batch of one is a GEMV, batches of two
    or more are padded to the row tile, and a seeded request's codes are the
    same in batches of 2, 7 and 64; its greedy codes alone equal the padded
    (invariant) predictor's. batch_invariant (argument or environment) pads
    a batch of one too."""
    from decoder_svc.qwen3_omni.code_predictor import BATCH_INVARIANT_ENV

    monkeypatch.delenv(BATCH_INVARIANT_ENV, raising=False)
    fast, invariant = predictor(seed=3), predictor(seed=3, batch_invariant=True)
    assert not fast.batch_invariant and invariant.batch_invariant
    tile = fast.row_tile()
    assert fast.bucket(1) == 1, f"a lone request padded to {fast.bucket(1)} rows"
    assert invariant.bucket(1) == tile, f"batch_invariant: a lone request padded to {invariant.bucket(1)}, tile {tile}"
    assert fast.bucket(2) == invariant.bucket(2) and fast.bucket(2) % tile == 0
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "1")
    assert CodePredictor(TINY).batch_invariant, f"{BATCH_INVARIANT_ENV}=1 should turn it on"
    assert not CodePredictor(TINY, batch_invariant=False).batch_invariant, "the argument wins over the environment"

    rng = torch.Generator().manual_seed(4)
    h, e, temps, top_k, top_p, seeds, frames = _others(64, rng)
    greedy = batch([0.0], [0], [1.0], [5], [0])
    alone, padded = fast.predict(h[:1], e[:1], greedy)[0], invariant.predict(h[:1], e[:1], greedy)[0]
    assert torch.equal(alone, padded), f"greedy codes alone: unpadded {alone.tolist()}, padded {padded.tolist()}"
    temps[0], top_k[0], top_p[0] = 1.0, 50, 0.8
    want = None
    for n in (2, 7, 64):
        codes = fast.predict(h[:n], e[:n], batch(temps[:n], top_k[:n], top_p[:n], seeds[:n], frames[:n]))[0][0]
        want = codes if want is None else want
        assert torch.equal(codes, want), f"batch {n}: row 0 {codes.tolist()}, batch 2: {want.tolist()}"


def test_row_tile_makes_matrix_products_row_invariant_here():
    """What the buckets rely on, on this host: rows of a multiple-of-tile
    product equal the same rows in any other multiple-of-tile product."""
    tile = row_tile([(128, 256), (128, 2048)], 128)
    assert tile in (4, 8, 16, 32, 64)
    gen = torch.Generator().manual_seed(9)
    w, x = torch.randn(2048, 128, generator=gen), torch.randn(128, 128, generator=gen)
    ref = torch.nn.functional.linear(x, w)
    for m in range(tile, 129, tile):
        assert torch.equal(torch.nn.functional.linear(x[:m], w), ref[:m]), f"{m} rows (tile {tile})"


def _slots(cp: CodePredictor, emb: torch.nn.Embedding, rids: list[str], seeds: list[int]) -> TalkerSlots:
    """The talker's slot store with these requests (sampled: temperature 1, top-k 50, top-p 0.8)."""
    slots = TalkerSlots(emb.embedding_dim, V + 8)
    for rid, seed in zip(rids, seeds, strict=True):
        slots.add(rid, TalkerRequestState(prompt_len=3, trailing=torch.zeros(2, emb.embedding_dim),
                                          pad=torch.zeros(emb.embedding_dim), temperature=1.0, top_k=50,
                                          top_p=0.8, seed=seed))
    return slots


def _frame(slots: TalkerSlots, cp: CodePredictor, emb: torch.nn.Embedding, ids: list[str], hidden: torch.Tensor,
           code0: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """One step's frame postprocess, the step's rows prepared first (as the talker's runner does)."""
    slots.prepare(ids, list(range(len(ids) + 1)), [3] * len(ids))  # decode rows
    return sampled_frame_codes(slots, cp, emb, ids, hidden, code0, valid)


def test_talker_frames_depend_on_the_requests_seed_and_frame_count_alone():
    cp = predictor(seed=13)
    emb = torch.nn.Embedding(V + 8, TINY["hidden_size"])
    rng = torch.Generator().manual_seed(14)
    frames = [(torch.randn(1, 128, generator=rng), int(torch.randint(0, V, (1,), generator=rng))) for _ in range(3)]
    solo = _slots(cp, emb, ["x"], [77])
    want = [_frame(solo, cp, emb, ["x"], h, torch.tensor([c]), torch.tensor([True]))[0] for h, c in frames]
    assert solo.frames[1].item() == 3
    assert len({tuple(w.tolist()) for w in want}) == 3
    crowd_ids = [f"r{i}" for i in range(40)]
    crowd = _slots(cp, emb, crowd_ids + ["x"], list(range(40)) + [77])
    x_slot = 41
    for f, (h, c) in enumerate(frames):
        n = 10 + 15 * f  # a different batch each frame; "x" at a different row
        ids = crowd_ids[:n] + ["x"]
        ids = ids[n // 2 :] + ids[: n // 2]
        hidden = torch.randn(len(ids), 128, generator=rng)
        code0 = torch.randint(0, V, (len(ids),), generator=rng)
        at = ids.index("x")
        hidden[at], code0[at] = h[0], c
        valid = torch.ones(len(ids), dtype=torch.bool)
        valid[0] = at == 0  # an invalid row predicts nothing and keeps its frame count
        got = _frame(crowd, cp, emb, ids, hidden, code0, valid)
        assert torch.equal(got[at], want[f]), f"frame {f}: {got[at].tolist()} alone {want[f].tolist()}"
        expected = want_sum(cp, want[f])
        assert torch.equal(crowd.frame_residual(x_slot, f), expected), f"frame {f}: residual sums differ"
        if at != 0:
            assert torch.equal(got[0, 1:], torch.zeros_like(got[0, 1:])), "an invalid row's residual codes are zero"
    assert crowd.frames[x_slot].item() == 3


def want_sum(cp: CodePredictor, codes: torch.Tensor) -> torch.Tensor:
    """The residual embedding sum of one frame's codes, added in the predictor's order."""
    out = cp.codec_embedding[0][codes[1]].clone()
    for g in range(1, 15):
        out = out + cp.codec_embedding[g][codes[g + 1]]
    return out


# -- device bookkeeping ----------------------------------------------------------------------


def test_sampled_rows_on_the_fake_device_without_a_sync():
    cp = predictor(seed=15)
    rng = torch.Generator().manual_seed(16)
    h, e, temps, top_k, top_p, seeds, frames = _others(9, rng)
    settings = dict(temperature=temps, top_k=top_k, top_p=top_p, seed=seeds, frame=frames, vocab_size=V)
    want = cp.predict(h, e, SamplingBatch.build(**settings))
    dev = module_to_device(copy.deepcopy(cp))
    # the fake device's wrapper tensors cannot be viewed under inference mode
    dev.predict = types.MethodType(CodePredictor.predict.__wrapped__, dev)
    mode = FakeDeviceMode()
    with mode, torch.no_grad():
        s = SamplingBatch.build(**settings, device="meta")
        codes, embed_sum = dev.predict(to_device(h), to_device(e), s)
    assert mode.mixed == [], "ops mixed devices:\n" + "\n".join(mode.mixed)
    assert mode.syncs == [], f"device->host reads in the predictor: {mode.syncs}"
    assert codes.device.type == "meta" and torch.equal(to_host(codes), want[0])
    assert torch.equal(to_host(embed_sum), want[1])


class FakeGraph:
    """A stand-in for torch.cuda.CUDAGraph: capture runs the function once and
    keeps its outputs; replay re-runs it on the same (static) inputs and
    writes into those same output tensors, as a replayed graph would."""

    captures = 0

    def __init__(self, pool) -> None:
        self.fn = None
        self.outputs = None

    def capture(self, fn):
        FakeGraph.captures += 1
        self.fn = fn
        self.outputs = fn()
        return self.outputs

    def replay(self) -> None:
        for out, new in zip(self.outputs, self.fn(), strict=True):
            out.copy_(new)


def test_graph_runner_replays_the_frame_on_static_buffers():
    cp = predictor(seed=17)
    runner = _GraphRunner(cp._frame, make_graph=FakeGraph)
    rng = torch.Generator().manual_seed(18)
    FakeGraph.captures = 0
    results = []
    with torch.inference_mode():
        for n in (5, 7, 8, 6):  # one bucket (8) whatever the row tile up to 8
            h, e, temps, top_k, top_p, seeds, frames = _others(n, rng)
            s = batch(temps, top_k, top_p, seeds, frames)
            want = cp.predict(h, e, s)
            b = cp.bucket(n)
            args = [torch.stack((h, e), dim=1), s.temperature, s.top_k, s.top_p, s.seed, s.frame]
            args = [torch.nn.functional.pad(a, (0, 0) * (a.dim() - 1) + (0, b - n)) for a in args]
            codes, embed_sum = runner.run((b, s.candidates), args, s.candidates)
            assert torch.equal(codes[:n], want[0]) and torch.equal(embed_sum[:n], want[1]), f"replay of {n} rows"
            results.append((codes, want[0]))
        assert FakeGraph.captures == 1, f"one bucket, one candidate count: {FakeGraph.captures} captures"
        greedy = SamplingBatch.greedy(8)
        args = [torch.randn(8, 2, 128, generator=rng), greedy.temperature, greedy.top_k, greedy.top_p, greedy.seed,
                greedy.frame]
        runner.run((8, 0), args, 0)
        assert FakeGraph.captures == 2, "another candidate count is another graph"
    for codes, want in results:  # returned outputs are copies: later replays never rewrite them
        assert torch.equal(codes[: want.shape[0]], want)


# -- the torch-only GPU script ---------------------------------------------------------------


def _gpu_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check_torch.py"
    spec = importlib.util.spec_from_file_location("gpu_check_torch", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_scripts_predictor_checks_pass_on_cpu_with_a_fake_graph(monkeypatch):
    """scripts/gpu_check_torch.py's checks, run here with the fake graph in
    place of CUDA graphs (the device checks themselves need a GPU)."""
    from decoder_svc.qwen3_omni import code_predictor

    real = code_predictor._GraphRunner
    monkeypatch.setattr(code_predictor, "_GraphRunner", lambda frame: real(frame, make_graph=FakeGraph))
    monkeypatch.setattr(CodePredictor, "_graphed", lambda self, device: self.cuda_graphs)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    script = _gpu_script()
    FakeGraph.captures = 0
    note = script.check_graph_replay(script.TINY, torch.device("cpu"), batches=(1, 12))
    buckets = [{CodePredictor(script.TINY).to(dtype).bucket(n) for n in (1, 12)}
               for dtype in (torch.float32, torch.bfloat16)]
    # 3 candidate counts per bucket, in float32 and in bfloat16
    assert FakeGraph.captures == 3 * sum(map(len, buckets)), (FakeGraph.captures, buckets)
    assert "float32: " in note and "bfloat16: " in note and "graphs captured" in note, note
    script.check_seeded_sampler(script.TINY, torch.device("cpu"), batches=(7, 16))


class _HostMeterFake:
    """A fake of the GPU script's CudaMeter on CPU: the bytes of the live
    tensors' storages (each storage once) as "allocated", and a 64 GiB
    device with 1 GiB in use."""

    def allocated(self) -> int:
        import gc

        gc.collect()
        storages = {}
        for obj in gc.get_objects():
            if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu":
                st = obj.untyped_storage()
                storages[st.data_ptr()] = st.nbytes()
        return sum(storages.values())

    def memory(self) -> tuple[int, int]:
        return 64 * 2**30, 63 * 2**30


def test_the_gpu_scripts_memory_plan_check_passes_on_cpu():
    """scripts/gpu_check_torch.py's memory plan check with the CPU as "the
    device" and a fake meter (the plan's weights against the loaded models'
    storages); on a GPU it reads the CUDA allocator."""
    script = _gpu_script()
    note = script.check_memory_plan(script.TINY, torch.device("cpu"), meter=_HostMeterFake())
    assert "code2wav bfloat16: plan 9.7 MiB" in note and "code predictor bfloat16" in note, note


def test_the_gpu_scripts_code2wav_check_passes_on_cpu():
    """scripts/gpu_check_torch.py's Code2Wav check with the CPU as "the
    device" (the tolerances and the batched path; the device needs a GPU)."""
    script = _gpu_script()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        note = script.check_code2wav(script.TINY, torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
    assert "together vs alone" in note and "one by one" in note, note


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_gpu_scripts_predictor_checks_pass_on_the_device():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(root / "scripts" / "gpu_check_torch.py"), "--widths", "tiny"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
