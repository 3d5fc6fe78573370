"""`kvpager generate`: text in, text out, over a Hugging Face checkpoint, checked against
transformers on the same files (greedy ids, chat template, stop at EOS), plus seeded sampling,
streaming, and one-line refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvpager.commands import cli  # noqa: E402
from kvpager.checkpoints import build_random_checkpoint  # noqa: E402
from kvpager.tokenizer import Tokenizer  # noqa: E402

SHAPE = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, vocab_size=320, intermediate_size=128)
PROMPTS = ["The cache holds", "Les blocs sont partagés", "キャッシュ"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_random_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=5, **SHAPE)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return build_random_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=6, head_dim=32, **SHAPE)


def generate(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(["generate", *args])
    out, err = capsys.readouterr()
    return code, out, err


def hf_greedy(path, prompt_ids: list[int], max_new_tokens: int, eos: list[int]) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def completion_text(tokenizer: Tokenizer, prompt: list[int], generated: list[int], chat: bool) -> str:
    """A chat reply decodes alone; a plain completion continues the prompt's text (a leading
    space included)."""
    if chat:
        return tokenizer.decode(generated)
    return tokenizer.decode(prompt + generated)[len(tokenizer.decode(prompt)):]


@pytest.mark.parametrize("chat", [False, True])
def test_json_output_equals_transformers_greedy(capsys, qwen3, chat):
    tokenizer = Tokenizer.from_pretrained(qwen3)
    flags = ["--chat"] if chat else []
    code, out, err = generate(capsys, "--model", str(qwen3), "--no-ray", "--json", "--max-new-tokens", "12", *flags,
                              *PROMPTS)
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [(r["prompt"], r["prompt_index"], r["sample"]) for r in lines] == [(p, i, 0) for i, p in enumerate(PROMPTS)]
    eos = sorted(tokenizer.eos_token_ids)
    for record in lines:
        text = record["prompt"]
        ids = tokenizer.apply_chat_template(text) if chat else tokenizer.encode(text)
        assert record["token_ids"] == hf_greedy(qwen3, ids, 12, eos)
        assert record["text"] == completion_text(tokenizer, ids, record["token_ids"], chat)
        stopped = record["token_ids"][-1] in eos
        assert record["finish_reason"] == ("stop" if stopped else "length")
        assert stopped or len(record["token_ids"]) == 12


def test_streamed_text_is_the_decoded_completion(capsys, llama):
    tokenizer = Tokenizer.from_pretrained(llama)
    code, out, err = generate(capsys, "--model", str(llama), "--no-ray", "--max-new-tokens", "16", PROMPTS[1])
    assert code == 0, err
    ids = hf_greedy(llama, tokenizer.encode(PROMPTS[1]), 16, sorted(tokenizer.eos_token_ids))
    assert out == completion_text(tokenizer, tokenizer.encode(PROMPTS[1]), ids, chat=False) + "\n"


def test_seeded_sampling_repeats_and_forks_n_samples(capsys, llama):
    args = ["--model", str(llama), "--no-ray", "--json", "--max-new-tokens", "10", "--temperature", "1.0",
            "--top-p", "0.95", "--top-k", "50", "--n", "3"]
    first = generate(capsys, *args, "--seed", "7", PROMPTS[0])
    again = generate(capsys, *args, "--seed", "7", PROMPTS[0])
    other = generate(capsys, *args, "--seed", "8", PROMPTS[0])
    assert first[0] == again[0] == other[0] == 0, first[2]
    assert first[1] == again[1], "the same seed must give the same samples"
    samples = [json.loads(line) for line in first[1].splitlines()]
    assert [s["sample"] for s in samples] == [0, 1, 2]
    assert len({tuple(s["token_ids"]) for s in samples}) > 1, "the n samples should differ"
    assert first[1] != other[1]


def test_tensor_parallel_ray_run_gives_the_same_tokens(llama):
    pytest.importorskip("ray")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def run(*extra: str) -> list[dict]:
        proc = subprocess.run([sys.executable, "-m", "kvpager", "generate", "--model", str(llama), "--json",
                               "--max-new-tokens", "8", *extra, *PROMPTS], capture_output=True, text=True,
                              timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return [json.loads(line) for line in proc.stdout.splitlines()]

    assert run("--tensor-parallel-size", "2") == run("--no-ray")


def test_unsupported_models_end_with_one_line(capsys, tmp_path, llama):
    config = json.loads((llama / "config.json").read_text())
    bad = tmp_path / "gpt2"
    bad.mkdir()
    for f in llama.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    code, out, err = generate(capsys, "--model", str(bad), "--no-ray", "hi")
    assert code == 1 and not out
    assert err.count("\n") == 1 and "gpt2" in err and "llama, mistral, qwen2, qwen3" in err, err
    code, out, err = generate(capsys, "--model", str(tmp_path / "missing"), "--no-ray", "hi")
    assert code == 1 and err.count("\n") == 1 and "missing" in err, err


def test_prompt_longer_than_the_context_is_refused(capsys, llama):
    code, out, err = generate(capsys, "--model", str(llama), "--no-ray", "--max-model-len", "8", "--max-new-tokens",
                              "4", "a long prompt that does not fit")
    assert code == 2 and "exceed the model's context of 8 tokens" in err, err


@pytest.mark.parametrize("blocks", ["1", "3"])
def test_a_pool_too_small_for_a_completion_is_refused_in_one_line(capsys, llama, blocks):
    # 12 prompt tokens and 40 new ones need 4 blocks of 16; 1 or 3 blocks (block 0 reserved) never
    # hold them: refused before anything starts, naming the flags (not a registration RpcError or
    # the scheduler's "no progress").
    prompt = "hello there my friend, how are you doing today"
    code, out, err = generate(capsys, "--model", str(llama), "--no-ray", "--max-new-tokens", "40",
                              "--num-gpu-blocks", blocks, prompt)
    assert code == 2 and not out, err
    assert err.count("\n") == 1 and "--num-gpu-blocks" in err and "--max-new-tokens 40" in err, err
