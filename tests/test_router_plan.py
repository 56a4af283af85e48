"""``gateway plan`` for a llama-server router (gateway/planner/routerplan.py): the models
a --models-dir lists, each model's memory, and --models-max of them at once. The KV
bytes are checked against the real router's children in
tests/integration/test_router_real.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.__main__ import main
from gateway.planner.routerplan import (
    ModelMemory,
    model_memory,
    models_in_dir,
    render_router_plan,
    router_plan,
)

MIB = 2**20


def test_a_models_dir_is_read_as_llama_server_reads_it(tmp_path: Path) -> None:
    # common/preset.cpp load_from_models_dir: top-level files by stem, subdirectories by
    # name (first shard if split, mmproj as projector), companions never models.
    for name in ("alpha.gguf", "mmproj-alpha.gguf", "mtp-alpha.gguf", "notes.txt"):
        (tmp_path / name).write_bytes(b"")
    big = tmp_path / "big"
    big.mkdir()
    for name in ("big-00001-of-00002.gguf", "big-00002-of-00002.gguf", "big-mmproj.gguf"):
        (big / name).write_bytes(b"")
    (tmp_path / "empty").mkdir()
    (big / "mtp-big.gguf").write_bytes(b"")
    assert models_in_dir(tmp_path) == [
        ("alpha", ("--model", str(tmp_path / "alpha.gguf"))),
        ("big", ("--model", str(big / "big-00001-of-00002.gguf"),
                 "--mmproj", str(big / "big-mmproj.gguf"),
                 "--spec-draft-model", str(big / "mtp-big.gguf"))),
    ]
    with pytest.raises(ValueError):
        models_in_dir(tmp_path / "alpha.gguf")


def test_a_model_that_cannot_be_read_here_is_named_not_guessed(tmp_path: Path) -> None:
    row = model_memory("x", ("--model", str(tmp_path / "absent.gguf"), "-c", "2048"))
    assert row.total_bytes is None and "cannot be read" in (row.problem or "")
    row = model_memory("hf", ("--hf-repo", "org/model", "-c", "2048"))
    assert row.gguf is None and "--model" in (row.problem or "")


def _row(model_id: str, kv_mib: int, weights_mib: int) -> ModelMemory:
    return ModelMemory(model_id, f"/m/{model_id}.gguf", slots=4, ctx_per_slot=4096,
                       n_ctx=4096, unified=True, kv_bytes=kv_mib * MIB,
                       weights_bytes=weights_mib * MIB)


def test_models_max_counts_the_largest_models_at_once() -> None:
    rows = [_row("small", 100, 400), _row("large", 1000, 4000), _row("mid", 500, 2000),
            ModelMemory("remote", None, problem="no GGUF")]
    plan = router_plan(rows, 2, memory=7000 * MIB)
    assert plan["resident"] == ["large", "mid"]
    assert plan["resident_bytes"] == 7500 * MIB
    assert plan["fits"] is False and plan["models_max_that_fits"] == 1
    assert plan["unknown"] == ["remote"]
    assert router_plan(rows, 0)["resident_bytes"] == 8000 * MIB  # unlimited: all at once
    assert router_plan(rows, 3, memory=8000 * MIB)["models_max_that_fits"] == 3
    text = render_router_plan(router_plan(rows, 2, memory=400 * MIB))
    assert "does NOT fit" in text and "not even the largest model fits alone" in text
    assert "remote" in text and "not planned" in text


def test_the_cli_plans_a_models_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                    ) -> None:
    (tmp_path / "broken.gguf").write_bytes(b"not a gguf")
    assert main(["plan", "--models-dir", str(tmp_path), "-c", "2048", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["models_max"] == 4  # llama-server's default --models-max
    assert [m["id"] for m in plan["models"]] == ["broken"]
    assert plan["unknown"] == ["broken"] and plan["resident"] == []
    assert main(["plan", "--models-dir", str(tmp_path / "nowhere")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_a_router_that_refuses_the_key_says_so() -> None:
    import httpx

    from gateway.planner.routerplan import models_of_router

    refusing = httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(
        401, json={"error": {"message": "Invalid API Key"}})))
    with pytest.raises(ValueError, match="--api-key"):
        models_of_router("http://router:8080", client=refusing)
    single = httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(
        200, json={"total_slots": 4} if r.url.path == "/props" else {"data": []})))
    with pytest.raises(ValueError, match="not a llama-server router"):
        models_of_router("http://server:8080", client=single)


def test_a_split_model_weighs_all_its_shards(tmp_path: Path) -> None:
    # Found by an adversarial pass: only the first shard was counted.
    from gateway.planner.routerplan import gguf_bytes

    for k, size in ((1, 100), (2, 5000), (3, 70)):
        (tmp_path / f"m-0000{k}-of-00003.gguf").write_bytes(b"x" * size)
    (tmp_path / "m-00001-of-00002.gguf").write_bytes(b"x" * 9)  # another split: not it
    assert gguf_bytes(str(tmp_path / "m-00001-of-00003.gguf")) == 5170
    (tmp_path / "one.gguf").write_bytes(b"x" * 42)
    assert gguf_bytes(str(tmp_path / "one.gguf")) == 42
