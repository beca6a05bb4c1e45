"""Derived checkpoint views (decoder_svc/qwen3_omni/views.py) under any shard split.

The same tiny checkpoint is written in four layouts: one file; a shard per
stage (thinker / talker / code2wav); five shards cut in name order, as
released checkpoints ship (some shards hold no talker tensor); a shard per
tensor. The talker's view of each is built and checked, vLLM's own index
filter accepts it, ``models check`` passes it, and the talker's vLLM engine
loads it and produces the same codes as from the single file.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from decoder_svc.qwen3_omni.checkpoint import CheckpointError, OmniCheckpoint
from decoder_svc.qwen3_omni.views import TALKER_PREFIX, TALKER_VIEW, check_view, talker_view
from tests.fs_helpers import tree_snapshot

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
LAYOUTS = ("single", "per-stage", "five", "per-tensor")


def _shard_of(layout: str, names: list[str]) -> dict[str, int]:
    if layout == "per-stage":
        stages = ("thinker.", "talker.", "code2wav.")
        return {n: next(i for i, s in enumerate(stages) if n.startswith(s)) for n in names}
    if layout == "five":  # contiguous runs in name order: code2wav, talker, thinker
        return {n: i * 5 // len(names) for i, n in enumerate(names)}
    if layout == "per-tensor":
        return {n: i for i, n in enumerate(names)}
    raise ValueError(layout)


def _reshard(src: Path, dst: Path, layout: str) -> Path:
    """A copy of `src` with its tensors split into shards by `layout`, and an index."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(SINGLE, INDEX))
    with safe_open(str(src / SINGLE), framework="pt") as f:
        names = sorted(f.keys())
        shard_of = _shard_of(layout, names)
        count = max(shard_of.values()) + 1
        files = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        parts: list[dict[str, torch.Tensor]] = [{} for _ in range(count)]
        for n in names:
            parts[shard_of[n]][n] = f.get_tensor(n)
    for name, tensors in zip(files, parts, strict=True):
        save_file(tensors, str(dst / name), metadata={"format": "pt"})
    weight_map = {n: files[shard_of[n]] for n in names}
    total = sum((dst / name).stat().st_size for name in files)
    (dst / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return dst


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from decoder_svc.qwen3_omni.tiny import create_tiny_checkpoint

    return create_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)


