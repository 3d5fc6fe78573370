"""Small, offline test tokenizers shaped like the real ones of Llama, Mistral and Qwen checkpoints.

``save_test_tokenizer(path, model_type, vocab_size)`` trains a byte-level BPE tokenizer on the
multilingual corpus embedded below (accented Latin, CJK, Hangul, emoji, code) with the
``tokenizers`` library, wraps it in the tokenizer class that transformers 5's ``AutoTokenizer``
picks for a checkpoint of that ``model_type``, adds the special tokens and the chat template that
family ships, and writes it with ``save_pretrained``. Nothing is downloaded.

Two layouts, as the real families:

- ``llama``, ``mistral``: SentencePiece-style BPE (``LlamaTokenizer``): ``<unk>`` 0, ``<s>`` 1,
  ``</s>`` 2, the 256 byte-fallback tokens ``<0x00>``..``<0xFF>`` at ids 3..258, then pieces
  learnt over ASCII text with ``▁`` marking a word start. Every character without a piece of its
  own (all non-ASCII text here) is spelled in its UTF-8 bytes, so an accented letter takes 2
  ids, a CJK character 3 and an emoji 4. BOS is added at the start of every encoding; the decoder
  strips the leading space the ``▁`` of the first word stands for.
- ``qwen2``, ``qwen3``: GPT-2-style byte-level BPE (``Qwen2Tokenizer``): the 256 byte symbols, the
  merges learnt over the whole corpus (so frequent CJK characters become one id, rare ones and
  emoji stay several), then ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` (and for qwen3
  the ``<think>``/``</think>`` added tokens); no BOS; EOS ``<|im_end|>`` (an instruct model's).

In transformers 5 ``AutoTokenizer`` chooses the class from config.json's ``model_type`` (for
qwen2/qwen3 whatever tokenizer_config.json names) and that class rebuilds its own normalizer,
pre-tokenizer and decoder around the vocab and merges of tokenizer.json: a tokenizer of another
shape (a WordLevel one, say) loads without error and then encodes to nothing. Hence one layout
per family, built as that family's class.

The ids of these tokenizers are all below ``vocab_size`` (the model's embedding rows); the
tokenizer can be smaller than the model (real Qwen checkpoints have unused rows too) when the
corpus runs out of merges. When ``path`` already holds a config.json (and a
generation_config.json), their ``bos_token_id``, ``eos_token_id`` and ``pad_token_id`` are set to
this tokenizer's, as in a real checkpoint (for qwen, generation_config.json's ``eos_token_id`` is
``[<|im_end|>, <|endoftext|>]``, as Qwen's instruct checkpoints have it); the rest is kept.
"""

from __future__ import annotations

import json
import os
import unicodedata
from collections import Counter
from pathlib import Path
from typing import Union

__all__ = ["save_test_tokenizer", "min_vocab_size", "SUPPORTED_MODEL_TYPES", "TRAINING_CORPUS"]

