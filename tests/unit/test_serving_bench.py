"""benchmarks/serving.py: its pure parts (workload, model sizes, latency figures, transformers'
attention names) and a CPU smoke run of the whole script in a child process, as a user runs it:
``--model tiny --requests 8`` through kvpager (one in-process worker) and transformers'
continuous batching, checking the table and the JSON. The same run through a Ray worker and
one child process per system (the script's default, as on the GPU) is marked slow."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serving.py"
METRICS = ("output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


def load_script():
    spec = importlib.util.spec_from_file_location("serving_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def serving():
    return load_script()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """One random tiny checkpoint for both smoke runs (the first builds it)."""
    return tmp_path_factory.mktemp("serving-models")


def test_workload_is_seeded_and_within_its_ranges(serving):
    args = dict(count=200, seed=3, vocab_size=1000, prompt_len=(128, 2048), output_len=(128, 512),
                system_prompts=8, system_len=(256, 1024), shared_fraction=0.7, rate=None)
    a, info = serving.make_workload(**args)
    b, _ = serving.make_workload(**args)
    assert a == b
    assert all(128 <= len(p) <= 2048 for p in a.prompts)
    assert all(128 <= o <= 512 for o in a.output_lens)
    assert all(0 <= t < 1000 for p in a.prompts for t in p)
    assert a.arrivals == [0.0] * 200
    assert 0.6 < info["with_system_prompt"] / 200 < 0.8
    timed, _ = serving.make_workload(**{**args, "rate": 10.0})
    assert timed.prompts == a.prompts                    # the rate changes arrivals only
    assert timed.arrivals == sorted(timed.arrivals) and 5 < timed.arrivals[-1] < 40


def test_model_facts_give_the_llama_sizes(serving):
    def facts(name):
        m = serving.MODELS[name]
        return serving.ModelFacts.from_config(dict(
            hidden_size=m["hidden_size"], num_hidden_layers=m["num_layers"], num_attention_heads=m["num_heads"],
            num_key_value_heads=m["num_kv_heads"], head_dim=m["head_dim"], intermediate_size=m["intermediate_size"],
            vocab_size=m["vocab_size"], tie_word_embeddings=m["tie_word_embeddings"]))

    one, eight = facts("1b"), facts("8b")
    assert one.param_count == 1_235_814_400          # Llama-3.2-1B
    assert eight.param_count == 8_030_261_248        # Llama-3.1-8B
    assert one.decode_read_params == one.param_count  # tied: lm_head is the embedding, read in full
    assert eight.decode_read_params == eight.param_count - 128256 * 4096  # untied: embedding rows only
    assert one.kv_bytes_per_token(2) == 16 * 2 * 8 * 64 * 2
    assert eight.kv_bytes_per_token(2) == 32 * 2 * 8 * 128 * 2


def test_latency_summary(serving):
    arrivals = {"a": 0.0, "b": 1.0}
    times = {"a": [0.5, 0.6, 0.8], "b": [1.1, 1.2]}
    s = serving.latency_summary(arrivals, times, {"a": 3, "b": 3})
    assert s["output_tokens"] == 5 and s["requests_complete"] == 1 and s["duration_s"] == pytest.approx(1.2)
    assert s["output_tokens_per_s"] == pytest.approx(5 / 1.2)
    # kvpager.numeric.percentile interpolates: TTFTs 0.1 and 0.5 s, gaps 0.1, 0.1 and 0.2 s.
    assert s["ttft_p50_ms"] == pytest.approx(300) and s["ttft_p99_ms"] == pytest.approx(496)
    assert s["itl_p50_ms"] == pytest.approx(100) and s["itl_p99_ms"] == pytest.approx(198)


def test_transformers_attention_names(serving):
    new = {"page_size", "auto_switch_to_flash"}       # transformers >= 5.23
    old = {"block_size"}                               # 5.17: the paged| prefix
    assert serving._impl_name("sdpa", new) == "sdpa"
    assert serving._impl_name("sdpa", old) == "paged|sdpa"
    assert serving._impl_name("flash_attention_2", old) == "paged|flash_attention_2"
    assert serving._impl_name("eager", new) == "paged|eager"
    assert serving._impl_name("paged|sdpa", new) == "paged|sdpa"


def test_help():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert "--model" in out.stdout and "--rate" in out.stdout and "--json" in out.stdout


def run_smoke(tmp_path: Path, models: Path, *extra: str) -> tuple[str, dict]:
    pytest.importorskip("transformers")
    out_json = tmp_path / "serving.json"
    cmd = [sys.executable, str(SCRIPT), "--model", "tiny", "--requests", "8", "--device", "cpu",
           "--workdir", str(models), "--roofline-min-batch", "1", "--json", str(out_json), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout, json.loads(out_json.read_text())


def check_report(stdout: str, summary: dict) -> None:
    assert "| output tokens/s" in stdout and "| TTFT p99 (ms)" in stdout and "| ITL p50 (ms)" in stdout
    assert "kvpager / transformers" in stdout
    assert "where the scheduler's iterations go" in stdout and "of roofline" in stdout
    expected = summary["workload"]["output_tokens"]
    for side in ("kvpager", "transformers"):
        result = summary["systems"][side]
        assert not result.get("error"), result.get("error")
        lat = result["latency"]
        assert lat["requests_complete"] == 8 and lat["output_tokens"] == expected
        for key in METRICS:
            assert lat[key] > 0, (side, key)
    for key in METRICS:
        assert summary["ratio_kvpager_over_transformers"][key] > 0
    kv = summary["systems"]["kvpager"]
    budget = summary["kv_budget"]
    assert kv["num_gpu_blocks"] * 16 == budget["tokens"] == kv["kv_cache_bytes"] // budget["bytes_per_token"]
    hf = summary["systems"]["transformers"]
    if hf.get("kv_cache"):      # continuous batching ran (else the plain-generate fallback, noted)
        assert hf["kv_cache"]["tokens"] == budget["tokens"]
    else:
        assert "note" in hf
    bd = kv["breakdown"]["all"]
    assert bd["iterations"] > 0
    assert bd["step_rpc_share"] + bd["runner_share"] + bd["python_share"] == pytest.approx(1)
    roof = kv["decode_roofline"]
    assert roof["steps"] > 0 and 0 < roof["runner_fraction"] and roof["copy_ceiling_GBps"] > 0
    assert summary["agreement"]["requests"] == 8
    assert summary["agreement"]["first_token"] >= 0.75    # float32 on both sides


def test_smoke_cpu(tmp_path, models):
    """One process, kvpager's worker in it (no Ray): about 15-25 s here."""
    stdout, summary = run_smoke(tmp_path, models, "--in-process", "--no-ray", "--warmup-requests", "2")
    check_report(stdout, summary)
    assert summary["systems"]["kvpager"]["workers"] == "1 in-process worker"


@pytest.mark.slow
def test_smoke_cpu_ray_and_child_processes(tmp_path, models):
    """The script's default path: each system in its own child process, kvpager on a Ray worker
    (about 40 s here, most of it starting Ray); Poisson arrivals."""
    stdout, summary = run_smoke(tmp_path, models, "--rate", "40", "--worker-metrics")
    check_report(stdout, summary)
    # The worker's own timeline of its steps (busy, and idle between them) joined by step id.
    device = summary["systems"]["kvpager"]["breakdown"]["device"]
    assert device["steps"] > 0 and device["busy_s"] > 0 and 0 < device["idle_share"] < 1
    assert "rank 0's device" in stdout and summary["systems"]["kvpager"]["decode_roofline"]["device_fraction"] > 0
    assert "Ray" in summary["systems"]["kvpager"]["workers"]
    assert summary["workload"]["rate_per_s"] == 40
    scheduler = summary["systems"]["kvpager"]["scheduler"]
    assert scheduler["fed_steps"] > 0   # greedy on one Ray rank: tokens fed back on the worker