@pytest.fixture(scope="module")
def layouts(tiny, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("layouts")
    out = {"single": tiny}
    for layout in LAYOUTS[1:]:
        out[layout] = _reshard(tiny, root / layout, layout)
    return out


@pytest.fixture(autouse=True)
def model_cache(tmp_path_factory, monkeypatch) -> Path:
    root = tmp_path_factory.getbasetemp() / "model-cache"
    monkeypatch.setenv("OMNI_SERVING_MODEL_DIR", str(root))
    return root


def _talker_shards(ckpt: OmniCheckpoint) -> set[str]:
    return {f for t, f in ckpt.weight_map.items() if t.startswith(TALKER_PREFIX)}


def test_the_layouts_are_what_they_claim(layouts):
    five = OmniCheckpoint.open(layouts["five"])
    assert len(set(five.weight_map.values())) == 5
    assert 1 < len(_talker_shards(five)) < 5, "five shards: the talker's tensors span some shards, not all"
    stage = OmniCheckpoint.open(layouts["per-stage"])
    assert len(_talker_shards(stage)) == 1
    per = OmniCheckpoint.open(layouts["per-tensor"])
    assert len(set(per.weight_map.values())) == len(per.weight_map)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_talker_view_agrees_with_the_checkpoint(layouts, layout):
    path = layouts[layout]
    before = tree_snapshot(path)
    ckpt = OmniCheckpoint.open(path)
    view = talker_view(ckpt)
    check_view(view, ckpt, TALKER_PREFIX)
    want = {t: f for t, f in ckpt.weight_map.items() if t.startswith(TALKER_PREFIX)}
    index = json.loads((view.path / INDEX).read_text())["weight_map"]
    assert index == want
    assert set(view.shards) == set(want.values()) == {p.name for p in view.path.glob("*.safetensors")}
    for shard in view.shards:
        assert (view.path / shard).resolve() == (path / shard).resolve()
    # vLLM's own check of a directory's index against its files
    vllm_utils = pytest.importorskip("vllm.model_executor.model_loader.weight_utils")
    files = [str(p) for p in view.path.glob("*.safetensors")]
    kept = vllm_utils.filter_duplicate_safetensors_files(files, str(view.path), INDEX)
    assert sorted(kept) == sorted(files)
    assert talker_view(ckpt) == view, "building it again gives the same view"
    assert tree_snapshot(path) == before, "the model directory was written"


def test_view_of_an_older_layout_is_rebuilt_without_touching_the_checkpoint(layouts):
    """A view left by an earlier build (the checkpoint's index linked in, a
    link to a shard it no longer needs) is rebuilt consistent; writing the new
    index replaces the link, never writes through it."""
    path = layouts["five"]
    before = tree_snapshot(path)
    ckpt = OmniCheckpoint.open(path)
    view = talker_view(ckpt)
    (view.path / INDEX).unlink()
    (view.path / INDEX).symlink_to(path / INDEX)
    unneeded = sorted(set(ckpt.weight_map.values()) - set(view.shards))[0]
    (view.path / unneeded).symlink_to(path / unneeded)
    # the failure vLLM raised on such a view: its index names shards it does not link
    with pytest.raises(CheckpointError, match="missing from the view"):
        check_view(view, ckpt, TALKER_PREFIX)
    rebuilt = talker_view(ckpt)
    check_view(rebuilt, ckpt, TALKER_PREFIX)
    assert not (view.path / INDEX).is_symlink() and not (view.path / unneeded).exists()
    assert tree_snapshot(path) == before


def test_check_view_names_a_missing_shard(layouts):
    ckpt = OmniCheckpoint.open(layouts["per-stage"])
    view = talker_view(ckpt)
    (view.path / view.shards[0]).unlink()
    with pytest.raises(CheckpointError) as err:
        check_view(view, ckpt, TALKER_PREFIX)
    assert err.value.key == view.shards[0] and "missing from the view" in str(err.value)
    view = talker_view(ckpt)  # rebuilt
    index = json.loads((view.path / INDEX).read_text())
    dropped = sorted(index["weight_map"])[0]
    del index["weight_map"][dropped]
    (view.path / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="disagrees") as err:
        check_view(view, ckpt, TALKER_PREFIX)
    assert err.value.key == dropped


@pytest.mark.parametrize("layout", LAYOUTS)
def test_models_check_builds_the_view_the_decoder_loads(layouts, layout, model_cache, capsys):
    from omni_cli.main import main

    assert main(["models", "check", str(layouts[layout])]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("talker view:"))
    ckpt = OmniCheckpoint.open(layouts[layout])
    assert str(model_cache / "derived" / ckpt.fingerprint() / TALKER_VIEW) in line
    assert f"({len(_talker_shards(ckpt))} shards," in line


def test_models_check_reports_a_model_cache_it_cannot_write(layouts, tmp_path, monkeypatch, capsys):
    from omni_cli.main import main

    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    monkeypatch.setenv("OMNI_SERVING_MODEL_DIR", str(blocked))
    assert main(["models", "check", str(layouts["single"])]) == 1
    assert "model cache" in capsys.readouterr().err


@pytest.mark.vllm
def test_talker_engine_loads_every_layout_with_the_same_codes(layouts):
    """The talker's vLLM engine starts on each layout's view and speaks the
    same codes as from the single file (greedy and seeded sampling)."""
    pytest.importorskip("vllm")
    from decoder_svc.backend import RequestSpec
    from decoder_svc.profile import load_profile
    from decoder_svc.qwen3_omni.engine import build_engine

    def codes(path: Path) -> dict[str, torch.Tensor]:
        engine = build_engine(load_profile("tts"), path, max_num_seqs=4)
        talker = engine.backends["talker"]
        out: dict[str, list[torch.Tensor]] = {"greedy": [], "seeded": []}
        try:
            talker.add_request(engine.prepare(RequestSpec(request_id="greedy", prompt="Hello there.",
                                                          max_tokens=6, temperature=0.0, voice="chelsie")))
            talker.add_request(engine.prepare(RequestSpec(request_id="seeded", prompt="A second voice.",
                                                          max_tokens=6, temperature=0.8, seed=7, voice="ethan")))
            while talker.has_unfinished():
                step = talker.step()
                if step is None:
                    continue
                c, _ = step.mm_outputs["codec_codes"]
                for i, rid in enumerate(step.request_ids):
                    out[rid].append(c[i])
        finally:
            engine.close()
        return {rid: torch.stack(v) for rid, v in out.items()}

    want = codes(layouts["single"])
    assert all(len(v) > 0 for v in want.values())
    for layout in ("five", "per-tensor"):
        got = codes(layouts[layout])
        for rid in want:
            assert torch.equal(got[rid], want[rid]), f"{layout}: request {rid} speaks other codes"


def test_view_module_never_writes_the_model_dir_even_when_the_cache_is_inside(layouts, monkeypatch):
    path = layouts["per-stage"]
    before = tree_snapshot(path)
    monkeypatch.setenv("OMNI_SERVING_MODEL_DIR", os.fspath(path / "cache"))
    with pytest.raises(CheckpointError):
        talker_view(OmniCheckpoint.open(path))
    assert tree_snapshot(path) == before