# A few KB of text in several scripts; the merges are learnt from it. NFC throughout.
TRAINING_CORPUS = """\
The paged KV cache keeps every sequence's attention keys and values in fixed-size blocks.
A block table maps the logical blocks of a sequence to physical blocks in GPU memory, so the
memory of a sequence need not be contiguous, and blocks can be shared between sequences that
start with the same prompt. When a shared block is written to, it is copied first: copy on write.
The scheduler batches requests continuously: new requests join the running batch at every step,
and finished ones leave it. When the GPU runs out of free blocks, the scheduler preempts the
newest requests and swaps their blocks out to CPU memory, then swaps them back in later.
Prefix caching identifies full blocks by the hash of their tokens and of the blocks before them,
so two requests with the same system prompt share the blocks of that prompt.
def step(batch, cache):
    for seq in batch.running():
        cache.append(seq.seq_id, seq.next_token)
    return model.forward(batch, cache.block_tables())
Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048 4096, 3.14159, 2.71828, 1e-5.
Hello, world! How are you today? I am fine, thank you. What time is it? It is 12:30 now.
The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG.
Le cache paginé conserve les clés et les valeurs de l'attention dans des blocs de taille fixe.
Où est la gare ? Voilà, c'est à côté du café. L'été dernier, nous étions à Montréal et à Genève.
Être ou ne pas être, telle est la question. Les élèves français étudient le théâtre et l'histoire.
Der Schlüssel-Wert-Speicher wird in Blöcken fester Größe verwaltet. Grüße aus München und Köln!
Die Straße ist nass, weil es regnet. Über den Wolken muss die Freiheit wohl grenzenlos sein.
La caché de claves y valores se guarda en bloques. ¿Dónde está la estación? ¡Qué día más bonito!
El niño comió una manzana en el jardín. La canción del corazón. Mañana será otro día.
O cache de atenção é dividido em blocos. A informação não está disponível. Obrigado, até logo!
Żółć, gęślą jaźń. Český jazyk. Ærø og Ødegård. Smörgåsbord. İstanbul'da güzel bir gün.
Το κλειδί και η τιμή αποθηκεύονται σε μπλοκ. Привет, мир! Кэш ключей и значений хранится в блоках.
分页的键值缓存把每个序列的注意力键和值保存在固定大小的块中。块表把序列的逻辑块映射到显存中的物理块。
调度器在每一步把新的请求加入正在运行的批次，完成的请求离开批次。当显存不够时，调度器把请求换出到内存。
你好，世界！今天天气很好。我们一起去吃饭吧。中文、日本語、한국어都是多字节字符。
前缀缓存用块的哈希来识别完整的块，所以两个有相同系统提示的请求共享这个提示的块。
ページ化されたKVキャッシュは、各シーケンスのキーと値を固定サイズのブロックに保存します。
こんにちは、世界！今日はいい天気ですね。東京と大阪と京都に行きました。ありがとうございます。
페이지 단위의 KV 캐시는 각 시퀀스의 키와 값을 고정 크기 블록에 저장합니다. 안녕하세요, 세계!
감사합니다. 오늘 날씨가 좋네요. 서울에서 부산까지 기차를 탔습니다.
Emoji: 😀 😃 😄 😁 🙂 🚀 🎉 ❤️ 👍 🌍 🐍 🔥 ✨ 💡 📦 🤖 👋🏽 👨‍👩‍👧 🇫🇷 🇯🇵
I love serving models 🚀🔥 and caching keys 🔑 in blocks 📦. Thanks! 👍🙂 Bonne journée ☀️!
Math and symbols: α β γ δ λ π Σ ∞ ≤ ≥ ≠ → ← ∑ ∫ √ ° € £ ¥ © ® ™ — – … « » “ ” ‘ ’ •
"""

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# --- chat templates, as the real checkpoints of each family ship them (shortened where noted) ----

# Llama 2 chat (meta-llama/Llama-2-7b-chat-hf): no generation prompt, "[/INST]" ends the prompt.
LLAMA2_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)

# Mistral 7B Instruct v0.1/v0.2.
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
    "{% endfor %}"
)

# Qwen2 / Qwen2.5 Instruct (without the tool-calling branches).
QWEN2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Qwen3 (without the tool-calling and reasoning-history branches): no default system prompt,
# and ``enable_thinking=False`` pre-fills an empty think block.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)

_LLAMA_SPECIALS = ("<unk>", "<s>", "</s>")
_BYTE_TOKENS = tuple(f"<0x{b:02X}>" for b in range(256))
_QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_QWEN3_ADDED = ("<think>", "</think>")  # added tokens, not special (decode keeps them)


def min_vocab_size(model_type: str) -> int:
    """The smallest ``vocab_size`` ``save_test_tokenizer`` accepts for ``model_type``:
    the byte tokens and the special tokens, with no merges at all."""
    family = _family(model_type)
    if family == "llama":
        return len(_LLAMA_SPECIALS) + 256 + 1  # and the "▁" piece
    return 256 + len(_QWEN_SPECIALS) + (len(_QWEN3_ADDED) if model_type == "qwen3" else 0)


