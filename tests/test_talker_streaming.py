"""The talker started from the first chunk of the thinker's reply.

Unit part (fast): the incremental prompt construction
(:class:`decoder_svc.qwen3_omni.prompt.TalkerPromptBuilder`) fed piece by
piece gives the same tensors, bit for bit, as the one-shot
``build_talker_prompt``, and both follow the one-shot construction's rules
(written out here independently, with row-wise projections).

Engine part (the real vLLM thinker and talker on the tiny Qwen3-Omni
checkpoint, stepped directly as the omni profile builds them): the talker
started from the thinker's first rows and fed chunk by chunk while the
thinker decodes produces the same codec codes as the talker started once the
thinker has finished; a request whose next step needs a row that has not
arrived is held (not stepped, ``has_unfinished`` False when all are held)
and resumes after ``extend_request``; a held request can be aborted.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from decoder_svc.qwen3_omni.prompt import TalkerIds, TalkerPromptBuilder, build_talker_prompt
from omni_common.errors import InvalidArgumentError

TH, H = 24, 16  # thinker / talker widths of the random tensors
IDS = TalkerIds(
    im_start=1, user=2, assistant=3, tts_pad=4, tts_bos=5, tts_eos=6, multimodal=frozenset({7}),
    codec_nothink=0, codec_think_bos=1, codec_think_eos=2, codec_pad=3, codec_bos=4,
)
END = 9
NL, SYS = 10, 11


def _parts(seed: int):
    g = torch.Generator().manual_seed(seed)
    fc1, fc2 = torch.nn.Linear(TH, 40), torch.nn.Linear(40, H)
    hid = torch.nn.Linear(TH, H)
    with torch.no_grad():
        for p in (*fc1.parameters(), *fc2.parameters(), *hid.parameters()):
            p.copy_(torch.randn(p.shape, generator=g))
    table = torch.randn(32, TH, generator=g)
    codec = torch.randn(8, H, generator=g)
    return dict(
        text_projection=lambda x: fc2(torch.nn.functional.silu(fc1(x))),
        hidden_projection=hid,
        codec_embedding=lambda i: codec[i],
        thinker_token_embed=lambda i: table[i],
    )


def _prompt_ids(rng: random.Random, mm: bool) -> list[int]:
    body = [rng.choice([12, 13, 14, 15] + ([7] if mm else [])) for _ in range(rng.randint(2, 9))]
    return [1, SYS, NL, 8, 1, 2, NL, *body, 8, NL, 1, 3, NL]


def _reply(rng: random.Random, n: int, end: str) -> list[int]:
    reply = [rng.randint(12, 30) for _ in range(n)]
    if end == "eot":
        reply[-1] = END
    elif end == "early":  # an end-of-turn before the reply's last token
        reply[rng.randint(1, n - 2)] = END
    return reply


def _one_shot_rules(prompt_ids, reply_ids, embed, hidden, *, speaker_id, text_projection, hidden_projection,
                    codec_embedding, thinker_token_embed, end_ids):
    """The one-shot construction's rules, written out row by row (valid for
    row-wise projections, whose rows do not depend on the others)."""
    seq, p = prompt_ids + reply_ids, len(prompt_ids)
    rows = len(seq) - 1
    proj = text_projection
    a = max(i for i in range(p - 1) if seq[i] == IDS.im_start and seq[i + 1] == IDS.assistant)
    user, role = [], None
    for i in range(p):
        if seq[i] == IDS.im_start:
            role = seq[i + 1]
        if role == IDS.user:
            user.append(i)
    user_rows = [hidden_projection(hidden[i]) if seq[i] in IDS.multimodal else proj(embed[i]) for i in user]
    bos, eos, pad = proj(thinker_token_embed(torch.tensor([IDS.tts_bos, IDS.tts_eos, IDS.tts_pad])))
    codec = codec_embedding(torch.tensor([IDS.codec_nothink, IDS.codec_think_bos, IDS.codec_think_eos, speaker_id,
                                          IDS.codec_pad, IDS.codec_bos]))
    text = [proj(embed[a]), proj(embed[a + 1]), proj(embed[a + 2]), pad, pad, pad, pad, bos, proj(embed[a + 3])]
    head = [t + (codec[i - 3] if i >= 3 else 0) for i, t in enumerate(text)]
    trailing = [proj(embed[i]) for i in range(a + 4, rows)] + [eos]
    first_end = next((j for j, t in enumerate(seq[p:]) if t in end_ids), len(reply_ids))
    if first_end < len(trailing):
        trailing = trailing[:first_end] + [eos] + [pad] * (len(trailing) - first_end - 1)
    return torch.stack(user_rows + head), torch.stack(trailing), pad


def _case(seed: int, n: int, end: str, mm: bool):
    rng = random.Random(seed)
    prompt = _prompt_ids(rng, mm)
    reply = _reply(rng, n, end)
    g = torch.Generator().manual_seed(seed)
    rows = len(prompt) + len(reply) - 1
    return prompt, reply, torch.randn(rows, TH, generator=g), torch.randn(rows, TH, generator=g)


def _feed(prompt, reply, embed, hidden, parts, cuts: list[int]):
    """Feed the builder in pieces: the head at ``cuts[0]`` reply tokens, then
    up to each next cut, then the rest with the end. Returns (prompt_embeds,
    trailing, rows handed out after each piece)."""
    b = TalkerPromptBuilder(IDS, prompt, speaker_id=3, end_ids=frozenset({END}), **parts)
    p = len(prompt)
    b.add(reply[: cuts[0]], embed[: p + cuts[0] - 1])
    head = b.head(hidden)
    out, seen = [b.take()], []
    seen.append(sum(t.shape[0] for t in out))
    for lo, hi in zip(cuts, cuts[1:] + [len(reply)], strict=True):
        b.add(reply[lo:hi], embed[p + lo - 1 : p + hi - 1], finished=hi == len(reply))
        out.append(b.take())
        seen.append(sum(t.shape[0] for t in out))
    assert b.complete and b.take().shape[0] == 0
    return head, torch.cat(out), seen, b.pad


@pytest.mark.parametrize("end", ["eot", "cut", "early"])
@pytest.mark.parametrize("mm", [False, True], ids=["text", "multimodal"])
def test_incremental_prompt_equals_one_shot(end, mm):
    parts = _parts(1)
    for seed in range(12):
        rng = random.Random(100 + seed)
        n = rng.randint(3, 45)  # across projection blocks
        prompt, reply, embed, hidden = _case(seed, n, end, mm)
        one = build_talker_prompt(IDS, prompt, reply, embed, hidden, speaker_id=3, end_ids=frozenset({END}), **parts)
        k = rng.randint(2, n - 1)
        cuts = sorted({k, *(rng.randint(k, n - 1) for _ in range(rng.randint(0, 6)))})
        head, trailing, seen, pad = _feed(prompt, reply, embed, hidden, parts, cuts)
        assert torch.equal(head, one.prompt_embeds), (seed, cuts)
        assert torch.equal(trailing, one.trailing), (seed, cuts)
        assert torch.equal(pad, one.pad)
        # nothing is handed out before it is known: a row needs its position
        # forwarded, and nothing after an end-of-turn before the end
        first_end = reply.index(END) if END in reply else n
        for c, got in zip(cuts, seen, strict=False):
            assert got == min(c - 2, first_end), (seed, cuts, seen)
        assert seen[-1] == one.trailing.shape[0]


@pytest.mark.parametrize("end", ["eot", "cut", "early"])
def test_one_shot_follows_the_rules(end):
    """Row-wise projections (no matrix product whose rounding depends on the
    number of rows): exactly the rules, fed at once and in pieces."""
    base = _parts(2)
    w = torch.randn(TH, H, generator=torch.Generator().manual_seed(5))
    parts = dict(base, text_projection=lambda x: torch.tanh(x[..., :H] * 1.5 + x[..., H:].sum(-1, keepdim=True)),
                 hidden_projection=lambda x: (x[..., :, None] * w).sum(-2))
    for seed in range(8):
        prompt, reply, embed, hidden = _case(seed, 5 + 4 * seed, end, True)
        want_head, want_trailing, want_pad = _one_shot_rules(prompt, reply, embed, hidden, speaker_id=3,
                                                             end_ids=frozenset({END}), **parts)
        one = build_talker_prompt(IDS, prompt, reply, embed, hidden, speaker_id=3, end_ids=frozenset({END}), **parts)
        assert torch.allclose(one.prompt_embeds, want_head, atol=1e-6, rtol=0)
        assert torch.equal(one.trailing, want_trailing)
        assert torch.equal(one.pad, want_pad)
        head, trailing, _, _ = _feed(prompt, reply, embed, hidden, parts, [2, 3, len(reply) // 2 + 1])
        assert torch.equal(head, one.prompt_embeds) and torch.equal(trailing, one.trailing)


def test_builder_refusals():
    parts = _parts(3)
    prompt, reply, embed, hidden = _case(0, 8, "cut", False)
    p = len(prompt)
    b = TalkerPromptBuilder(IDS, prompt, speaker_id=3, end_ids=frozenset({END}), **parts)
    b.add(reply[:1], embed[:p])
    with pytest.raises(InvalidArgumentError) as e:
        b.head(hidden)
    assert e.value.field == "conditioning.thinker_token_ids"
    b.add(reply[1:2], embed[p : p + 1])
    b.head(hidden)
    with pytest.raises(InvalidArgumentError) as e:  # rows out of step with the ids
        b.add(reply[2:4], embed[p + 1 : p + 2])
    assert e.value.field == "thinker_embed"
    with pytest.raises(InvalidArgumentError) as e:
        build_talker_prompt(IDS, prompt, reply[:1], embed[:p], hidden, speaker_id=3, **parts)
    assert e.value.field == "text"



def test_profile_input_chunk_keys(tmp_path):
    import yaml

    from decoder_svc.profile import PROFILE_DIR, load_profile

    omni = load_profile("omni")
    talker = omni.stage("talker")
    assert omni.streams_input(talker) and not omni.streams_input(omni.stage("thinker"))
    ramp, n = talker.input_chunk_ramp, talker.input_chunk_tokens
    ends = [talker.input_chunk_end(k) for k in range(len(ramp) + 3)]
    assert ends[: len(ramp)] == [sum(ramp[: k + 1]) for k in range(len(ramp))]
    assert [b - a for a, b in zip(ends[len(ramp) - 1 :], ends[len(ramp) :], strict=False)] == [n] * 3
    assert not load_profile("tts").streams_input(load_profile("tts").stage("talker"))

    raw = yaml.safe_load((PROFILE_DIR / "omni.yaml").read_text())

    def refused(stage_id: int, **keys):
        doc = yaml.safe_load(yaml.safe_dump(raw))
        doc["stages"][stage_id].update(keys)
        for k, v in keys.items():
            if v is None:
                del doc["stages"][stage_id][k]
        path = tmp_path / "p.yaml"
        path.write_text(yaml.safe_dump(doc))
        with pytest.raises(InvalidArgumentError) as e:
            load_profile(str(path))
        return e.value.field

    assert refused(1, input_chunk_ramp=[1, 4]) == "stages[1].input_chunk_ramp"
    assert refused(1, input_chunk_ramp=[]) == "stages[1].input_chunk_ramp"
    assert refused(1, input_chunk_ramp=[2, 0]) == "stages[1].input_chunk_ramp"
    assert refused(1, input_chunk_ramp="2") == "stages[1].input_chunk_ramp"
    assert refused(1, input_chunk_tokens=0) == "stages[1].input_chunk_tokens"
    assert refused(1, input_chunk_tokens=None) == "stages[1].input_chunk_tokens"
    assert refused(1, input_chunk_ramp=None) == "stages[1].input_chunk_ramp"
    assert refused(0, input_chunk_ramp=[2], input_chunk_tokens=4) == "stages[0].input_chunk_ramp"
    assert refused(2, input_chunk_ramp=[2], input_chunk_tokens=4) == "stages[2].input_chunk_ramp"
    doc = yaml.safe_load(yaml.safe_dump(raw))
    doc["async_chunk"] = False
    path = tmp_path / "off.yaml"
    path.write_text(yaml.safe_dump(doc))
    off = load_profile(str(path))
    assert off.stage("talker").input_chunk_ramp == ramp and not off.streams_input(off.stage("talker"))

# -- the real engines ------------------------------------------------------------------

TALKER_FRAMES = 40
RAMP, CHUNK = (2, 4), 8
# (request id, prompt, voice, thinker max_tokens, temperature, seed, forced end of turn after N tokens)
REQUESTS = [
    ("greedy-eot", "Hello world, this is a test.", "ethan", 24, 0.0, 0, 9),
    ("greedy-cut", "She sells sea shells by the sea shore.", "chelsie", 8, 0.0, 0, None),
    ("sampled-cut", "Good morning to everyone here!", "aiden", 13, 0.8, 7, None),
    ("sampled-eot", "Numbers: 1 2 3 and 42.", "ethan", 30, 0.8, 3, 6),
]


def _specs():
    from decoder_svc.backend import RequestSpec

    return [RequestSpec(request_id=rid, prompt=text, voice=voice, max_tokens=n, temperature=t, seed=seed)
            for rid, text, voice, n, t, seed, _ in REQUESTS]


@pytest.fixture(scope="module")
def omni(tiny_checkpoint):
    pytest.importorskip("vllm")
    from omni_common import torchvision_compat

    torchvision_compat.install()  # the torchvision shim, before transformers loads
    from decoder_svc.profile import load_profile
    from decoder_svc.qwen3_omni.engine import build_engine

    ckpt = tiny_checkpoint
    profile = load_profile("omni")
    engine = build_engine(profile, ckpt, max_num_seqs=8)
    thinker = engine.backends["thinker"]
    end = int(engine.checkpoint.config["im_end_token_id"])
    forced = {rid: n for rid, *_, n in REQUESTS if n is not None}
    orig = thinker._sampling_params

    def params(spec):  # a random-weight thinker never ends a turn by itself: make some do
        p = orig(spec)
        if spec.request_id in forced:
            p.min_tokens = forced[spec.request_id]
            p.logit_bias = {end: 1e4}
        return p

    thinker._sampling_params = params
    try:
        yield engine, profile.stage("talker")
    finally:
        engine.close()


def _take(out):
    """Per request of a thinker step: its rows, hidden rows and token."""
    embed, _ = out.mm_outputs["thinker_embed"]
    hidden, _ = out.mm_outputs["thinker_hidden"]
    return {rid: (embed[s:e].clone(), hidden[s:e].clone(), int(out.sampled_token_ids[i, 0]))
            for i, (rid, (s, e)) in enumerate(zip(out.request_ids, out.spans, strict=True))}


def _cond(parts):
    return {"thinker_embed": torch.cat([p[0] for p in parts]), "thinker_hidden": torch.cat([p[1] for p in parts]),
            "thinker_token_ids": torch.tensor([p[2] for p in parts], dtype=torch.int64)}


def _collect(out, codes, tick=None, first=None):
    if out is None:
        return
    c, _ = out.mm_outputs["codec_codes"]
    for i, rid in enumerate(out.request_ids):
        codes.setdefault(rid, []).append(c[i].clone())
        if first is not None:
            first.setdefault(rid, tick)


def _run_talker(talker, specs, codes=None):
    codes = {} if codes is None else codes
    for s in specs:
        talker.add_request(s)
    for _ in range(10_000):
        if not talker.has_unfinished():
            break
        _collect(talker.step(), codes)
    return {rid: torch.stack(v) for rid, v in codes.items()}


@pytest.fixture(scope="module")
def streamed(omni):
    """The thinker and the streaming talker stepped in turn, the talker fed
    as the omni profile's chunks say; then the one-shot talker on the same
    replies."""
    engine, stage = omni
    thinker, talker = engine.backends["thinker"], engine.backends["talker"]
    prepared = {s.request_id: engine.prepare(s) for s in _specs()}
    for s in prepared.values():
        thinker.add_request(s)
    steps: dict[str, list] = {rid: [] for rid in prepared}  # per thinker step: (rows, hidden, token)
    handed = dict.fromkeys(prepared, 0)  # thinker steps handed over
    chunk = dict.fromkeys(prepared, 0)  # handovers done
    codes: dict[str, list] = {}
    first_code: dict[str, int] = {}
    thinker_last: dict[str, int] = {}
    tick = 0
    for _ in range(10_000):
        if not (thinker.has_unfinished() or talker.has_unfinished()):
            break
        tick += 1
        out = thinker.step() if thinker.has_unfinished() else None
        for rid, part in (_take(out) if out is not None else {}).items():
            steps[rid].append(part)
            done = rid in out.finished
            if done:
                thinker_last[rid] = tick
            n = len(steps[rid])
            talk = dataclasses.replace(prepared[rid], max_tokens=TALKER_FRAMES)
            if chunk[rid] == 0 and n >= stage.input_chunk_end(0) and not done:
                talker.add_request(dataclasses.replace(talk, conditioning=_cond(steps[rid]), streaming=True))
            elif chunk[rid] == 0 and done:  # ended before the talker could start: one piece
                talker.add_request(dataclasses.replace(talk, conditioning=_cond(steps[rid])))
            elif chunk[rid] > 0 and (n >= stage.input_chunk_end(chunk[rid]) or done):
                talker.extend_request(rid, _cond(steps[rid][handed[rid]:]), finished=done)
            else:
                continue
            handed[rid], chunk[rid] = n, chunk[rid] + 1
        tick += 1
        if talker.has_unfinished():
            _collect(talker.step(), codes, tick, first_code)
    assert not thinker.has_unfinished() and not talker.has_unfinished()
    assert talker._model.slots.live() == [], "per-request talker state left behind"
    assert talker._builders == {} and talker._streaming == set()
    stream_codes = {rid: torch.stack(v) for rid, v in codes.items()}
    one_shot = _run_talker(talker, [dataclasses.replace(prepared[rid], conditioning=_cond(steps[rid]),
                                                        max_tokens=TALKER_FRAMES) for rid in prepared])
    return dict(steps=steps, prepared=prepared, stream=stream_codes, one_shot=one_shot, chunks=chunk,
                first_code=first_code, thinker_last=thinker_last)


def test_streamed_talker_codes_equal_the_one_shot_talker(omni, streamed):
    engine, _ = omni
    end = int(engine.checkpoint.config["im_end_token_id"])
    steps = streamed["steps"]
    replies = {rid: [p[2] for p in steps[rid]] for rid in steps}
    # the batch: replies of different lengths, ended by end of turn and cut by max_tokens
    for rid, _, _, n, _, _, forced in REQUESTS:
        if forced is None:
            assert len(replies[rid]) == n and end not in replies[rid], (rid, replies[rid])
        else:
            assert replies[rid][-1] == end and len(replies[rid]) == forced + 1, (rid, replies[rid])
        assert streamed["chunks"][rid] >= 3, f"{rid}: the talker got its input in fewer than 3 pieces"
    assert len({len(r) for r in replies.values()}) == len(replies)
    for rid in steps:
        got, want = streamed["stream"][rid], streamed["one_shot"][rid]
        assert want.shape[0] > len(replies[rid]), f"{rid}: the talker stopped before the text ran out"
        assert got.shape == want.shape and torch.equal(got, want), f"{rid}: streamed codes differ from one-shot"


def test_the_talker_starts_before_the_thinker_finishes(streamed):
    for rid in streamed["steps"]:
        assert streamed["first_code"][rid] < streamed["thinker_last"][rid], (
            rid, streamed["first_code"][rid], streamed["thinker_last"][rid])


def _step_until_idle(talker, codes, limit=500):
    n = 0
    while talker.has_unfinished():
        _collect(talker.step(), codes)
        n += 1
        assert n < limit, "the talker never went idle"
    return n


def test_a_request_waits_for_its_rows_and_resumes(omni, streamed):
    """Held while its next step's row is missing (others go on), resumed by
    extend_request; the codes are still the one-shot ones."""
    engine, _ = omni
    talker = engine.backends["talker"]
    steps, prepared = streamed["steps"], streamed["prepared"]
    rid, other = "greedy-eot", "greedy-cut"
    parts = steps[rid]
    spec = dataclasses.replace(prepared[rid], request_id="held", max_tokens=TALKER_FRAMES)
    talker.add_request(dataclasses.replace(spec, conditioning=_cond(parts[:2]), streaming=True))
    talker.add_request(dataclasses.replace(prepared[other], conditioning=_cond(steps[other]),
                                           max_tokens=TALKER_FRAMES))
    codes: dict[str, list] = {}
    _step_until_idle(talker, codes)  # the other request runs to its end meanwhile
    assert len(codes[other]) == streamed["one_shot"][other].shape[0]
    assert len(codes["held"]) == 1, "only the prompt's frame: the first decode step needs reply token 1's row"
    for _ in range(3):  # a held request is not stepped
        assert not talker.has_unfinished()
        assert talker.step() is None
    assert len(codes["held"]) == 1
    talker.extend_request("held", _cond(parts[2:5]), finished=False)  # rows of reply tokens 1..3
    assert talker.has_unfinished()
    _step_until_idle(talker, codes)
    assert len(codes["held"]) == 1 + 3
    talker.extend_request("held", _cond(parts[5:]), finished=True)
    _step_until_idle(talker, codes)
    got = torch.stack(codes["held"])
    assert torch.equal(got, streamed["one_shot"][rid]), "holding changed the codes"
    assert talker._model.slots.live() == []


def test_abort_a_held_request(omni, streamed):
    from omni_common.errors import FailedPreconditionError

    engine, _ = omni
    thinker, talker = engine.backends["thinker"], engine.backends["talker"]
    steps, prepared = streamed["steps"], streamed["prepared"]
    rid = "sampled-cut"
    spec = dataclasses.replace(prepared[rid], max_tokens=TALKER_FRAMES, conditioning=_cond(steps[rid][:3]),
                               streaming=True)
    talker.add_request(spec)
    codes: dict[str, list] = {}
    _step_until_idle(talker, codes)
    assert len(codes[rid]) == 2  # the prompt's frame and reply token 1's step
    assert talker.abort(rid)
    assert not talker.abort(rid)
    talker.extend_request(rid, _cond(steps[rid][3:]), finished=True)  # no longer running: ignored
    assert not talker.has_unfinished() and talker.step() is None
    assert talker._model.slots.live() == []
    assert talker._builders == {} and talker._streaming == set()
    assert talker._scheduler.get_num_unfinished_requests() == 0
    # the same id runs again, to the one-shot codes
    again = _run_talker(talker, [dataclasses.replace(spec, conditioning=_cond(steps[rid]), streaming=False)])
    assert torch.equal(again[rid], streamed["one_shot"][rid])
    # refusals: a stage that takes its input in one piece; a request started in one piece
    with pytest.raises(FailedPreconditionError):
        thinker.extend_request(rid, _cond(steps[rid]), finished=True)
    with pytest.raises(InvalidArgumentError) as e:
        thinker.add_request(dataclasses.replace(prepared[rid], streaming=True))
    assert e.value.field == "streaming"
    with pytest.raises(InvalidArgumentError) as e:  # a streaming start needs 2 reply tokens
        talker.add_request(dataclasses.replace(spec, conditioning=_cond(steps[rid][:1])))
    assert e.value.field == "conditioning.thinker_token_ids"
    talker.add_request(dataclasses.replace(spec, conditioning=_cond(steps[rid]), streaming=False))
    try:
        with pytest.raises(FailedPreconditionError):
            talker.extend_request(rid, _cond(steps[rid][:1]), finished=True)
    finally:
        assert talker.abort(rid)


def test_held_requests_filling_the_batch_leave_the_stage_idle(omni, streamed):
    """Every running request held and one more waiting for a batch slot: the
    stage sleeps (no spinning on empty steps) until input arrives, then all
    finish with the one-shot codes."""
    engine, _ = omni
    talker = engine.backends["talker"]
    steps, prepared = streamed["steps"], streamed["prepared"]
    rid = "greedy-eot"
    parts = steps[rid]
    cap = talker._scheduler.max_num_running_reqs
    ids = [f"full-{i}" for i in range(cap + 1)]
    for i in ids:
        talker.add_request(dataclasses.replace(prepared[rid], request_id=i, max_tokens=TALKER_FRAMES,
                                               conditioning=_cond(parts[:2]), streaming=True))
    codes: dict[str, list] = {}
    _step_until_idle(talker, codes)  # fails if the stage keeps reporting work it cannot do
    assert sorted(len(codes.get(i, [])) for i in ids) == [0] + [1] * cap, codes.keys()
    assert talker.step() is None and not talker.has_unfinished()
    for i in ids:
        talker.extend_request(i, _cond(parts[2:]), finished=True)
    assert talker.has_unfinished()
    _step_until_idle(talker, codes, limit=5000)
    for i in ids:
        assert torch.equal(torch.stack(codes[i]), streamed["one_shot"][rid]), i
