"""Proof against transformers: kvpager serving a Hugging Face checkpoint generates, token for
token, what transformers' own ``generate(do_sample=False)`` generates from the same files.

Tiny random checkpoints of every supported architecture are built with transformers' config
classes and saved with ``save_pretrained`` (one sharded into several safetensors files with an
index); kvpager loads them through its own loader, in process and as two tensor-parallel Ray
ranks, and serves a greedy request mix with shared prompt prefixes (prefix-cache hits), parallel
samples (forks, copy-on-write) and a GPU pool small enough to force swap preemption. The
manager's invariants hold afterwards and nothing is left allocated.
"""

from __future__ import annotations

import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvpager.checkpoints import build_random_checkpoint  # noqa: E402
from kvpager.embedded import embedded  # noqa: E402
from kvpager.scheduler import Request, SamplingParams, Scheduler  # noqa: E402
from kvpager.tokenizer import Tokenizer  # noqa: E402
from kvpager.worker.model import ModelConfig  # noqa: E402

BLOCK = 4
GPU_BLOCKS = 40  # a few requests at a time: the mix must preempt by swap
SHAPE = dict(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, vocab_size=320, intermediate_size=128)
ARCHITECTURES = {
    "llama": dict(model_type="llama", tie_word_embeddings=False),
    "llama3-tied": dict(model_type="llama", tie_word_embeddings=True,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mistral": dict(model_type="mistral", sliding_window=None),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", head_dim=32),
    "llama-sharded": dict(model_type="llama", max_shard_size="40KB"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    built = {}
    for name, options in ARCHITECTURES.items():
        options = dict(options)
        built[name] = build_random_checkpoint(tmp_path_factory.mktemp(name), options.pop("model_type"), seed=11,
                                              **SHAPE, **options)
    return built


def requests_for(tokenizer: Tokenizer, vocab_size: int, seed: int = 0) -> list[Request]:
    """Text prompts (tokenized by the checkpoint's tokenizer) sharing system prefixes, and some
    raw-id prompts; n of 1 to 3; EOS ends a sample as in transformers."""
    rng = random.Random(seed)
    systems = ["You are a helpful assistant. Answer briefly: ", "Réponds en français, s'il te plaît — ",
               "日本語で答えてください。"]
    texts = ["What is paging?", "Why share blocks?", "Combien de blocs?", "猫は好きですか？", "emoji 🙂 test",
             "a b c d e f g"]
    stop = tuple(sorted(tokenizer.eos_token_ids))
    requests = []
    for i in range(14):
        if i % 4 == 3:
            prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(3, 20))]
        else:
            prompt = tokenizer.encode(rng.choice(systems) + rng.choice(texts))
        params = SamplingParams(max_new_tokens=rng.randint(4, 12), n=rng.choice([1, 1, 2, 3]), stop_token_ids=stop)
        requests.append(Request(f"req{i}", prompt, params))
    return requests


def transformers_greedy(path, requests: list[Request]) -> dict[str, list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    out = {}
    for request in requests:
        ids = torch.tensor([request.prompt])
        with torch.inference_mode():
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                       max_new_tokens=request.params.max_new_tokens,
                                       eos_token_id=list(request.params.stop_token_ids) or None,
                                       pad_token_id=0)
        out[request.request_id] = generated[0, ids.shape[1]:].tolist()
    return out


def serve(system, requests: list[Request], waves: int = 2):
    """Serve the requests in ``waves`` (later waves hit the prefix cache of earlier ones)."""
    scheduler = Scheduler(system.client, system.runner, block_size=BLOCK)
    per_wave = -(-len(requests) // waves)
    for start in range(0, len(requests), per_wave):
        scheduler.run(requests[start:start + per_wave])
    return scheduler


def check(system, scheduler, requests, expected) -> None:
    for request in requests:
        samples = scheduler.outputs[request.request_id].samples
        assert samples == [expected[request.request_id]] * request.params.n, request.request_id
    system.check_invariants()
    stats = system.client.get_stats()
    assert stats.running_sequences == stats.swapped_sequences == stats.gpu.used_blocks == 0
    assert stats.prefix_hit_tokens > 0, "the request mix should hit the prefix cache"
    assert stats.cow_copies > 0, "forks should have copied a shared block on write"
    assert scheduler.stats.preemptions > 0, "the small pool should have forced a swap"


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_in_process_worker_matches_transformers(checkpoints, name):
    path = checkpoints[name]
    tokenizer = Tokenizer.from_pretrained(path)
    model = ModelConfig.from_pretrained(path, dtype="float32")
    requests = requests_for(tokenizer, model.vocab_size, seed=len(name))
    expected = transformers_greedy(path, requests)
    with embedded(model, block_size=BLOCK, use_ray=False, num_gpu_blocks=GPU_BLOCKS, num_cpu_blocks=128,
                  watermark=0.0, device="cpu") as system:
        scheduler = serve(system, requests)
        check(system, scheduler, requests, expected)


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    from kvpager.worker.ray_group import init_local_ray

    init_local_ray(num_cpus=4)
    yield
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama3-tied", "qwen2", "qwen3", "llama-sharded"])
def test_ray_tensor_parallel_matches_transformers(checkpoints, local_ray, name):
    path = checkpoints[name]
    tokenizer = Tokenizer.from_pretrained(path)
    model = ModelConfig.from_pretrained(path, dtype="float32")
    requests = requests_for(tokenizer, model.vocab_size, seed=100 + len(name))
    expected = transformers_greedy(path, requests)
    with embedded(model, block_size=BLOCK, tensor_parallel_size=2, num_gpu_blocks=GPU_BLOCKS, num_cpu_blocks=128,
                  watermark=0.0, device="cpu") as system:
        scheduler = serve(system, requests)
        check(system, scheduler, requests, expected)


def test_generation_stops_at_eos(checkpoints):
    """A stop token ends a sample where transformers' generate ends it: forcing EOS to be the
    greedy token (the token the model emits first) must end every sample after one token."""
    path = checkpoints["llama"]
    tokenizer = Tokenizer.from_pretrained(path)
    model = ModelConfig.from_pretrained(path, dtype="float32")
    prompt = tokenizer.encode("What is paging?")
    first = transformers_greedy(path, [Request("probe", prompt, SamplingParams(max_new_tokens=1))])["probe"][0]
    request = Request("r", prompt, SamplingParams(max_new_tokens=8, n=2, stop_token_ids=(first,)))
    with embedded(model, block_size=BLOCK, use_ray=False, num_gpu_blocks=32, device="cpu") as system:
        scheduler = Scheduler(system.client, system.runner, block_size=BLOCK)
        outputs = scheduler.run([request])
    assert outputs["r"].samples == [[first], [first]]
    assert outputs["r"].finish_reasons == ["stop", "stop"]

