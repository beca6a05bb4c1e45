"""The talker's slot store (``decoder_svc.qwen3_omni.talker_slots``), without an engine.

What the talker's forward, logits and frame postprocess compute from it is
compared with a per-row Python reference (what the talker did before the
store: a dict of per-request states read row by row); the text pool is
driven through relocation, compaction and growth; and the step's work runs
on a fake accelerator (``tests/fake_device.py``) without a device-to-host
read or a mixed-device op.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from fake_device import FakeDeviceMode, to_device, to_host  # noqa: E402

from decoder_svc.qwen3_omni.talker_slots import TalkerRequestState, TalkerSlots  # noqa: E402

H, V = 8, 32


def _state(prompt_len: int, n_text: int, *, seed: int = 0, penalty: float = 1.0, complete: bool = True,
           gen: torch.Generator) -> TalkerRequestState:
    return TalkerRequestState(prompt_len=prompt_len, trailing=torch.randn(n_text, H, generator=gen),
                              pad=torch.randn(H, generator=gen), complete=complete, repetition_penalty=penalty,
                              temperature=0.9, top_k=5, top_p=0.8, seed=seed)


def _reference_inputs(embeds, positions, rows, states, residual):
    """The per-row reference: rows [(request id or None)] per token."""
    out = embeds.clone()
    for r, rid in enumerate(rows):
        st = states.get(rid)
        if st is None or rid not in residual:
            continue
        step = int(positions[r]) - st.prompt_len
        if step < 0:
            continue
        text = st.trailing[step] if step < st.trailing.shape[0] else st.pad
        out[r] = embeds[r] + (residual[rid] + text)
    return out


def test_step_inputs_and_penalty_equal_the_per_row_reference():
    gen = torch.Generator().manual_seed(1)
    slots = TalkerSlots(H, V, capacity=2, pool_rows=4)  # small: grows while adding
    states = {"a": _state(3, 5, penalty=1.3, gen=gen), "b": _state(2, 1, gen=gen), "c": _state(4, 3, penalty=2.0, gen=gen)}
    for rid, st in states.items():
        slots.add(rid, st)
    # step 1: "a" and "b" decode (after their prefills), "c" prefills: rows per request 1, 1, 4
    ids = ["a", "b", "c"]
    slots.prepare(ids, [0, 1, 2, 6])
    slot, _ = slots.frame_rows(ids, V)
    residual = {"a": torch.randn(H, generator=gen), "b": torch.randn(H, generator=gen)}
    ok = torch.tensor([True, True, False])
    code0 = torch.tensor([7, 9, 0])
    slots.record(slot, ok, code0, torch.stack((residual["a"], residual["b"], torch.randn(H, generator=gen))))
    assert slots.frames[slot].tolist() == [1, 1, 0]
    # step 2: "b" past its text (pad), "a" inside it, "c" has no frame yet,
    # plus two padding rows; an unknown request's row adds nothing
    ids = ["b", "zz", "a", "c"]
    slots.prepare(ids, [0, 1, 2, 3, 4])
    embeds = torch.randn(6, H, generator=gen)
    positions = torch.tensor([2 + 4, 9, 3 + 2, 4, 0, 0])
    got = slots.step_inputs(embeds, positions)
    want = _reference_inputs(embeds, positions, ["b", "zz", "a", "c", None, None], states, residual)
    assert torch.equal(got, want)
    assert torch.equal(got[1], embeds[1]) and torch.equal(got[3:], embeds[3:])
    # two rows past the prompt in one step (a recompute): each reads its own text row
    slots.prepare(["a"], [0, 2])
    embeds2 = torch.randn(2, H, generator=gen)
    got2 = slots.step_inputs(embeds2, torch.tensor([3 + 1, 3 + 6]))
    assert torch.equal(got2, _reference_inputs(embeds2, torch.tensor([4, 9]), ["a", "a"], states, residual))

    slots.prepare(ids, [0, 1, 2, 3, 4])
    logits = torch.randn(4, V, generator=gen) * 3
    pen = slots.penalize(logits)
    want = logits.clone()
    for row, p, seen in ((0, 1.0, [9]), (2, 1.3, [7])):  # "b" and "a"
        s = want[row, seen]
        want[row, seen] = torch.where(s < 0, s * p, s / p)
    assert torch.equal(pen, want)
    assert torch.equal(pen[[1, 3]], logits[[1, 3]])


def test_text_pool_survives_relocation_compaction_growth_and_slot_reuse():
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    slots = TalkerSlots(H, V, capacity=2, pool_rows=8)
    given: dict[str, list[torch.Tensor]] = {}
    taken: dict[str, int] = {}
    for step in range(300):
        op = rng.random()
        if op < 0.15 or not given:
            rid = f"r{step}"
            st = _state(rng.randrange(1, 9), rng.randrange(0, 40), complete=False, gen=gen)
            taken[rid] = slots.add(rid, st)
            given[rid] = [st.trailing]
        elif op < 0.25:
            rid = rng.choice(sorted(given))
            slots.remove(rid)
            given.pop(rid)
        else:
            rid = rng.choice(sorted(given))
            rows = torch.randn(rng.randrange(0, 12), H, generator=gen)
            assert slots.extend(rid, rows, complete=False)
            given[rid].append(rows)
        if rng.random() < 0.5:
            slots.prepare([], [0])  # a step: the queued writes are applied
            for rid, parts in given.items():
                s = taken[rid]
                want = torch.cat(parts)
                off, n = int(slots.text_off[s]), int(slots.text_len[s])
                assert n == want.shape[0], f"{rid}: {n} rows, want {want.shape[0]}"
                assert torch.equal(slots.pool[off : off + n], want), f"{rid}: text rows differ"
    assert sorted(slots.live()) == sorted(given)
    assert not slots.extend("gone", torch.zeros(1, H), complete=True)
    # slots are reused once their removal is applied; never two live requests on one slot
    live_slots = [taken[rid] for rid in given]
    assert len(set(live_slots)) == len(live_slots) and 0 not in live_slots
    assert slots.capacity < 2 * (max(live_slots) + 1) + 2


def test_held_and_removal_wait_for_the_next_step():
    gen = torch.Generator().manual_seed(2)
    slots = TalkerSlots(H, V)
    slot = slots.add("s", _state(4, 2, complete=False, gen=gen))
    assert not slots.held("s", 4 + 1) and slots.held("s", 4 + 2)
    slots.extend("s", torch.randn(3, H, generator=gen), complete=False)
    assert not slots.held("s", 4 + 4) and slots.held("s", 4 + 5)
    slots.extend("s", torch.zeros(0, H), complete=True)
    assert not slots.held("s", 100) and not slots.held("unknown", 0)
    slots.remove("s")
    assert slots.live() == []
    other = slots.add("t", _state(1, 1, gen=gen))
    assert other != slot, "a slot is not reused before its removal is applied"
    slots.prepare([], [0])
    assert slots.add("u", _state(1, 1, gen=gen)) == slot


def _run_step(slots: TalkerSlots, embeds, positions, logits, embed_sum, ok, code0):
    ids = ["a", "b", "c"]
    slots.prepare(ids, [0, 3, 4, 5])
    x = slots.step_inputs(embeds, positions)
    lg = slots.penalize(logits)
    slot, sampling = slots.frame_rows(ids, V)
    slots.record(slot, ok, code0, embed_sum)
    return x, lg, sampling


def test_the_step_runs_on_the_device_without_a_sync():
    gen = torch.Generator().manual_seed(3)
    states = [_state(3, 2, seed=11, penalty=1.5, gen=gen), _state(1, 4, seed=2**40 + 3, gen=gen),
              _state(2, 1, gen=gen)]
    embeds, logits = torch.randn(5, H, generator=gen), torch.randn(3, V, generator=gen)
    positions = torch.tensor([0, 1, 2, 1, 2])
    embed_sum = torch.randn(3, H, generator=gen)
    ok, code0 = torch.tensor([False, True, True]), torch.tensor([0, 4, 6])
    host = TalkerSlots(H, V)
    for rid, st in zip("abc", states, strict=True):
        host.add(rid, st)
    want = [_run_step(host, embeds, positions, logits, embed_sum, ok, code0) for _ in range(2)]
    mode = FakeDeviceMode()
    with mode:
        dev = TalkerSlots(H, V, device="meta")
        for rid, st in zip("abc", states, strict=True):
            dev.add(rid, st)
        got = [_run_step(dev, to_device(embeds), to_device(positions), to_device(logits), to_device(embed_sum),
                         to_device(ok), to_device(code0)) for _ in range(2)]
    assert mode.mixed == [], "ops mixed devices:\n" + "\n".join(mode.mixed)
    assert mode.syncs == [], f"device->host reads in the talker's step: {mode.syncs}"
    for (x, lg, s), (wx, wlg, ws) in zip(got, want, strict=True):
        assert x.device.type == "meta" and torch.equal(to_host(x), wx)
        assert torch.equal(to_host(lg), wlg)
        assert s.candidates == ws.candidates == min(V, 64)
        for name in ("temperature", "top_k", "top_p", "seed", "frame"):
            assert torch.equal(to_host(getattr(s, name)), getattr(ws, name)), name
    assert want[1][2].frame.tolist() == [0, 1, 1] and want[1][2].seed[1].tolist() == [3, 2**8]
    assert torch.equal(to_host(dev.frames), host.frames) and torch.equal(to_host(dev.seen), host.seen)
