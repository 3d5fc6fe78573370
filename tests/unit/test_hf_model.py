"""The workers' decoder against transformers itself: for each supported architecture a random
checkpoint (written by transformers, sharded with an index), loaded by kvpager in float32 on the
CPU, runs a ragged prefill (one prompt in two chunks, the second step with a sequence that
computes nothing), then decode steps over a real paged cache in shuffled blocks; the logits of
each prompt's last token match transformers' forward within 1e-4 and the greedy tokens match
``generate(do_sample=False)``. Tensor parallelism (2 ranks over gloo, spawned processes) gives
the same logits and tokens. In float16 and bfloat16 the logits stay within a few unit
roundoffs of transformers' in the same dtype. RoPE settings give transformers' own frequencies.
Each refused configuration says what is refused."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
from dataclasses import replace

import pytest
import torch

from kvpager.checkpoints import build_random_checkpoint
from kvpager.step import StepInput
from kvpager.worker.hf_config import Llama3RopeScaling, ModelConfig, Rope, UnsupportedModel, config_from_hf
from kvpager.worker.kv_cache import CacheSpec, KVCache
from kvpager.worker.model import Decoder

# transformers is imported where it is used: the spawned tensor-parallel ranks import this module too.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")

BLOCK = 4
NUM_BLOCKS = 32
MAX_BLOCKS = 8                      # table width: 32 tokens per sequence
PROMPTS = ([5, 17, 42, 99, 3, 250, 7], [11, 12, 13, 200, 150, 9, 77, 31, 64, 8, 190, 4])
FIRST_CHUNK = 5                     # the second prompt is prefilled in two steps
NEW_TOKENS = 8
SHAPE = dict(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, vocab_size=301, intermediate_size=96)

CASES = {
    "llama-untied-biases": dict(model_type="llama", attention_bias=True, mlp_bias=True, max_shard_size="60KB"),
    "llama-tied-llama3-rope": dict(model_type="llama", tie_word_embeddings=True, rope_theta=500000.0,
                                   rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                     high_freq_factor=4.0, original_max_position_embeddings=64),
                                   max_position_embeddings=1024),
    "mistral-window-covers-context": dict(model_type="mistral", sliding_window=4096, max_position_embeddings=4096),
    "qwen2-qkv-biases": dict(model_type="qwen2"),
    "qwen3-qk-norm": dict(model_type="qwen3", head_dim=32),
    "llama-llama3-rope-top-level-original-max": dict(model_type="llama", max_position_embeddings=1024),
    # int(16 * 0.97) = 15: transformers' scaled RoPE types put 15, not head_dim, in the exponent.
    "llama-linear-rope-partial-rotary": dict(model_type="llama", rope_scaling=dict(rope_type="linear", factor=4.0),
                                             partial_rotary_factor=0.97),
    # Dynamic NTK within max_position_embeddings (64 > the 20 positions run); int(32 * 0.97) = 31.
    "qwen3-dynamic-rope-partial-rotary": dict(model_type="qwen3", head_dim=32, max_position_embeddings=64,
                                              rope_scaling=dict(rope_type="dynamic", factor=2.0,
                                                                partial_rotary_factor=0.97)),
}
# Hub-style config.json settings written over a case's (its rope_parameters dropped). Here the
# top-level original_max_position_embeddings (as some Llama 3 fine-tunes write it), which
# transformers puts over the one in rope_scaling when it builds the llama3 frequencies.
CONFIG_EDITS = {
    "llama-llama3-rope-top-level-original-max": dict(
        rope_theta=500000.0, original_max_position_embeddings=64,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=512)),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    paths = {name: build_random_checkpoint(root / name, **{**SHAPE, "seed": i, **case}, tokenizer=False)
             for i, (name, case) in enumerate(CASES.items())}
    for name, edits in CONFIG_EDITS.items():
        config = paths[name] / "config.json"
        written = json.loads(config.read_text())
        del written["rope_parameters"]
        config.write_text(json.dumps({**written, **edits}))
    return paths


# ---- driving the paged model like a scheduler -------------------------------------------------------
class PagedRun:
    """Sequences in shuffled blocks of a real KVCache; builds each step's StepInput."""

    def __init__(self, model: Decoder, num_seqs: int) -> None:
        cfg = model.cfg
        self.cache = KVCache(CacheSpec(cfg.num_layers, model.kv_heads, cfg.head_dim, BLOCK, cfg.cache_dtype),
                             NUM_BLOCKS, 1, model.device)
        free = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(1)).tolist()
        self.tables = [[free.pop() for _ in range(MAX_BLOCKS)] for _ in range(num_seqs)]
        self.lens = [0] * num_seqs
        self.model = model
        self.steps = 0

    def step(self, chunks: list[list[int]]) -> torch.Tensor | None:
        """chunks[i]: the tokens sequence i computes now (possibly none)."""
        tokens, positions, slots = [], [], []
        for i, chunk in enumerate(chunks):
            for t in chunk:
                tokens.append(t)
                positions.append(self.lens[i])
                slots.append(self.tables[i][self.lens[i] // BLOCK] * BLOCK + self.lens[i] % BLOCK)
                self.lens[i] += 1
        self.steps += 1
        step = StepInput(step_id=self.steps, plan_step_id=0, token_ids=tokens, positions=positions,
                         slot_mapping=slots, query_lens=[len(c) for c in chunks], context_lens=list(self.lens),
                         block_tables=[b for t in self.tables for b in t], max_blocks=MAX_BLOCKS)
        step.check()
        return self.model.forward_paged(step, self.cache.layer)


def paged_generate(model: Decoder, choose=lambda logits: logits.argmax(-1).tolist()):
    """Returns (last-token logits of each prompt after its prefill, greedy tokens per prompt).
    ``choose`` turns rank 0's logits (None elsewhere) into the tokens every rank feeds next."""
    a, b = PROMPTS
    run = PagedRun(model, 2)
    first = run.step([a, b[:FIRST_CHUNK]])                      # prompt a whole, b's first chunk
    assert first is None or first.shape == (2, model.cfg.vocab_size)
    second = run.step([[], b[FIRST_CHUNK:]])                     # a computes nothing: one row back
    assert second is None or second.shape == (1, model.cfg.vocab_size)
    prefill_logits = None if first is None else torch.stack([first[0], second[0]])
    tokens = [[t] for t in choose(prefill_logits)]
    for _ in range(NEW_TOKENS - 1):                              # pure decode steps
        logits = run.step([[seq[-1]] for seq in tokens])
        for seq, t in zip(tokens, choose(logits)):
            seq.append(t)
    return prefill_logits, tokens


def test_a_step_plans_its_prefill_attention_once_and_every_layer_runs_that_plan(monkeypatch):
    """Issue 12 (plan once per step, run per layer) for prefill and mixed steps: the model calls
    ``ops.plan_prefill`` once per step and each layer's attention runs that same plan; a pure
    decode step makes no prefill plan. On CPU the plan carries the step's lengths (the torch
    reference runs it)."""
    from kvpager.kernels import ops

    cfg = ModelConfig(num_layers=2, hidden_size=64, num_q_heads=4, num_kv_heads=2, head_dim=16,
                      intermediate_size=96, vocab_size=128, seed=5)
    model = Decoder(cfg)
    plans, runs = [], []
    plan_prefill, paged_prefill_run = ops.plan_prefill, ops.paged_prefill_run

    def counting_plan(*args, **kwargs):
        plans.append(plan_prefill(*args, **kwargs))
        return plans[-1]

    def counting_run(plan, *args, **kwargs):
        runs.append(plan)
        return paged_prefill_run(plan, *args, **kwargs)

    monkeypatch.setattr(ops, "plan_prefill", counting_plan)
    monkeypatch.setattr(ops, "paged_prefill_run", counting_run)
    run = PagedRun(model, 3)
    run.step([[1, 2, 3], [4, 5], [6]])             # prompts
    run.step([[7], [8, 9], []])                    # mixed: a decode, a chunk, a sequence computing nothing
    assert len(plans) == 2 and [id(p) for p in runs] == [id(plans[0])] * 2 + [id(plans[1])] * 2
    assert plans[1].starts == (0, 1, 3) and plans[1].context == (4, 4) and plans[1].reference
    run.step([[10], [11], [12]])                   # pure decode: the decode plan, no prefill plan
    assert len(plans) == 2 and len(runs) == 4


def hf_reference(path):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.generation_config.eos_token_id = None   # generate exactly NEW_TOKENS
    logits, tokens = [], []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            logits.append(hf(ids).logits[0, -1])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                              pad_token_id=0)
            tokens.append(out[0, len(prompt):].tolist())
    return torch.stack(logits), tokens


@pytest.mark.parametrize("case", CASES)
def test_paged_decoder_matches_transformers(checkpoints, case):
    path = checkpoints[case]
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.model_type == CASES[case]["model_type"] and cfg.dtype == "float32"
    model = Decoder(cfg)
    logits, tokens = paged_generate(model)
    want_logits, want_tokens = hf_reference(path)
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=0)
    assert tokens == want_tokens
    # The contiguous-cache oracle computes the same.
    past: list = []
    oracle = model.forward_contiguous(PROMPTS[0], 0, past)
    torch.testing.assert_close(oracle, want_logits[0], atol=1e-4, rtol=0)


