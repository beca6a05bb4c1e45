"""GPU checks that need torch and this repository only (no vLLM, no network,
no pytest), for a lent GPU whose image has a CUDA build of torch:

    python scripts/gpu_check_torch.py [--only NAME[,NAME]] [--widths tiny,released]

Each check prints PASS or FAIL with what differed; the exit status is 1 if
any failed, 2 if CUDA is not available. Together well under 5 minutes.

Checks:
- ``predictor-graph-replay``: the code predictor captured as one CUDA graph
  per (bucket, candidate count) gives, on replay, the codes and embedding sums
  of the same frame run eagerly on the device (bitwise; in float32 and in
  bfloat16, the talker's dtype on CUDA), for greedy and
  sampled rows at several buckets; a second replay with other inputs gives
  its own eager result (the static buffers are refilled, the outputs copied).
- ``predictor-seeded-sampler``: the counter-based noise on the device equals
  the CPU's (the integer hash is exact on both); a seeded request gives the
  same codes when replayed again (no generator state advances), and alone or
  among other rows of the same bucket; another frame index draws other codes.
  Across buckets (alone vs in a batch of 64) equality is reported, not
  required: cuBLAS may pick another kernel for another row count.
- ``predictor-timing``: eager vs replay per frame at batch 64 (reported only).
- ``code2wav-device``: the checkpoint's Code2Wav (random weights under the
  released names) on the device: its whole decode within 1e-3 of the CPU's
  (float32 both; cuDNN sums in another order), a chunked stream (5, 10, then
  25 frames) within 1e-4 of the device's whole decode, and ragged chunks of
  four streams decoded together (``push_many``) within 1e-4 of each stream
  decoded alone; its bfloat16 weights on the device (code2wav's ``dtype:
  auto`` on CUDA) within 0.1 of float32 on the CPU (about 0.02 on CPU);
  eight 25-frame chunks one by one vs together (reported).
- ``memory-plan-device``: the memory plan's arithmetic against the device:
  its Code2Wav weights (bfloat16, float32) and the code predictor's in
  bfloat16 against what the allocator holds once loaded; the process's own
  footprint on the device within the margin the plan leaves beside the AR
  stages' shares.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from decoder_svc.qwen3_omni.code2wav import Code2Wav, random_tensors  # noqa: E402
from decoder_svc.qwen3_omni.code2wav_batch import push_many  # noqa: E402
from decoder_svc.qwen3_omni.code_predictor import CodePredictor  # noqa: E402
from decoder_svc.qwen3_omni.code_sampling import SamplingBatch, group_keys, uniforms  # noqa: E402
from decoder_svc.qwen3_omni.memory_plan import MAX_DEVICE_SHARE, plan_memory  # noqa: E402

TINY = {"vocab_size": 2048, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "num_code_groups": 16,
        "rope_parameters": {"rope_theta": 1_000_000.0}, "rms_norm_eps": 1e-6}
RELEASED = {"vocab_size": 2048, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 5,
            "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "num_code_groups": 16,
            "rope_parameters": {"rope_theta": 1_000_000.0}, "rms_norm_eps": 1e-6}
WIDTHS = {"tiny": TINY, "released": RELEASED}
# Code2Wav at each width: the released layout (2*2 then 8*5*4*3: 1920 samples
# a frame), at toy widths or the released ones.
CODE2WAV = {
    "tiny": {"codebook_size": 2048, "num_quantizers": 16, "hidden_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 256,
             "sliding_window": 72, "upsampling_ratios": (2, 2), "upsample_rates": (8, 5, 4, 3),
             "decoder_dim": 96, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "released": {"codebook_size": 2048, "num_quantizers": 16, "hidden_size": 1024, "num_hidden_layers": 8,
                 "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 3072,
                 "sliding_window": 72, "upsampling_ratios": (2, 2), "upsample_rates": (8, 5, 4, 3),
                 "decoder_dim": 1536, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
}


class CheckFailed(AssertionError):
    pass


def expect(ok: bool, what: str) -> None:
    if not ok:
        raise CheckFailed(what)


def predictors(cfg: dict, device: torch.device, seed: int = 0,
               dtype: torch.dtype = torch.float32) -> tuple[CodePredictor, CodePredictor]:
    """(graphs, eager): the same random weights on the device, in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    graphs = CodePredictor(cfg, cuda_graphs=True)
    with torch.no_grad():
        for name, p in graphs.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                std = 0.5 if name == "codec_embedding" else 1.5 * p.shape[-1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    eager = CodePredictor(cfg, cuda_graphs=False)
    eager.load_state_dict(graphs.state_dict())
    return graphs.to(device=device, dtype=dtype), eager.to(device=device, dtype=dtype)


def rows(n: int, device: torch.device, seed: int, hidden: int, greedy_every: int = 4, top_k0_every: int = 0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=gen).to(device)
    e = (torch.randn(n, hidden, generator=gen) * 0.5).to(device)
    s = SamplingBatch.build(
        temperature=[0.0 if greedy_every and i % greedy_every == greedy_every - 1 else 0.9 for i in range(n)],
        top_k=[0 if top_k0_every and i % top_k0_every == 0 else 50 for i in range(n)],
        top_p=[0.8] * n, seed=[7919 * i + seed for i in range(n)], frame=[i % 5 for i in range(n)],
        vocab_size=2048, device=device)
    return h, e, s


def check_graph_replay(cfg: dict, device: torch.device, batches: tuple[int, ...] = (1, 7, 16, 40, 64)) -> str:
    notes = [_graph_replay(cfg, device, batches, torch.float32),
             _graph_replay(cfg, device, batches, torch.bfloat16)]  # the talker's dtype on CUDA
    return "; ".join(notes)


def _graph_replay(cfg: dict, device: torch.device, batches: tuple[int, ...], dtype: torch.dtype) -> str:
    graphs, eager = predictors(cfg, device, dtype=dtype)
    for n in batches:
        for greedy_every, top_k0 in ((1, 0), (4, 0), (4, 5)):
            h, e, s = rows(n, device, seed=n, hidden=cfg["hidden_size"], greedy_every=greedy_every,
                           top_k0_every=top_k0)
            want_codes, want_sum = eager.predict(h, e, s)
            got_codes, got_sum = graphs.predict(h, e, s)
            torch.cuda.synchronize()
            what = f"{dtype}, batch {n}, candidates {s.candidates}"
            expect(torch.equal(got_codes, want_codes),
                   f"{what}: replay codes differ in {int((got_codes != want_codes).any(1).sum())} rows")
            expect(torch.equal(got_sum, want_sum),
                   f"{what}: replay embedding sums differ by {(got_sum - want_sum).abs().max().item():.3g}")
        # a second replay of the same graphs with other inputs: its own eager result
        h, e, s = rows(n, device, seed=1000 + n, hidden=cfg["hidden_size"])
        expect(torch.equal(graphs.predict(h, e, s)[0], eager.predict(h, e, s)[0]),
               f"{dtype}, batch {n}: the second replay's codes differ from eager (stale static buffers?)")
    runner = graphs._graphs
    expect(runner is not None and len(runner.entries) >= 3, f"{dtype}: graphs were captured")
    return f"{dtype}: {len(runner.entries)} graphs captured (bucket, candidates): {sorted(runner.entries)}"


def check_seeded_sampler(cfg: dict, device: torch.device, batches: tuple[int, ...] = (7, 8, 64)) -> str:
    n = 64
    seeds = [0, 1, 2**32 + 3, 2**64 - 1] + list(range(100, 100 + n - 4))
    frames = list(range(n))
    s = SamplingBatch.build(temperature=[1.0] * n, top_k=[50] * n, top_p=[0.8] * n, seed=seeds, frame=frames,
                            vocab_size=2048, device=device)
    u_dev = uniforms(s.seed, s.frame, group_keys(15, device)).cpu()
    c = SamplingBatch.build(temperature=[1.0] * n, top_k=[50] * n, top_p=[0.8] * n, seed=seeds, frame=frames,
                            vocab_size=2048)
    u_cpu = uniforms(c.seed, c.frame, group_keys(15))
    expect(torch.equal(u_dev, u_cpu), "the device's noise differs from the CPU's")

    graphs, _ = predictors(cfg, device, seed=3)
    hid = cfg["hidden_size"]
    gen = torch.Generator().manual_seed(4)
    x, e0 = torch.randn(1, hid, generator=gen).to(device), (torch.randn(1, hid, generator=gen) * 0.5).to(device)

    def one(frame: int) -> torch.Tensor:
        b = SamplingBatch.build(temperature=[1.0], top_k=[50], top_p=[0.8], seed=[2**40 + 9], frame=[frame],
                                vocab_size=2048, device=device)
        return graphs.predict(x, e0, b)[0][0]

    alone = one(0)
    expect(torch.equal(one(0), alone), "the same seeded frame replayed again drew other codes")
    expect(not torch.equal(one(1), alone), "another frame index drew the same 15 codes")
    notes = []
    for n in batches:
        at = n // 2
        h, e, s = rows(n, device, seed=50 + n, hidden=hid)
        h[at], e[at] = x[0], e0[0]
        temps, top_k = s.temperature.clone(), s.top_k.clone()
        temps[at], top_k[at] = 1.0, 50
        seed, frame = s.seed.clone(), s.frame.clone()
        seed[at] = torch.tensor([9, 2**8], device=device)  # 2**40 + 9 as (low, high) words
        frame[at] = 0
        b = SamplingBatch(temperature=temps, top_k=top_k, top_p=s.top_p, seed=seed, frame=frame,
                          candidates=s.candidates)
        codes = graphs.predict(h, e, b)[0]
        same = torch.equal(codes[at], alone)
        if graphs.bucket(n) == graphs.bucket(1):
            expect(same, f"batch {n} (same bucket as alone), row {at}: {codes[at].tolist()} vs {alone.tolist()}")
        else:
            notes.append(f"batch {n} (bucket {graphs.bucket(n)} vs {graphs.bucket(1)} alone): codes "
                         f"{'equal' if same else 'differ'}")
    return "; ".join(notes)


def check_timing(cfg: dict, device: torch.device) -> str:
    graphs, eager = predictors(cfg, device, seed=5)
    h, e, s = rows(64, device, seed=6, hidden=cfg["hidden_size"])
    out = []
    for name, model in (("eager", eager), ("graph replay", graphs)):
        for _ in range(3):
            model.predict(h, e, s)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            model.predict(h, e, s)
        torch.cuda.synchronize()
        out.append(f"{name} {(time.perf_counter() - t0) / 20 * 1e3:.2f} ms/frame")
    return "batch 64: " + ", ".join(out)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    expect(a.shape == b.shape, f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    return (a.float().cpu() - b.float().cpu()).abs().max().item()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_code2wav(cfg: dict, device: torch.device) -> str:
    """cfg: the predictor's width; the Code2Wav of the same name in CODE2WAV."""
    name = "released" if cfg is RELEASED else "tiny"
    config = CODE2WAV[name]
    cpu = Code2Wav.from_config_and_tensors(config, random_tensors(config, seed=3))
    dev = Code2Wav.from_config_and_tensors(config, random_tensors(config, seed=3)).to(device)
    gen = torch.Generator().manual_seed(4)
    codes = [torch.randint(0, config["codebook_size"], (n, config["num_quantizers"]), generator=gen)
             for n in (60, 45, 52, 33)]
    whole = dev.decode(codes[0].to(device))
    d = _max_diff(whole, cpu.decode(codes[0]))
    expect(d <= 1e-3, f"whole decode on {device} vs CPU: max |diff| {d:.2e} > 1e-3")
    stream, pieces, start = dev.new_stream(), [], 0
    for size in (5, 10, 25, 20):  # its 60 frames
        pieces.append(stream.push(codes[0][start : start + size].to(device)))
        start += size
    d_stream = _max_diff(torch.cat(pieces), whole)
    expect(d_stream <= 1e-4, f"chunked stream vs whole decode on {device}: max |diff| {d_stream:.2e} > 1e-4")
    # bfloat16 weights on the device (code2wav's dtype auto on CUDA) vs float32 on the CPU
    half = Code2Wav.from_config_and_tensors(config, random_tensors(config, seed=3), device=device,
                                            dtype=torch.bfloat16)
    d_half = _max_diff(half.decode(codes[0]), cpu.decode(codes[0]))
    expect(d_half <= 0.1, f"bfloat16 decode on {device} vs float32 on the CPU: max |diff| {d_half:.2e} > 0.1")
    # ragged chunks of four streams together vs each alone, on the device
    alone = [dev.decode(c.to(device)) for c in codes]
    streams, got, done = [dev.new_stream() for _ in codes], [[] for _ in codes], [0] * len(codes)
    plans = [[5, 10, 25, 25], [1, 4, 10, 25, 25], [7, 25, 25], [25, 25]]
    while any(done[i] < c.shape[0] for i, c in enumerate(codes)):
        rows = [i for i, c in enumerate(codes) if done[i] < c.shape[0]]
        blocks = []
        for i in rows:
            n = plans[i].pop(0) if plans[i] else 25
            blocks.append(codes[i][done[i] : done[i] + n].to(device))
            done[i] = min(done[i] + n, codes[i].shape[0])
        for i, piece in zip(rows, push_many([streams[i] for i in rows], blocks), strict=True):
            got[i].append(piece)
    worst = max(_max_diff(torch.cat(g), a) for g, a in zip(got, alone, strict=True))
    expect(worst <= 1e-4, f"streams decoded together vs alone on {device}: max |diff| {worst:.2e} > 1e-4")
    # eight 25-frame chunks: one call each vs one call for all (reported)
    chunks = [torch.randint(0, config["codebook_size"], (25, config["num_quantizers"]), generator=gen).to(device)
              for _ in range(8)]
    times = []
    for together in (False, True):
        best = float("inf")
        for _ in range(3):
            streams = [dev.new_stream() for _ in chunks]
            _sync(device)
            t0 = time.perf_counter()
            if together:
                push_many(streams, chunks)
            else:
                for st, c in zip(streams, chunks, strict=True):
                    st.push(c)
            _sync(device)
            best = min(best, time.perf_counter() - t0)
        times.append(best * 1e3)
    return (f"vs CPU {d:.1e}, bfloat16 vs CPU float32 {d_half:.1e}, chunked {d_stream:.1e}, together vs alone "
            f"{worst:.1e}; 8 chunks of 25 frames: "
            f"one by one {times[0]:.1f} ms, together {times[1]:.1f} ms")


class CudaMeter:
    """What the plan is checked against on a CUDA device: the caching
    allocator's live bytes and the device's (total, free) memory."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def allocated(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device)

    def memory(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return total, free


class _Counts:
    """A checkpoint as the plan reads it: tensor element counts by name."""

    def __init__(self, numel: dict[str, int]) -> None:
        self._numel = numel

    def numel(self, prefix: str) -> int:
        return sum(n for name, n in self._numel.items() if name.startswith(prefix))


def check_memory_plan(cfg: dict, device: torch.device, meter: CudaMeter | None = None) -> str:
    """The memory plan's arithmetic on the device (decoder_svc/qwen3_omni/memory_plan.py):
    - Code2Wav at this width: the plan's weights for one copy on this device,
      in bfloat16 and in float32, against what the allocator holds once the
      model is loaded there (within 1% + 4 MiB);
    - the code predictor (part of the talker's weights) in bfloat16, the
      talker's dtype on CUDA: its element count x 2 against the allocator;
    - this process's footprint on the device before any weights (CUDA
      context, torch) fits in the 1 - MAX_DEVICE_SHARE of the device the
      plan leaves beside the AR stages' shares."""
    meter = meter or CudaMeter(device)
    total, free = meter.memory()
    context = total - free
    expect(context <= (1 - MAX_DEVICE_SHARE) * total,
           f"the process takes {context / 2**30:.2f} GiB of the device before any weights, above the plan's "
           f"margin {(1 - MAX_DEVICE_SHARE) * total / 2**30:.2f} GiB")
    name = "released" if cfg is RELEASED else "tiny"
    config = CODE2WAV[name]
    counts = _Counts({"code2wav." + n: math.prod(shape) for n, shape in Code2Wav.expected_shapes(config).items()})
    where = f"cuda:{device.index or 0}" if device.type == "cuda" else "cpu"
    notes = [f"device {total / 2**30:.2f} GiB, {context / 2**30:.2f} GiB in use before any weights"]
    for dtype, label in ((torch.bfloat16, "bfloat16"), (torch.float32, "float32")):
        plan = plan_memory(counts, [], code2wav_workers=1, host_available=2**50,
                           device_totals={where: total} if where != "cpu" else {}, code2wav=(where, label))
        want = plan.stages[-1].weights
        before = meter.allocated()
        model = Code2Wav.from_config_and_tensors(config, random_tensors(config, seed=3), device=device, dtype=dtype)
        got = meter.allocated() - before  # the model's own (the host tensors it was built from are gone)
        expect(abs(got - want) <= 0.01 * want + 4 * 2**20,
               f"code2wav in {label}: the plan counts {want} bytes, the device holds {got}")
        notes.append(f"code2wav {label}: plan {want / 2**20:.1f} MiB, device {got / 2**20:.1f} MiB")
        del model
    before = meter.allocated()
    predictor = CodePredictor(cfg).to(device=device, dtype=torch.bfloat16)
    got = meter.allocated() - before
    want = sum(p.numel() for p in predictor.parameters()) * 2
    expect(abs(got - want) <= 0.01 * want + 4 * 2**20,
           f"code predictor in bfloat16: {want} bytes of weights, the device holds {got}")
    notes.append(f"code predictor bfloat16: {want / 2**20:.1f} MiB, device {got / 2**20:.1f} MiB")
    return "; ".join(notes)


CHECKS: dict[str, Callable[[dict, torch.device], str]] = {
    "predictor-graph-replay": check_graph_replay,
    "predictor-seeded-sampler": check_seeded_sampler,
    "predictor-timing": check_timing,
    "code2wav-device": check_code2wav,
    "memory-plan-device": check_memory_plan,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help=f"comma-separated checks (default all: {', '.join(CHECKS)})")
    p.add_argument("--widths", default="tiny,released", help="comma-separated: tiny, released")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check_torch: CUDA is not available to this torch", file=sys.stderr)
        return 2
    names = [n for n in args.only.split(",") if n] or list(CHECKS)
    for n in names:
        if n not in CHECKS:
            p.error(f"--only: unknown check {n!r} (choices: {', '.join(CHECKS)})")
    widths = [w for w in args.widths.split(",") if w]
    for w in widths:
        if w not in WIDTHS:
            p.error(f"--widths: unknown {w!r} (choices: {', '.join(WIDTHS)})")
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"gpu_check_torch: torch {torch.__version__}, {torch.cuda.get_device_name(device)}")
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 products, as the services run them
    torch.backends.cudnn.allow_tf32 = False  # and float32 convolutions (Code2Wav)
    failed = 0
    for name in names:
        for w in widths:
            t0 = time.perf_counter()
            try:
                note = CHECKS[name](WIDTHS[w], device)
                print(f"PASS {name} [{w}] ({time.perf_counter() - t0:.1f}s){': ' + note if note else ''}")
            except CheckFailed as exc:
                failed += 1
                print(f"FAIL {name} [{w}]: {exc}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
