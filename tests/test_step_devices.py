"""The decode step's device bookkeeping and copies, without an engine.

``VLLMBackend._on_capture`` / ``_build`` (the step hook's work and row
selection: ``decoder_svc.vllm_engine.step_assembly``; the stand-in talker's
code predictor) and the talker's frame postprocess (``sampled_frame_codes``)
run on a StepCapture built here, once with host tensors and once with the
runner's tensors on a fake accelerator (``tests/fake_device.py``: every op's
operands must be on one device; device-to-host reads are counted). Both runs
must give the values computed independently in the test. A counting test
checks that a step copies its hidden rows once: into the arena slot.
"""

from __future__ import annotations

import copy
import itertools
import sys
import types
from collections import deque
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))

from fake_device import FakeDeviceMode, module_to_device, to_device, to_host  # noqa: E402

from decoder_svc.backend import LazyDict, LazyList  # noqa: E402
from decoder_svc.qwen3_omni.code_predictor import CodePredictor  # noqa: E402
from decoder_svc.qwen3_omni.code_sampling import SamplingBatch  # noqa: E402
from decoder_svc.qwen3_omni.talker import sampled_frame_codes  # noqa: E402
from decoder_svc.qwen3_omni.talker_slots import TalkerRequestState, TalkerSlots  # noqa: E402
from decoder_svc.snapshot import meta_of, step_tensors, take_snapshot  # noqa: E402
from decoder_svc.testing.standin_backend import StandinBackend  # noqa: E402
from decoder_svc.vllm_engine.capture import StepCapture  # noqa: E402
from decoder_svc.vllm_engine.step_assembly import RowLedger, timed_codes  # noqa: E402
from omni_common.materialize import HIDDEN_STATES, SAMPLED_TOKEN_IDS  # noqa: E402
from omni_common.shm_arena import ShmArena  # noqa: E402

H, K, V = 16, 3, 8
NST = [3, 1, 1, 2]  # tokens scheduled per request: a prefill, two decodes, a partial prefill chunk
QSL = [0, 3, 4, 5, 7]
T = QSL[-1]
REQS = [f"r{i}-abcdefgh" for i in range(4)]
EXT = [f"r{i}" for i in range(4)]


def _backend(*, talker: bool, cp_weight: torch.Tensor | None = None) -> StandinBackend:
    """A StandinBackend (a VLLMBackend) without an engine: only what the step's code reads."""
    b = object.__new__(StandinBackend)
    b.role = b.name = "talker" if talker else "thinker"
    b.is_talker = talker
    b.capture_hidden = True
    b.num_codebooks = K if talker else 1
    b.codec_vocab = V
    b.hidden_size = H
    b._cp_weight = cp_weight
    b._copy_hidden = False
    b._captured = deque()
    b._ledger = RowLedger()
    b.dropped_rows = 0
    b._codes_of = timed_codes(b._codes, b.name) if talker else None
    return b


def _capture(hidden: torch.Tensor, sampled: torch.Tensor, discard: list[bool], key: object,
             computed: tuple[int, ...] = (0, 5, 9, 0)) -> StepCapture:
    qsl = torch.tensor(QSL, dtype=torch.int32)
    last = hidden.index_select(0, (torch.tensor(QSL[1:]) - 1).to(hidden.device))  # the runner's rows, on its device
    return StepCapture(
        step_index=7,
        req_ids=list(REQS),
        sampled_token_ids=sampled,
        discard_mask=torch.tensor(discard),
        query_start_loc=qsl,
        num_scheduled_tokens=qsl[1:] - qsl[:-1],
        num_computed_tokens=torch.tensor(computed, dtype=torch.int32),
        num_prompt_tokens=torch.tensor([3, 4, 6, 9], dtype=torch.int32),
        hidden_states=hidden,
        sample_hidden_states=last,
        logits=None,
        is_async_output=False,
        scheduler_output=key,
    )


def _run_step(b: StandinBackend, cap: StepCapture, live: list[bool], text: dict, engine_ids: dict):
    b._on_capture(cap)
    captured = b._captured.popleft()
    ext_ids = [e if ok else "" for e, ok in zip(EXT, live, strict=True)]
    plan = b._ledger.plan(captured, live, ext_ids)  # as step() does, under its lock
    return b._build(captured, live, ext_ids, {"r1": "length"}, text, engine_ids, plan)