def test_checkpoint_features_reach_the_config(checkpoints):
    cfgs = {case: ModelConfig.from_pretrained(path) for case, path in checkpoints.items()}
    assert cfgs["llama-untied-biases"].attention_bias and cfgs["llama-untied-biases"].o_proj_bias
    assert cfgs["llama-untied-biases"].mlp_bias and not cfgs["llama-untied-biases"].tie_word_embeddings
    assert len(list(checkpoints["llama-untied-biases"].glob("model-*.safetensors"))) > 3   # sharded, indexed
    tied = cfgs["llama-tied-llama3-rope"]
    assert tied.tie_word_embeddings and tied.rope == Rope(500000.0, Llama3RopeScaling(8.0, 1.0, 4.0, 64))
    assert cfgs["mistral-window-covers-context"].sliding_window == 4096
    assert cfgs["qwen2-qkv-biases"].attention_bias and not cfgs["qwen2-qkv-biases"].o_proj_bias
    qwen3 = cfgs["qwen3-qk-norm"]
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.num_q_heads * qwen3.head_dim == 2 * qwen3.hidden_size
    assert cfgs["llama-linear-rope-partial-rotary"].rope == Rope(10000.0, linear_factor=4.0, freq_dim=15)
    assert cfgs["qwen3-dynamic-rope-partial-rotary"].rope == Rope(10000.0, freq_dim=31)


