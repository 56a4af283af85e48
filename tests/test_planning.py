"""KV arithmetic (gateway plan): reference values, rounding, sliding windows, sources."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from gateway.__main__ import main
from gateway.config import load_settings
from gateway.planner import modelshape
from gateway.planner.plan import build_report, render_report
from gateway.planner.planning import (
    ModelShape,
    bytes_per_token,
    kv_size,
    max_ctx_for_slots,
    max_slots_for_ctx,
    parse_bytes,
    row_bytes,
)

MIB = 1024**2
# Gemma 3 270M: 18 layers, 1 KV head of 256, every 6th layer global, window 512.
GEMMA = ModelShape(
    name="gemma3-like", n_head_kv=(1,) * 18, head_k=256, head_v=256,
    swa_layers=frozenset(i for i in range(18) if i % 6 < 5), n_swa=512, n_ctx_train=32768,
)


def test_reference_values() -> None:
    assert bytes_per_token(modelshape.from_dims(40, 8, 128)) == (163_840, 0)
    assert bytes_per_token(modelshape.from_dims(40, 8, 128), "q8_0", "q8_0") == (87_040, 0)
    shape36 = modelshape.from_dims(36, 8, 128)
    assert bytes_per_token(shape36) == (147_456, 0)
    total = kv_size(shape36, 8192, 1, unified=True).total_bytes
    assert total == 147_456 * 8192 and round(total / 1e9, 2) == 1.21


def test_q8_0_is_not_half_of_f16() -> None:
    assert row_bytes("q8_0", 1024) == 1088 and row_bytes("f16", 1024) == 2048
    for t, expect in [("f32", 4096), ("bf16", 2048), ("q4_0", 576), ("q4_1", 640),
                      ("iq4_nl", 576), ("q5_0", 704), ("q5_1", 768)]:
        assert row_bytes(t, 1024) == expect, t
    with pytest.raises(ValueError):
        row_bytes("q8_0", 100)
    with pytest.raises(ValueError):
        row_bytes("q3_k", 1024)


def test_context_rounding_to_256() -> None:
    kv = kv_size(modelshape.from_dims(1, 1, 32), 3000, 2, unified=False)
    assert (kv.n_ctx, kv.n_ctx_seq) == (3072, 1536)
    kv = kv_size(modelshape.from_dims(1, 1, 32), 1000, 1, unified=True)
    assert kv.n_ctx == 1024


@pytest.mark.parametrize("n_ctx,n_seq,unified,types,full_mib,swa_mib", [
    # The sizes llama-server printed (llama_kv_cache: size = …) for Gemma 3 270M here.
    (2048, 4, True, ("f16", "f16"), 6.00, 30.00),
    (6144, 3, False, ("f16", "f16"), 18.00, 45.00),
    (3000, 2, False, ("q8_0", "q8_0"), 4.78, 15.94),
])
def test_sliding_window_sizes_match_llama_server(
    n_ctx: int, n_seq: int, unified: bool, types: tuple[str, str], full_mib: float,
    swa_mib: float,
) -> None:
    kv = kv_size(GEMMA, n_ctx, n_seq, unified=unified, type_k=types[0], type_v=types[1])
    assert round(kv.full_bytes / MIB, 2) == full_mib
    assert round(kv.swa_bytes / MIB, 2) == swa_mib


def test_only_full_layers_grow_with_context() -> None:
    small = kv_size(GEMMA, 4096, 1, unified=True)
    big = kv_size(GEMMA, 32768, 1, unified=True)
    assert big.swa_bytes == small.swa_bytes  # capped at window + ubatch
    assert big.full_bytes == 8 * small.full_bytes


def test_options_fit_the_budget() -> None:
    shape = modelshape.from_dims(32, 8, 128)  # 128 KiB per token
    opt = max_ctx_for_slots(shape, 1024 * MIB, 4, unified=False)
    assert opt is not None and opt.ctx_per_slot == 2048 and opt.kv.total_bytes <= 1024 * MIB
    more = max_slots_for_ctx(shape, 1024 * MIB, 1024, unified=False)
    assert more is not None and more.slots == 8


def test_parse_bytes() -> None:
    assert parse_bytes("6GiB") == 6 * 1024**3
    assert parse_bytes("512 MiB") == 512 * MIB
    assert parse_bytes("8GB") == 8 * 10**9
    assert parse_bytes("1000") == 1000
    with pytest.raises(ValueError):
        parse_bytes("lots")


def test_report_launch_settings() -> None:
    r = build_report(modelshape.from_dims(40, 8, 128), type_k="q8_0", type_v="q8_0",
                     kv_budget=parse_bytes("6GiB"), parallel=4)
    assert r["kv_bytes_per_token"] == 87_040
    c = r["chosen"]
    assert c["slots"] == 4 and c["kv_bytes"] <= 6 * 1024**3
    launch = r["launch"]
    assert f"-c {c['n_ctx']} -np 4 --no-kv-unified -ctk q8_0 -ctv q8_0 -fa on" in launch["llama_server"]
    assert launch["ollama_env"]["OLLAMA_KV_CACHE_TYPE"] == "q8_0"
    assert launch["ollama_env"]["OLLAMA_CONTEXT_LENGTH"] == str(c["ctx_per_slot"])
    assert f"--max-model-len {c['ctx_per_slot']} --max-num-seqs 4" in launch["vllm"]
    assert "kv_unified = false" in launch["gateway"]
    for block in (launch["gateway"], launch["vllm_gateway"]):  # blocks the gateway accepts
        load_settings(backends=tomllib.loads(block)["backends"])
    assert 'kind = "vllm"' in launch["vllm_gateway"] and "slots = 4" in launch["vllm_gateway"]
    text = render_report(r)
    assert "87,040 bytes" in text and "[[backends]]" in text


def test_report_unified_pool_block() -> None:
    r = build_report(GEMMA, ctx=512, parallel=4, unified=True)
    assert r["chosen"]["n_ctx"] == 2048
    assert "pool_tokens = 2048" in r["launch"]["gateway"]
    assert "--kv-unified" in r["launch"]["llama_server"]


def test_unified_plan_offers_slots_capped_at_pool_over_slots() -> None:
    r = build_report(GEMMA, ctx=512, parallel=4, unified=True)
    capped = r["launch"]["llama_server_capped"]
    assert capped["llama_server"].endswith("-c 2048 -np 4 --kv-unified --kv-unified-per-slot 512")
    assert "ctx_per_slot = 512" in capped["gateway"] and "pool_tokens = 2048" in capped["gateway"]
    assert "--kv-unified-per-slot 512" in render_report(r)
    assert build_report(GEMMA, ctx=512, parallel=4)["launch"]["llama_server_capped"] is None
    assert build_report(GEMMA, ctx=512, parallel=1, unified=True)["launch"][
        "llama_server_capped"] is None


def test_report_memory_minus_weights_and_errors() -> None:
    shape = ModelShape("m", (8,) * 32, 128, 128, weights_bytes=4 * 1024**3)
    r = build_report(shape, memory=parse_bytes("5GiB"), parallel=1)
    assert r["kv_budget_bytes"] == 1024**3
    assert "--gpu-memory-utilization" in r["launch"]["vllm"]
    with pytest.raises(ValueError, match="weights alone"):
        build_report(shape, memory=parse_bytes("2GiB"), parallel=1)
    with pytest.raises(ValueError, match="kv-memory"):
        build_report(shape)


def test_hf_config(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({
        "model_type": "gemma3_text", "num_hidden_layers": 12, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "hidden_size": 640, "sliding_window": 512,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 5
        + ["full_attention"], "max_position_embeddings": 32768,
    }))
    shape = modelshape.from_hf_config(cfg)
    assert shape.n_layer == 12 and len(shape.swa_layers) == 10 and shape.n_swa == 512
    assert bytes_per_token(shape) == (2 * 1024, 10 * 1024)


def test_gguf_metadata_only(tmp_path: Path) -> None:
    from gguf import GGUFWriter

    path = tmp_path / "tiny.gguf"
    w = GGUFWriter(str(path), "gemma3")
    w.add_block_count(18)
    w.add_context_length(32768)
    w.add_embedding_length(640)
    w.add_head_count(4)
    w.add_head_count_kv(1)
    w.add_key_length(256)
    w.add_value_length(256)
    w.add_sliding_window(512)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    shape = modelshape.from_gguf(path)
    assert shape.n_layer == 18 and sorted(set(range(18)) - shape.swa_layers) == [5, 11, 17]
    assert bytes_per_token(shape) == (3072, 15360)


def test_plan_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--layers", "40", "--kv-heads", "8", "--head-dim", "128",
                 "--ctx", "8192", "--parallel", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_bytes_per_token"] == 163_840
    assert main(["plan", "--layers", "40"]) == 2
    assert "give --gguf" in capsys.readouterr().err


def test_ollama_line_is_per_slot_even_for_a_unified_plan() -> None:
    # Ollama launches llama-server with -c NumCtx*NumParallel -np NumParallel: 4 slots of
    # 8,192 each would be 4x the memory of a unified pool of 8,192 cells.
    r = build_report(GEMMA, ctx=2048, parallel=4, unified=True)
    assert r["chosen"]["n_ctx"] == 8192
    assert r["launch"]["ollama_env"] == {"OLLAMA_NUM_PARALLEL": "4",
                                         "OLLAMA_CONTEXT_LENGTH": "2048"}
    assert "own context" in r["launch"]["ollama_note"]
    per_slot = build_report(GEMMA, ctx=2048, parallel=4)
    assert per_slot["launch"]["ollama_env"]["OLLAMA_CONTEXT_LENGTH"] == "2048"