def save_test_tokenizer(path: Union[str, os.PathLike], model_type: str, vocab_size: int) -> None:
    """Train and save (``save_pretrained``) a small tokenizer for a ``model_type`` checkpoint.

    All its ids are below ``vocab_size``; ``ValueError`` when ``vocab_size`` is below
    ``min_vocab_size(model_type)`` or ``model_type`` is not one of ``SUPPORTED_MODEL_TYPES``.
    Deterministic: the same arguments write the same files.
    """
    family = _family(model_type)
    minimum = min_vocab_size(model_type)
    if vocab_size < minimum:
        raise ValueError(
            f"a {model_type} test tokenizer needs vocab_size >= {minimum} (256 byte tokens and the special tokens), "
            f"got {vocab_size}"
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if family == "llama":
        tokenizer = _build_llama(model_type, vocab_size)
    else:
        tokenizer = _build_qwen(model_type, vocab_size)
    tokenizer.save_pretrained(str(path))
    _sync_config_ids(path, tokenizer, family)


def _family(model_type: str) -> str:
    if model_type in ("llama", "mistral"):
        return "llama"
    if model_type in ("qwen2", "qwen3"):
        return "qwen"
    raise ValueError(f"no test tokenizer for model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")


def _corpus_lines() -> list[str]:
    return [unicodedata.normalize("NFC", line) for line in TRAINING_CORPUS.splitlines() if line.strip()]


def _train_bpe(pre_tokenizer, lines: list[str], budget: int, alphabet: list[str], normalizer=None):
    """BPE over ``lines``; a vocab of at most ``budget`` entries (``alphabet`` first, then merges).

    Returns (vocab tokens in id order, merges as pairs)."""
    from tokenizers import Tokenizer, models, trainers

    if budget <= len(alphabet):
        return list(alphabet[:budget]), []
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=budget,
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
    )
    tok.train_from_iterator(lines, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = [token for token, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return vocab, merges


def _build_llama(model_type: str, vocab_size: int):
    from tokenizers import pre_tokenizers
    from transformers import LlamaTokenizer

    # Pieces are learnt over ASCII text only, so every other character falls back to its bytes.
    lines = [line for line in _corpus_lines() if line.isascii()]
    # "▁" and then the most frequent characters first: a tiny budget keeps those.
    counts = Counter(ch for line in lines for ch in line if ch != " ")
    alphabet = ["▁"] + sorted(counts, key=lambda ch: (-counts[ch], ch))
    budget = vocab_size - len(_LLAMA_SPECIALS) - len(_BYTE_TOKENS)
    pieces, merges = _train_bpe(
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True), lines, budget, alphabet
    )
    # Keep only merges whose parts and result are in the vocab (a truncated alphabet drops some).
    vocab: dict[str, int] = {}
    for token in (*_LLAMA_SPECIALS, *_BYTE_TOKENS, *pieces):
        vocab.setdefault(token, len(vocab))
    merges = [(a, b) for a, b in merges if a in vocab and b in vocab and a + b in vocab]
    template = LLAMA2_CHAT_TEMPLATE if model_type == "llama" else MISTRAL_CHAT_TEMPLATE
    tokenizer = LlamaTokenizer(
        vocab=vocab,
        merges=merges,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        add_bos_token=True,
        add_eos_token=False,
        legacy=False,
        add_prefix_space=True,
        model_max_length=1_000_000,
    )
    tokenizer.chat_template = template
    return tokenizer


def _build_qwen(model_type: str, vocab_size: int):
    from tokenizers import AddedToken, Regex, normalizers, pre_tokenizers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    # GPT-2's order: the byte symbols by code point ("!".."~", "¡".."ÿ", then "Ā"...).
    byte_alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=ord)
    added = _QWEN_SPECIALS + (_QWEN3_ADDED if model_type == "qwen3" else ())
    budget = vocab_size - len(added)
    pieces, merges = _train_bpe(pre, _corpus_lines(), budget, byte_alphabet, normalizer=normalizers.NFC())
    vocab: dict[str, int] = {}
    for token in (*byte_alphabet, *pieces):
        vocab.setdefault(token, len(vocab))
    for token in added:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=["<|im_start|>", "<|im_end|>"],
        errors="replace",
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        model_max_length=1_000_000,
    )
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in _QWEN_SPECIALS], special_tokens=True)
    if model_type == "qwen3":
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in _QWEN3_ADDED])
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE if model_type == "qwen3" else QWEN2_CHAT_TEMPLATE
    return tokenizer


def _sync_config_ids(path: Path, tokenizer, family: str) -> None:
    """Point config.json's (and generation_config.json's, when there is one) bos/eos/pad token ids
    at this tokenizer's tokens; the other entries are kept."""
    eos = tokenizer.eos_token_id
    if family == "qwen":
        # As Qwen2.5/Qwen3 instruct checkpoints: generation also ends at <|endoftext|>.
        gen_eos = [eos, tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    else:
        gen_eos = eos
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": eos, "pad_token_id": tokenizer.pad_token_id}
    _update_json(path / "config.json", ids)
    _update_json(path / "generation_config.json", {**ids, "eos_token_id": gen_eos})


def _update_json(file: Path, values: dict) -> None:
    if not file.is_file():
        return
    data = json.loads(file.read_text(encoding="utf-8"))
    if all(data.get(k) == v for k, v in values.items()):
        return
    data.update(values)
    file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