def test_hub_style_rope_settings_read_like_transformers_5(checkpoints):
    """Hub checkpoints write rope_theta + rope_scaling (with "rope_type" or the older "type")."""
    written = json.loads((checkpoints["llama-tied-llama3-rope"] / "config.json").read_text())
    params = written.pop("rope_parameters")
    theta = params.pop("rope_theta")
    for key in ("rope_type", "type"):
        scaling = {(key if k == "rope_type" else k): v for k, v in params.items()}
        hub = {**written, "rope_theta": theta, "rope_scaling": scaling}
        assert config_from_hf(hub).rope == Rope(500000.0, Llama3RopeScaling(8.0, 1.0, 4.0, 64))
    assert config_from_hf({**written, "rope_theta": 1e6}).rope == Rope(1e6)


LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
# config.json RoPE settings, each read by kvpager as transformers' model reads them.
ROPE_SETTINGS = {
    # transformers puts a top-level original_max_position_embeddings over rope_scaling's own.
    "top-level original max": dict(rope_scaling=LLAMA3, original_max_position_embeddings=64),
    "top-level over rope_scaling's": dict(rope_scaling=dict(LLAMA3, original_max_position_embeddings=512),
                                          original_max_position_embeddings=64),
    "top-level over rope_parameters'": dict(rope_parameters=dict(LLAMA3, original_max_position_embeddings=512,
                                                                 rope_theta=5e5), original_max_position_embeddings=64),
    "max_position_embeddings": dict(rope_scaling=LLAMA3),
    # A rope_scaling replaces rope_parameters whole: its theta is the top level's, else 10000.
    "rope_scaling over rope_parameters": dict(rope_parameters=dict(rope_type="default", rope_theta=5e5),
                                              rope_scaling=dict(LLAMA3, original_max_position_embeddings=64)),
    "rope_scaling over rope_parameters, no top theta": dict(
        rope_theta=None, rope_parameters=dict(rope_type="default", rope_theta=5e5), rope_scaling={"type": "llama3",
                                                                                                   **LLAMA3}),
    "rope_parameters theta over the top level's": dict(rope_parameters=dict(rope_type="default", rope_theta=5e5)),
    "empty rope_scaling": dict(rope_scaling={}, rope_parameters=dict(LLAMA3, rope_theta=5e5)),
    "integral float original max": dict(rope_scaling=LLAMA3, original_max_position_embeddings=4096.0),
    "linear": dict(rope_scaling=dict(rope_type="linear", factor=4.0)),
    "linear, older type key, int factor": dict(rope_scaling=dict(type="linear", factor=3)),
    # Below max_position_embeddings dynamic NTK's frequencies are the default ones (its run-time
    # update starts past it, where kvpager serves nothing).
    "dynamic": dict(rope_parameters=dict(rope_type="dynamic", factor=1.7, rope_theta=5e5)),
    # Default RoPE ignores partial_rotary_factor; the scaled types put int(head_dim * factor) in the
    # exponent (7 of head dim 8 for llama, 127 of qwen3's 128), the dict's own over the top level's.
    "default, partial rotary": dict(partial_rotary_factor=0.5),
    "linear, partial rotary": dict(rope_scaling=dict(rope_type="linear", factor=4.0), partial_rotary_factor=0.995),
    "dynamic, partial rotary": dict(rope_parameters=dict(rope_type="dynamic", factor=1.7, rope_theta=5e5,
                                                         partial_rotary_factor=0.995), partial_rotary_factor=0.5),
    "llama3, partial rotary": dict(rope_scaling=dict(LLAMA3, partial_rotary_factor=0.995)),
}


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@pytest.mark.parametrize("setting", ROPE_SETTINGS)
def test_rope_frequencies_are_transformers_own(tmp_path, model_type, setting):
    import transformers

    config = {k: v for k, v in dict(LLAMA, model_type=model_type, **ROPE_SETTINGS[setting]).items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path))
    ours = config_from_hf(config)
    torch.testing.assert_close(ours.rope.inv_freq(ours.head_dim), hf.model.rotary_emb.inv_freq, atol=0, rtol=0)
    assert ours.rope.attention_scaling == hf.model.rotary_emb.attention_scaling