def test_talker_step_keeps_each_tensor_on_its_device():
    torch.manual_seed(0)
    hidden = torch.randn(T, H)
    sampled = torch.tensor([[5], [2], [7], [-1]], dtype=torch.int32)
    w = torch.randn((K - 1) * V, H)
    discard = [False, False, False, True]
    live = [True, True, False, True]  # r2 was aborted
    # expected, computed here: rows r0 and r1 survive (r2 dead, r3 discarded)
    last = hidden[[2, 3]]
    want_codes = torch.zeros(2, K, dtype=torch.int64)
    want_codes[:, 0] = torch.tensor([5, 2])
    want_codes[:, 1:] = (last @ w.T).view(2, K - 1, V).argmax(-1)

    host = _run_step(_backend(talker=True, cp_weight=w.clone()), _capture(hidden, sampled, discard, "k"),
                     live, {}, {})
    mode = FakeDeviceMode()
    with mode:
        dev = _run_step(
            _backend(talker=True, cp_weight=w.clone()),  # the weight starts on the host, as loaded
            _capture(to_device(hidden), to_device(sampled), discard, "k"),
            live, {}, {},
        )
    assert mode.mixed == [], "ops mixed devices:\n" + "\n".join(mode.mixed)
    assert len(mode.syncs) <= 1, f"more than one device->host read per step: {mode.syncs}"
    for out in (host, dev):
        assert out.request_ids == ["r0", "r1"]
        assert list(out.batch_indices) == [0, 1]
        assert out.num_scheduled_tokens == [3, 1]
        assert out.query_start_loc.tolist() == [0, 3, 4]
        assert out.query_start_loc.device.type == "cpu" and out.sampled_token_ids.device.type == "cpu"
        assert out.sampled_token_ids.tolist() == [[5], [2]]
        assert list(out.spans) == [(0, 3), (3, 4)]
        assert out.finished == {"r1": "length"}
        codes, _ = out.mm_outputs["codec_codes"]
        assert torch.equal(to_host(codes), want_codes)
        assert torch.equal(to_host(out.hidden_states), hidden[:4])
    assert dev.hidden_states.device.type == "meta" and dev.mm_outputs["codec_codes"][0].device.type == "meta"


def test_thinker_step_all_rows_kept_hands_on_the_runners_tensors():
    torch.manual_seed(1)
    hidden = torch.randn(T, H)
    sampled = torch.tensor([[11], [12], [13], [14]], dtype=torch.int32)
    discard = [False] * 4
    live = [True] * 4
    text = {"r0": "a", "r1": "b", "r3": "d"}
    engine_ids = {"r0": [11], "r1": [12], "r2": [13]}
    mode = FakeDeviceMode()
    with mode:
        dev_hidden = to_device(hidden)
        out = _run_step(_backend(talker=False), _capture(dev_hidden, to_device(sampled), discard, "k"),
                        live, text, engine_ids)
    assert mode.mixed == [], "ops mixed devices:\n" + "\n".join(mode.mixed)
    assert len(mode.syncs) == 1, mode.syncs  # the sampled ids, once
    assert out.hidden_states is dev_hidden, "a kept step must hand on the runner's tensor, not a copy"
    # lazily built per-request values, equal to what the router reads
    assert isinstance(out.new_token_ids, LazyDict) and isinstance(out.num_scheduled_tokens, LazyList)
    assert dict(out.new_token_ids) == {"r0": [11], "r1": [12], "r2": [13], "r3": [14]}
    assert dict(out.text_deltas) == {"r0": "a", "r1": "b", "r2": "", "r3": "d"}
    assert out.num_scheduled_tokens == NST and list(out.batch_indices) == [0, 1, 2, 3]
    assert out.finished == {"r1": "length"}


