"""Loading a checkpoint: every way a checkpoint directory can be wrong raises CheckpointError
naming the file or tensor, before any weight is read; tied embeddings need no lm_head; a
tensor-parallel rank reads only its slices (its peak host memory, measured in a subprocess,
stays near its shard's size, far below the checkpoint's)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvpager.checkpoints import build_random_checkpoint
from kvpager.worker import checkpoint
from kvpager.worker.checkpoint import CheckpointError
from kvpager.worker.hf_config import ModelConfig
from kvpager.worker.model import Decoder

pytestmark = pytest.mark.skipif(__import__("importlib").util.find_spec("transformers") is None,
                                reason="building checkpoints needs transformers")

SHAPE = dict(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, vocab_size=96, intermediate_size=64,
             tokenizer=False)
Q_PROJ = "model.layers.1.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {"single": build_random_checkpoint(root / "single", "llama", **SHAPE),
            "sharded": build_random_checkpoint(root / "sharded", "llama", **SHAPE, max_shard_size="20KB"),
            "tied": build_random_checkpoint(root / "tied", "llama", **SHAPE, tie_word_embeddings=True)}


@pytest.fixture
def copy(built, tmp_path):
    def make(kind: str) -> Path:
        return Path(shutil.copytree(built[kind], tmp_path / kind))
    return make


def rewrite(path: Path, change) -> None:
    """Apply ``change`` to the tensors of path/model.safetensors and write them back."""
    file = path / "model.safetensors"
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def load_error(path: Path) -> str:
    """The CheckpointError of loading ``path``, which both the config check and a rank raise."""
    with pytest.raises(CheckpointError) as early:
        ModelConfig.from_pretrained(path)
    message = str(early.value)
    assert "\n" not in message
    if (path / "config.json").is_file() and "config.json" not in message:
        cfg = ModelConfig.from_pretrained(path, check_weights=False)
        with pytest.raises(CheckpointError) as late:
            Decoder(cfg)
        assert str(late.value) == message
    return message


def test_good_checkpoints_load(built):
    for kind in ("single", "sharded", "tied"):
        model = Decoder(ModelConfig.from_pretrained(built[kind]))
        assert model.embed.shape == (96, 32)
    tied = Decoder(ModelConfig.from_pretrained(built["tied"]))
    assert tied.lm_head is tied.embed


def test_no_config_json(copy):
    path = copy("single")
    (path / "config.json").unlink()
    assert "config.json" in load_error(path) and str(path) in load_error(path)


def test_unreadable_config_json(copy):
    path = copy("single")
    (path / "config.json").write_text('{"model_type": "llama", ')
    assert "config.json: unreadable" in load_error(path)


def test_not_a_directory(tmp_path):
    assert "not a directory" in load_error(tmp_path / "nowhere")


def test_no_safetensors_files(copy):
    path = copy("single")
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    message = load_error(path)
    assert "no model.safetensors or model.safetensors.index.json" in message and "pytorch_model.bin" in message


def test_missing_tensor_is_named(copy):
    path = copy("single")
    rewrite(path, lambda t: t.pop(Q_PROJ))
    assert f"missing tensor {Q_PROJ}" in load_error(path)


def test_untied_checkpoint_needs_lm_head_and_tied_one_does_not(copy):
    path = copy("single")
    rewrite(path, lambda t: t.pop("lm_head.weight"))
    assert "missing tensor lm_head.weight" in load_error(path)
    tied = copy("tied")    # a tied checkpoint that still carries lm_head.weight loads
    rewrite(tied, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone()))
    assert Decoder(ModelConfig.from_pretrained(tied)).lm_head.shape == (96, 32)


def test_unexpected_tensors_are_named_and_rope_buffers_ignored(copy):
    path = copy("single")
    rewrite(path, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}))
    Decoder(ModelConfig.from_pretrained(path))
    rewrite(path, lambda t: t.update({"model.layers.0.mlp.extra_proj.weight": torch.ones(2, 2),
                                      "model.layers.1.self_attn.q_proj.weight_scale": torch.ones(1)}))
    message = load_error(path)
    assert "unexpected tensor(s)" in message and "model.layers.0.mlp.extra_proj.weight" in message
    assert "model.layers.1.self_attn.q_proj.weight_scale" in message


def test_mis_shaped_tensor_says_expected_and_found(copy):
    path = copy("single")
    rewrite(path, lambda t: t.update({Q_PROJ: torch.zeros(32, 48)}))
    assert f"tensor {Q_PROJ} in model.safetensors: expected shape [32, 32], found [32, 48]" in load_error(path)


def test_integer_tensor_is_refused(copy):
    path = copy("single")
    rewrite(path, lambda t: t.update({Q_PROJ: torch.zeros(32, 32, dtype=torch.int8)}))
    assert f"tensor {Q_PROJ} in model.safetensors: dtype I8" in load_error(path)


def test_truncated_file_is_named(copy):
    path = copy("single")
    file = path / "model.safetensors"
    os.truncate(file, file.stat().st_size // 2)
    message = load_error(path)
    assert str(file) in message and "not a readable safetensors file" in message


def test_garbage_file_is_named(copy):
    path = copy("sharded")
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.write_bytes(b"\xff" * 64)
    assert f"{shard}: not a readable safetensors file" in load_error(path)


def test_index_naming_a_missing_shard(copy):
    path = copy("sharded")
    shard = sorted(path.glob("model-*.safetensors"))[2]
    shard.unlink()
    assert f"names shard {shard.name}, which is not in {path}" in load_error(path)


def test_index_putting_a_tensor_in_the_wrong_shard(copy):
    path = copy("sharded")
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != index["weight_map"][Q_PROJ])
    index["weight_map"][Q_PROJ] = other
    index_file.write_text(json.dumps(index))
    assert f"tensor {Q_PROJ}: model.safetensors.index.json puts it in {other}, which does not hold it" \
        in load_error(path)


def test_unreadable_index(copy):
    path = copy("sharded")
    (path / "model.safetensors.index.json").write_text("[]")
    assert "model.safetensors.index.json: unreadable index" in load_error(path)


def test_shards_are_slices_of_the_full_tensors(built):
    cfg = ModelConfig.from_pretrained(built["sharded"])
    full = checkpoint.load_shard(cfg)
    ranks = [checkpoint.load_shard(cfg, rank, 2) for rank in range(2)]
    assert torch.equal(torch.cat([r[Q_PROJ] for r in ranks]), full[Q_PROJ])
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(torch.cat([r[o_proj] for r in ranks], dim=1), full[o_proj])
    assert ranks[0][Q_PROJ].shape == (16, 32) and ranks[1]["lm_head.weight"].shape == (48, 32)
    assert torch.equal(ranks[1]["model.norm.weight"], full["model.norm.weight"])


# ---- memory ---------------------------------------------------------------------------------------------
MEASURE = textwrap.dedent("""
    import gc, json, sys
    from kvpager.worker import checkpoint
    from kvpager.worker.hf_config import ModelConfig

    def peak_and_rss_kib():
        fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
        return int(fields["VmHWM"].split()[0]), int(fields["VmRSS"].split()[0])

    results = {}
    for dtype in ("float32", "bfloat16"):
        cfg = ModelConfig.from_pretrained(sys.argv[1], dtype=dtype)
        gc.collect()
        open("/proc/self/clear_refs", "w").write("5")       # peak RSS := current RSS
        _, before = peak_and_rss_kib()
        shard = checkpoint.load_shard(cfg, rank=0, tp_size=2)
        peak, _ = peak_and_rss_kib()
        results[dtype] = dict(growth=(peak - before) * 1024, shard=sum(t.nbytes for t in shard.values()))
        del shard
    print(json.dumps(results))
""")


def test_a_rank_reads_only_its_shard(tmp_path):
    """Measurement, printed (pytest -s): rank 0 of 2 loading a ~300 MB float32 checkpoint (4
    shards) into float32 and into bfloat16; the bound checked is on bytes, not time."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc to reset the peak RSS")
    path = build_random_checkpoint(tmp_path / "moderate", "llama", num_layers=4, hidden_size=768, num_heads=12,
                                   num_kv_heads=4, vocab_size=32000, intermediate_size=2048, max_shard_size="100MB",
                                   stream=True, tokenizer=False)
    assert json.loads((path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]  # as unstreamed
    files = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    out = subprocess.run([sys.executable, "-c", MEASURE, str(path)], capture_output=True, text=True, check=True,
                         timeout=120)
    for dtype, m in json.loads(out.stdout).items():
        print(f"\n{dtype}: checkpoint files {files / 2**20:.0f} MiB, rank-0 shard {m['shard'] / 2**20:.0f} MiB, "
              f"peak RSS growth while loading {m['growth'] / 2**20:.0f} MiB "
              f"({m['growth'] / m['shard']:.2f}x the shard)")
        assert m["growth"] < files * 0.75    # never the whole checkpoint