def test_rope_settings_transformers_cannot_build_are_refused():
    with pytest.raises(UnsupportedModel, match="original_max_position_embeddings None"):
        config_from_hf(dict(LLAMA, rope_scaling=LLAMA3, original_max_position_embeddings=None))
    with pytest.raises(UnsupportedModel, match="original_max_position_embeddings 'long'"):
        config_from_hf(dict(LLAMA, rope_scaling=dict(LLAMA3, original_max_position_embeddings="long")))
    with pytest.raises(UnsupportedModel, match="rope_theta None"):
        config_from_hf(dict(LLAMA, rope_theta=None))
    with pytest.raises(UnsupportedModel, match="llama3 rope scaling .* \\(numbers expected\\)"):
        config_from_hf(dict(LLAMA, rope_scaling=dict(LLAMA3, factor=None)))


def test_null_means_what_transformers_says():
    # qwen2's class default is 32 key/value heads; null means as many as the attention heads.
    qwen2 = config_from_hf(dict(LLAMA, model_type="qwen2", num_key_value_heads=None))
    assert qwen2.num_kv_heads == qwen2.num_q_heads == 8
    assert config_from_hf(dict(LLAMA, head_dim=None)).head_dim == 8
    # Typed fields of transformers' classes refuse null: so does kvpager (no class default guessed).
    for model_type, key in [("llama", "vocab_size"), ("mistral", "num_key_value_heads"), ("qwen2", "head_dim"),
                            ("qwen3", "head_dim"), ("qwen2", "max_window_layers"), ("llama", "attention_bias")]:
        with pytest.raises(UnsupportedModel, match=f"{key} None \\(a value expected"):
            config_from_hf(dict(LLAMA, model_type=model_type, **{key: None}))