def test_a_recomputed_requests_rows_are_handed_on_once():
    """A request resumed after a preemption computes its prompt and tokens
    again in one step: only rows of positions not handed on before come out
    (the first computation's rows stay the ones consumers have), on the
    runner's device, with one device-to-host read."""
    torch.manual_seed(2)
    hidden = torch.randn(T, H)
    sampled = torch.tensor([[11], [12], [13], [14]], dtype=torch.int32)
    b = _backend(talker=False)
    # r0 (positions 0..2 this step) handed on positions 0 and 1 before it was preempted
    b._ledger._marks.update({"r0": 2, "r1": 5})
    mode = FakeDeviceMode()
    with mode:
        out = _run_step(b, _capture(to_device(hidden), to_device(sampled), [False] * 4, "k"), [True] * 4, {}, {})
    assert mode.mixed == [] and len(mode.syncs) == 1, (mode.mixed, mode.syncs)
    assert out.request_ids == EXT and out.num_scheduled_tokens == [1, 1, 1, 2]
    assert out.query_start_loc.tolist() == [0, 1, 2, 3, 5]
    assert torch.equal(to_host(out.hidden_states), hidden[[2, 3, 4, 5, 6]])
    assert out.sampled_token_ids.tolist() == [[11], [12], [13], [14]], "every row's new token is kept"
    assert b._ledger.marks() == {"r0": 3, "r1": 6, "r2": 10, "r3": 2}
    # the same positions again (a second preemption): nothing of r0 comes out twice
    b._ledger._marks["r1"] = 0
    again = _run_step(b, _capture(hidden, sampled, [False] * 4, "k"), [True] * 4, {}, {})
    assert again.num_scheduled_tokens == [0, 1, 0, 0] and torch.equal(again.hidden_states, hidden[[3]])
    # a step without a recompute hands the runner's tensor on as it is
    fresh = _backend(talker=False)
    assert _run_step(fresh, _capture(hidden, sampled, [False] * 4, "k"), [True] * 4, {}, {}).hidden_states is hidden


def test_a_chunked_prefills_rows_come_whole_with_the_step_that_samples():
    """A prompt prefilled in chunks: the chunks before the last sample
    nothing (vLLM discards their token); their rows are held and handed on
    ahead of the last chunk's, so the request's first step out carries every
    prompt row, as a prompt prefilled in one step does (the talker is fed
    from them). A preemption that recomputes held positions adds nothing
    twice; on the runner's device, with one device-to-host read per step."""
    torch.manual_seed(3)
    first, second = torch.randn(T, H), torch.randn(T, H)
    sampled = torch.tensor([[11], [12], [13], [-1]], dtype=torch.int32)
    b = _backend(talker=False)
    mode = FakeDeviceMode()
    with mode:
        # step 1: r3 computes prompt positions 0..1 of its prompt (a partial chunk: no token)
        out1 = _run_step(b, _capture(to_device(first), to_device(sampled), [False, False, False, True], "k1"),
                         [True] * 4, {}, {})
        held = b._ledger.held_rows()
        # step 2: r3 computes positions 2..3 and samples
        out2 = _run_step(b, _capture(to_device(second), to_device(sampled.abs()), [False] * 4, "k2",
                                     computed=(3, 6, 10, 2)), [True] * 4, {}, {})
    assert mode.mixed == [] and len(mode.syncs) == 2, (mode.mixed, mode.syncs)
    assert out1.request_ids == ["r0", "r1", "r2"] and out1.num_scheduled_tokens == [3, 1, 1]
    assert held == {"r3": 2}
    assert out2.request_ids == EXT and out2.num_scheduled_tokens == [3, 1, 1, 4]
    assert out2.query_start_loc.tolist() == [0, 3, 4, 5, 9]
    assert torch.equal(to_host(out2.hidden_states), torch.cat((second[:5], first[5:7], second[5:7])))
    assert b._ledger.held_rows() == {} and b._ledger.marks()["r3"] == 4
    # r3 preempted in its second chunk and computed again from its start: held positions come out once
    b = _backend(talker=False)
    step1 = _run_step(b, _capture(first, sampled, [False, False, False, True], "k1"), [True] * 4, {}, {})
    again = _run_step(b, _capture(second, sampled, [False, False, False, True], "k2", computed=(3, 6, 10, 0)),
                      [True] * 4, {}, {})
    assert b._ledger.held_rows() == {"r3": 2} and b._ledger.marks()["r3"] == 2
    done = _run_step(b, _capture(first, sampled.abs(), [False] * 4, "k3", computed=(6, 7, 11, 1)),
                     [True] * 4, {}, {})
    assert step1.request_ids == again.request_ids == ["r0", "r1", "r2"]
    assert done.num_scheduled_tokens[3] == 3
    assert torch.equal(done.hidden_states[-3:], torch.cat((first[5:7], first[6:7])))
    # a prompt in three chunks: the rows of both partial ones come out, in order, ahead of the last one's
    b = _backend(talker=False)
    partial = [False, False, False, True]
    _run_step(b, _capture(first, sampled, partial, "c1", computed=(0, 5, 9, 0)), [True] * 4, {}, {})
    _run_step(b, _capture(second, sampled, partial, "c2", computed=(3, 6, 10, 2)), [True] * 4, {}, {})
    last = _run_step(b, _capture(first, sampled.abs(), [False] * 4, "c3", computed=(6, 7, 11, 4)), [True] * 4, {}, {})
    assert last.num_scheduled_tokens[3] == 6
    assert torch.equal(last.hidden_states[-6:], torch.cat((first[5:7], second[5:7], first[5:7])))
    # a request that leaves the engine takes its held rows with it
    _run_step(b, _capture(second, sampled, [False, False, False, True], "k4", computed=(9, 8, 12, 6)),
              [True] * 4, {}, {})
    assert b._ledger.held_rows() == {"r3": 2}
    b._ledger.forget("r3")
    assert "r3" not in b._ledger.held_rows() and "r3" not in b._ledger.marks()


