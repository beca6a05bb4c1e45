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


class _Reference:
    """The per-row reference: each request's settings, text rows and the
    residual sums of its frames in Python lists, read row by row."""

    def __init__(self) -> None:
        self.states: dict[str, TalkerRequestState] = {}
        self.frames: dict[str, list[torch.Tensor]] = {}
        self.seen: dict[str, set[int]] = {}

    def inputs(self, embeds, positions, rows):
        out = embeds.clone()
        for r, rid in enumerate(rows):
            st = self.states.get(rid)
            if st is None:
                continue
            k = int(positions[r]) - st.prompt_len
            if k < 0 or k >= len(self.frames[rid]):
                continue
            text = st.trailing[k] if k < st.trailing.shape[0] else st.pad
            out[r] = embeds[r] + (self.frames[rid][k] + text)
        return out

    def penalize(self, logits, rows):
        out = logits.clone()
        for r, rid in enumerate(rows):
            st, seen = self.states.get(rid), sorted(self.seen.get(rid, ()))
            if st is None or not seen:
                continue
            x, p = out[r, seen], st.repetition_penalty
            out[r, seen] = torch.where(x < 0, x * p, x / p)
        return out


def test_the_step_equals_the_per_row_reference_over_steps_and_a_recompute():
    gen = torch.Generator().manual_seed(1)
    slots = TalkerSlots(H, V, capacity=2, pool_rows=4)  # small: grows while adding
    ref = _Reference()
    prompts = {"a": (3, 5, 1.3), "b": (2, 1, 1.0), "c": (4, 3, 2.0), "d": (1, 2, 1.1)}
    start = {"a": 0, "b": 0, "c": 2, "d": 3}  # the step each request is added at
    computed: dict[str, int] = {}  # tokens in KV per request in the batch
    slot_of: dict[str, int] = {}
    for step in range(9):
        count: dict[str, int] = {}
        for rid, at in start.items():
            if at == step:
                p, n_text, penalty = prompts[rid]
                ref.states[rid] = _state(p, n_text, penalty=penalty, gen=gen)
                ref.frames[rid], ref.seen[rid], computed[rid] = [], set(), 0
                slot_of[rid] = slots.add(rid, ref.states[rid])
                count[rid] = p  # its prefill
        if step == 5:
            # "b" ended but is still in this step's batch; "a" was preempted
            # and is recomputed: its prompt and every decoded token in one step
            slots.remove("b")
            ref.states.pop("b")
            count["a"], computed["a"] = computed["a"], 0
        if step == 6:
            computed.pop("b")
        ids = list(computed)
        counts = [count.get(rid, 1) for rid in ids]
        qsl = [0]
        for c in counts:
            qsl.append(qsl[-1] + c)
        positions = torch.cat([torch.arange(computed[r], computed[r] + c) for r, c in zip(ids, counts, strict=True)])
        rows = [r for r, c in zip(ids, counts, strict=True) for _ in range(c)]
        slots.prepare(ids, qsl, [computed[r] for r in ids])
        embeds = torch.randn(qsl[-1] + 2, H, generator=gen)  # two padding rows
        got = slots.step_inputs(embeds, torch.cat((positions, torch.zeros(2, dtype=torch.int64))))
        assert torch.equal(got, ref.inputs(embeds, positions, rows + [None, None])), f"step {step}"
        assert step != 5 or not torch.equal(got[:counts[0]], embeds[:counts[0]]), "the recompute reads its frames"
        logits = torch.randn(len(ids), V, generator=gen) * 3
        assert torch.equal(slots.penalize(logits), ref.penalize(logits, ids)), f"step {step}"
        slot, sampling = slots.frame_rows(ids, V)
        assert sampling.frame.tolist() == [len(ref.frames.get(r, ())) if r in ref.states else 0 for r in ids]
        code0 = torch.randint(0, V, (len(ids),), generator=gen)
        embed_sum = torch.randn(len(ids), H, generator=gen)
        slots.record(slot, torch.tensor([r in ref.states for r in ids]), code0, embed_sum)
        for i, (rid, c) in enumerate(zip(ids, counts, strict=True)):
            if rid in ref.states:
                ref.frames[rid].append(embed_sum[i])
                ref.seen[rid].add(int(code0[i]))
            computed[rid] += c
    assert sorted(slots.live()) == ["a", "c", "d"]
    assert [len(ref.frames[r]) for r in "acd"] == [9, 7, 6]
    for rid in "acd":  # every frame's residual sum is kept where the forward reads it
        for f, want in enumerate(ref.frames[rid]):
            assert torch.equal(slots.frame_residual(slot_of[rid], f), want), (rid, f)


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
            slots.prepare([], [0], [])  # a step: the queued writes are applied
            for rid, parts in given.items():
                s = taken[rid]
                want = torch.cat(parts)
                off, n = int(slots.text.off[s]), int(slots.text_len[s])
                assert n == want.shape[0], f"{rid}: {n} rows, want {want.shape[0]}"
                assert torch.equal(slots.text.data[off : off + n], want), f"{rid}: text rows differ"
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
    slots.prepare([], [0], [])
    assert slots.add("u", _state(1, 1, gen=gen)) == slot


def _run_step(slots: TalkerSlots, embeds, positions, logits, embed_sum, ok, code0):
    ids = ["a", "b", "c"]
    slots.prepare(ids, [0, 3, 4, 5], [0, 1, 2])
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


def test_frames_past_a_regions_room_move_it_with_its_rows():
    gen = torch.Generator().manual_seed(4)
    slots = TalkerSlots(H, V, capacity=2, pool_rows=8)
    ids = ["p", "q", "r"]
    prompt = {"p": 2, "q": 5, "r": 3}
    taken = {rid: slots.add(rid, _state(prompt[rid], 4, gen=gen)) for rid in ids}
    kept: dict[str, list[torch.Tensor]] = {rid: [] for rid in ids}
    computed = dict.fromkeys(ids, 0)
    for step in range(80):
        if step == 30:  # one ends midway: its regions are reclaimed when the pool compacts
            slots.remove("r")
            ids.remove("r")
        counts = [prompt[rid] if computed[rid] == 0 else 1 for rid in ids]
        qsl = [0] + [sum(counts[: i + 1]) for i in range(len(ids))]
        slots.prepare(ids, qsl, [computed[rid] for rid in ids])
        slot, _ = slots.frame_rows(ids, V)
        embed_sum = torch.randn(len(ids), H, generator=gen)
        slots.record(slot, torch.ones(len(ids), dtype=torch.bool), torch.zeros(len(ids), dtype=torch.long),
                     embed_sum)
        for i, rid in enumerate(ids):
            kept[rid].append(embed_sum[i])
            computed[rid] += counts[i]
    for rid in ("p", "q"):
        assert int(slots.frames[taken[rid]]) == 80
        assert int(slots.residual.cap[taken[rid]]) >= 80
        for f, want in enumerate(kept[rid]):
            assert torch.equal(slots.frame_residual(taken[rid], f), want), (rid, f)