def test_bfloat16_runs_close_to_float32(checkpoints):
    path = checkpoints["qwen3-qk-norm"]
    f32 = Decoder(ModelConfig.from_pretrained(path))
    bf16 = Decoder(ModelConfig.from_pretrained(path, dtype="bfloat16"))
    assert bf16.embed.dtype == torch.bfloat16
    a, _ = paged_generate(f32)
    b, _ = paged_generate(bf16)
    assert b.dtype == torch.float32 and float((a - b).norm() / a.norm()) < 0.05


# Unit roundoff (half the spacing of numbers near 1) of each 16-bit dtype: bf16 keeps 8
# significant bits, fp16 11.
UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
# Both models round to the dtype after every op, at different points (our residual add is fused
# with the next norm, our CPU attention accumulates in float32), so their logits differ by their
# two rounding errors. Transformers' own logits in the dtype lie 12-18 roundoffs (in units of
# the logits' std) from its float32 ones on these 3-layer models; ours measure 8-14 from its.
# A wrong rotation, bias or norm moves them by more than 100.
SAME_DTYPE_LOGIT_TOL = 32   # max |ours - transformers'| / std(logits), in unit roundoffs


def hf_greedy_with_margins(hf, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens (a full forward per step: no cache to round differently) and,
    per step, the top-2 logit margin in units of that step's logits' std."""
    ids, tokens, margins = list(prompt), [], []
    with torch.no_grad():
        for _ in range(steps):
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
            top2 = logits.topk(2).values
            margins.append(float((top2[0] - top2[1]) / logits.std()))
            tokens.append(int(logits.argmax()))
            ids.append(tokens[-1])
    return tokens, margins


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_models_agree_with_transformers_in_the_same_dtype(checkpoints, dtype):
    import transformers

    path = checkpoints["llama-tied-llama3-rope"]
    logits, tokens = paged_generate(Decoder(ModelConfig.from_pretrained(path, dtype=dtype)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    with torch.no_grad():
        want = torch.stack([hf(torch.tensor([p])).logits[0, -1].float() for p in PROMPTS])
    tol = SAME_DTYPE_LOGIT_TOL * UNIT_ROUNDOFF[dtype]
    assert float((logits - want).abs().max() / want.std()) <= tol
    # Where transformers' top-2 margin exceeds twice the tolerance no rounding can swap the two;
    # after the first closer call the sequences may part, so the comparison stops there.
    compared = 0
    for prompt, ours in zip(PROMPTS, tokens):
        theirs, margins = hf_greedy_with_margins(hf, prompt, len(ours))
        for mine, their, margin in zip(ours, theirs, margins):
            if margin <= 2 * tol:
                break
            assert mine == their
            compared += 1
    assert compared >= 3   # the test compares tokens, not only logits


def test_seeded_presets_use_the_same_loading_path():
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_q_heads=4, num_kv_heads=2, head_dim=8,
                      intermediate_size=64, vocab_size=256, seed=1)
    a, b = Decoder(cfg), Decoder(cfg)
    assert torch.equal(a.layers[1].qkv, b.layers[1].qkv)
    assert not torch.equal(Decoder(replace(cfg, seed=2)).layers[1].qkv, a.layers[1].qkv)
    logits, tokens = paged_generate(a)
    past: list = []
    torch.testing.assert_close(a.forward_contiguous(PROMPTS[0], 0, past), logits[0], atol=1e-5, rtol=0)


# ---- tensor parallelism: 2 ranks over gloo -----------------------------------------------------------
def _tp_rank(rank: int, port: int, path: str, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        model = Decoder(ModelConfig.from_pretrained(path), rank=rank, tp_size=2)

        def choose(logits):
            chosen = torch.zeros(2, dtype=torch.long) if logits is None else logits.argmax(-1)
            dist.broadcast(chosen, src=0)
            return chosen.tolist()

        logits, tokens = paged_generate(model, choose)
        assert (logits is None) == (rank != 0)
        if rank == 0:
            torch.save(dict(logits=logits, tokens=tokens, embed_rows=model.embed.shape[0]),
                       os.path.join(out_dir, "rank0.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tensor_parallel_ranks_match_one_rank(checkpoints, tmp_path):
    path = checkpoints["llama-untied-biases"]
    single_logits, single_tokens = paged_generate(Decoder(ModelConfig.from_pretrained(path)))
    torch.multiprocessing.start_processes(_tp_rank, args=(_free_port(), str(path), str(tmp_path)), nprocs=2,
                                          join=True, start_method="spawn")
    result = torch.load(tmp_path / "rank0.pt")
    assert result["embed_rows"] == 151          # vocabulary 301 over 2 ranks: the last slice padded
    torch.testing.assert_close(result["logits"], single_logits, atol=1e-4, rtol=0)
    assert result["tokens"] == single_tokens


# ---- refusals ------------------------------------------------------------------------------------------
LLAMA = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192, rope_theta=10000.0)


@pytest.mark.parametrize("config, words", [
    (dict(LLAMA, model_type="gpt2"), ["model_type 'gpt2'"]),
    (dict(LLAMA, model_type="llama4"), ["model_type 'llama4'"]),
    (dict(LLAMA, rope_scaling=dict(rope_type="yarn", factor=4.0)), ["rope_type 'yarn'"]),
    (dict(LLAMA, rope_scaling=dict(type="linear")), ["linear rope scaling without factor"]),
    (dict(LLAMA, rope_scaling=dict(type="linear", factor="2")), ["linear rope scaling factor '2'"]),
    (dict(LLAMA, rope_parameters=dict(rope_type="dynamic", factor=0, rope_theta=1e4)),
     ["dynamic rope scaling factor 0"]),
    (dict(LLAMA, rope_scaling=dict(rope_type="longrope", short_factor=[1.0], long_factor=[1.0])),
     ["rope_type 'longrope'"]),
    (dict(LLAMA, hidden_act="gelu"), ["hidden_act 'gelu'"]),
    (dict(LLAMA, rope_scaling=dict(type="linear", factor=2.0), partial_rotary_factor=0.5),
     ["partial_rotary_factor 0.5 with rope_type 'linear' (rotates 4 of 8 head dims"]),
    (dict(LLAMA, rope_scaling=dict(LLAMA3, partial_rotary_factor=1.5)), ["partial_rotary_factor 1.5"]),
    (dict(LLAMA, rope_scaling=dict(LLAMA3, partial_rotary_factor=None)), ["partial_rotary_factor None"]),
    (dict(LLAMA, rope_scaling=LLAMA3, original_max_position_embeddings=4096.5),
     ["original_max_position_embeddings 4096.5"]),
    (dict(LLAMA, quantization_config=dict(quant_method="awq")), ["quantized", "awq"]),
    (dict(LLAMA, architectures=["LlamaForSequenceClassification"]), ["LlamaForSequenceClassification"]),
    (dict(LLAMA, model_type="mistral", sliding_window=4096), ["sliding_window 4096", "8192"]),
    (dict(LLAMA, model_type="qwen2", use_sliding_window=True, sliding_window=1024, max_window_layers=0),
     ["sliding_window 1024"]),
    (dict(LLAMA, tie_word_embeddings="false"), ["tie_word_embeddings 'false' (true or false expected)"]),
    (dict(LLAMA, attention_bias=1), ["attention_bias 1"]),
    (dict(LLAMA, rms_norm_eps=None), ["rms_norm_eps None"]),
    *[(dict(LLAMA, model_type=model_type, **config), words) for model_type, config, words in [
        ("qwen2", dict(max_window_layers=1.0), ["max_window_layers 1.0"]),
        ("qwen3", dict(max_window_layers="28"), ["max_window_layers '28'"]),
        ("qwen2", dict(use_sliding_window="yes"), ["use_sliding_window 'yes'"]),
        ("qwen2", dict(layer_types=["full_attention"]), ["layer_types ['full_attention']", "num_hidden_layers 2"]),
        ("qwen3", dict(layer_types=[]), ["layer_types []"]),
        ("llama", dict(layer_types=["full_attention"] * 3), ["num_hidden_layers 2"]),
        ("qwen3", dict(layer_types=["chunked_attention", "full_attention"]), ["layer_types chunked_attention"]),
        ("qwen2", dict(layer_types=["sliding_attention", "full_attention"], sliding_window=16),
         ["use_sliding_window false"]),
        ("mistral", dict(layer_types=["full_attention"] * 2), ["mistral with layer_types"]),
        # Llama's mask has no window, but transformers' cache keeps only the window's last tokens.
        ("llama", dict(sliding_window=4096), ["sliding_window 4096 shorter than the served context of 8192"]),
        ("llama", dict(layer_types=["sliding_attention"] * 2), ["no sliding_window"]),
    ]],
])
def test_refused_configurations_say_what(config, words):
    with pytest.raises(UnsupportedModel) as err:
        config_from_hf(config)
    message = str(err.value)
    assert "\n" not in message and "llama, mistral, qwen2, qwen3" in message
    for word in words:
        assert word in message


def _transformers_model(tmp_path, config):
    """transformers' model of ``config`` after one forward; raises where transformers fails."""
    import transformers

    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path))
    with torch.no_grad():
        hf(torch.tensor([[1, 2, 3]]))
    return hf