class _CopyCounter(TorchDispatchMode):
    """Bytes of every tensor an op produces at least ``min_bytes`` large."""

    def __init__(self, min_bytes: int) -> None:
        super().__init__()
        self.min_bytes = min_bytes
        self.big: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.numel() * t.element_size() >= self.min_bytes:
                if not any(isinstance(a, torch.Tensor) and a.data_ptr() == t.data_ptr() for a in args):
                    self.big.append(f"{func} -> {tuple(t.shape)}")
        return out


def test_a_step_copies_its_hidden_rows_once_into_the_slot():
    hidden = torch.randn(4096, 256)  # 4 MiB
    rows = hidden.shape[0] // 4
    qsl = torch.tensor([0, rows, 2 * rows, 3 * rows, 4 * rows], dtype=torch.int32)
    cap = StepCapture(
        step_index=0, req_ids=list(REQS), sampled_token_ids=torch.tensor([[1], [2], [3], [4]], dtype=torch.int32),
        discard_mask=torch.zeros(4, dtype=torch.bool), query_start_loc=qsl,
        num_scheduled_tokens=qsl[1:] - qsl[:-1], num_computed_tokens=torch.zeros(4, dtype=torch.int32),
        num_prompt_tokens=torch.full((4,), rows, dtype=torch.int32), hidden_states=hidden,
        sample_hidden_states=hidden[qsl[1:].long() - 1], logits=None, is_async_output=False, scheduler_output="k",
    )
    nbytes = hidden.numel() * hidden.element_size()
    with ShmArena("omni-stepcopy", 2, 2 * nbytes) as arena:
        counter = _CopyCounter(min_bytes=nbytes // 4)
        with counter:
            b = _backend(talker=False)
            out = _run_step(b, cap, [True] * 4, {}, {})
            meta = meta_of(out, step_id=1, stage_id=0, downstream_request_ids=[], connector_signals=[])
            snap = take_snapshot(meta, step_tensors(out, {HIDDEN_STATES, SAMPLED_TOKEN_IDS}), arena)
        assert counter.big == [], f"full-size copies on the step besides the slot's: {counter.big}"
        ref, _ = snap.handles[HIDDEN_STATES]
        assert ref.shm.byte_size == nbytes
        got = arena.data_view(ref.shm.offset, nbytes).view(torch.float32).view(hidden.shape)
        assert torch.equal(got, hidden), "the slot holds the step's hidden rows"
        arena.release(snap.lease.slot, snap.lease.generation)


def _predictor() -> CodePredictor:
    torch.manual_seed(2)
    cp = CodePredictor({
        "hidden_size": H, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
        "vocab_size": V, "num_code_groups": K, "intermediate_size": 32, "num_hidden_layers": 1,
    })
    with torch.no_grad():
        for p in cp.parameters():
            p.normal_(0, 0.5)
    return cp


def _slots(req_ids: list[str]) -> TalkerSlots:
    """The talker's slot store with requests a, b and c (greedy), the step's rows prepared."""
    slots = TalkerSlots(H, V + 4)
    for rid in ("a", "b", "c"):
        slots.add(rid, TalkerRequestState(prompt_len=3, trailing=torch.zeros(2, H), pad=torch.zeros(H)))
    slots.prepare(req_ids, list(range(len(req_ids) + 1)), [3] * len(req_ids))
    return slots


def test_talker_frame_codes_run_on_the_models_device_without_a_sync():
    cp = _predictor()
    emb = torch.nn.Embedding(V + 4, H)
    hidden = torch.randn(4, H)
    code0 = torch.tensor([3, V + 1, 5, 1])  # row 1: a control id (no residual codes)
    valid = torch.tensor([True, True, True, False])
    req_ids = ["a", "b", "c", "gone"]
    host_slots = _slots(req_ids)
    want = sampled_frame_codes(host_slots, copy.deepcopy(cp), copy.deepcopy(emb), req_ids, hidden, code0, valid)
    assert want[:, 0].tolist() == code0.tolist()
    assert want[1, 1:].tolist() == [0] * (K - 1) and want[3, 1:].tolist() == [0] * (K - 1)
    ref_codes, ref_sum = cp.predict(hidden[[0, 2]], emb(code0[[0, 2]]), SamplingBatch.greedy(2))
    assert torch.equal(want[[0, 2], 1:], ref_codes)
    assert host_slots.frames[1:4].tolist() == [1, 0, 1]
    assert torch.equal(host_slots.frame_residual(1, 0), ref_sum[0])
    assert torch.equal(host_slots.frame_residual(3, 0), ref_sum[1])

    dev_cp = module_to_device(copy.deepcopy(cp))
    # the fake device's wrapper tensors cannot be viewed under inference mode:
    # the same predict, without its inference_mode decorator
    dev_cp.predict = types.MethodType(CodePredictor.predict.__wrapped__, dev_cp)
    mode = FakeDeviceMode()
    with mode:
        slots = TalkerSlots(H, V + 4, device="meta")
        for rid in ("a", "b", "c"):
            slots.add(rid, TalkerRequestState(prompt_len=3, trailing=torch.zeros(2, H), pad=torch.zeros(H)))
        slots.prepare(req_ids, list(range(len(req_ids) + 1)), [3] * len(req_ids))
        got = sampled_frame_codes(slots, dev_cp, module_to_device(copy.deepcopy(emb)), req_ids,
                                  to_device(hidden), to_device(code0), valid)
    assert mode.mixed == [], "ops mixed devices:\n" + "\n".join(mode.mixed)
    assert mode.syncs == [], f"device->host reads in the talker's step: {mode.syncs}"
    assert got.device.type == "meta" and torch.equal(to_host(got), want)
    for name in ("frames", "seen"):
        assert getattr(slots, name).device.type == "meta"
        assert torch.equal(to_host(getattr(slots, name)), getattr(host_slots, name)), name
    assert torch.allclose(to_host(slots.residual.data), host_slots.residual.data)


def test_lazy_values_compare_and_read_like_lists_and_dicts():
    calls = itertools.count()
    lazy = LazyList(lambda: (next(calls), [1, 2])[1])
    assert lazy == [1, 2] and [1, 2] == lazy and list(lazy) == [1, 2] and lazy[1] == 2 and len(lazy) == 2
    assert next(calls) == 1, "computed once"
    d = LazyDict(lambda: {"a": 1})
    assert d == {"a": 1} and d.get("b") is None and set(d) == {"a"}


def test_a_discarded_samples_draw_is_undone_for_cpu_generators():
    """A partial prefill chunk's sample is discarded; vLLM rewinds the
    request's generator by its offset, which CPU generators lack. The step
    hook keeps the generators' states of the discarded rows (a fake runner
    here: only the attributes read), so a seeded stream does not depend on
    how a prompt was split."""
    from types import SimpleNamespace

    import numpy as np

    from decoder_svc.vllm_engine.capture import _discarded_cpu_generators

    gens = {0: torch.Generator().manual_seed(1), 2: torch.Generator().manual_seed(3)}
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(generators=gens, num_reqs=3),
        discard_request_mask=SimpleNamespace(np=np.array([False, True, True, True])),  # row 3: past num_reqs
    )
    saved = _discarded_cpu_generators(runner)
    assert list(saved) == [2], "only discarded rows that have a generator"
    gen, before = saved[2]
    first = torch.rand(4, generator=gen)
    gen.set_state(before)  # what the hook does after sampling
    assert torch.equal(torch.rand(4, generator=gen), first), "the stream goes on as if the draw never happened"
    runner.input_batch.generators = {}
    assert _discarded_cpu_generators(runner) == {}