@pytest.mark.parametrize("model_type, config", [
    ("qwen2", dict(max_window_layers=1.0)), ("qwen3", dict(max_window_layers="28")),
    ("qwen2", dict(use_sliding_window="yes")), ("qwen3", dict(layer_types=["full_attention"])),
    ("qwen2", dict(layer_types=[])), ("llama", dict(layer_types=["full_attention"] * 3)),
    ("qwen3", dict(layer_types=["chunked_attention", "full_attention"])),
    ("qwen2", dict(layer_types=["sliding_attention", "full_attention"], sliding_window=16)),
    ("llama", dict(layer_types=["sliding_attention"] * 2)),
])
def test_layer_settings_refused_are_ones_transformers_fails_on(tmp_path, model_type, config):
    config = dict(LLAMA, model_type=model_type, **config)
    with pytest.raises(UnsupportedModel):
        config_from_hf(config)
    with pytest.raises(Exception):
        _transformers_model(tmp_path, config)


@pytest.mark.parametrize("model_type, config, window", [
    ("qwen2", dict(layer_types=["attention", "full_attention"], use_sliding_window=True), None),   # older name
    ("qwen3", dict(layer_types=["full_attention", "sliding_attention"], use_sliding_window=True, sliding_window=8192),
     8192),
    ("qwen2", dict(max_window_layers=-1, use_sliding_window=True, sliding_window=8192), 8192),
    ("qwen3", dict(max_window_layers=2, use_sliding_window=True, sliding_window=16), None),
])
def test_layer_settings_give_transformers_windows(tmp_path, model_type, config, window):
    config = dict(LLAMA, model_type=model_type, **config)
    assert config_from_hf(config).sliding_window == window
    windows = {layer.self_attn.sliding_window for layer in _transformers_model(tmp_path, config).model.layers}
    assert max(windows - {None}, default=None) == window


def test_sliding_window_is_accepted_when_it_covers_the_served_context():
    mistral = dict(LLAMA, model_type="mistral", sliding_window=4096)
    assert config_from_hf(mistral, max_model_len=4096).sliding_window == 4096
    with pytest.raises(UnsupportedModel, match="sliding_window 4096 shorter than the served context of 4097"):
        config_from_hf(mistral, max_model_len=4097)
    # Qwen2 ignores its window unless use_sliding_window says otherwise.
    assert config_from_hf(dict(LLAMA, model_type="qwen2", sliding_window=1024)).sliding_window is None
    assert config_from_hf(dict(LLAMA, model_type="mistral", sliding_window=None)).sliding_window is None
    with pytest.raises(UnsupportedModel, match="max_model_len 9000 beyond the model's max_position_embeddings 8192"):
        config_from_hf(LLAMA, max_model_len=9000)


def test_heads_that_do_not_divide_over_the_ranks_are_refused():
    cfg = config_from_hf(LLAMA)
    cfg.check_tensor_parallel(2)
    with pytest.raises(UnsupportedModel, match="tensor_parallel_size 4 does not divide the 2 key/value heads"):
        cfg.check_tensor_parallel(4)
    with pytest.raises(UnsupportedModel, match="tensor_parallel_size 3 does not divide the 8 attention heads and "
                                               "2 key/value heads"):
        Decoder(cfg, rank=0, tp_size=3)


def test_from_pretrained_refuses_an_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(LLAMA, model_type="gpt_neox")))
    with pytest.raises(UnsupportedModel, match="model_type 'gpt_neox'"):
        ModelConfig.from_pretrained(tmp_path)
