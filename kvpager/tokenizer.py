"""The tokenizer of a Hugging Face checkpoint directory, and incremental detokenization.

``Tokenizer.from_pretrained(path)`` loads the checkpoint's tokenizer with transformers'
``AutoTokenizer`` (offline, ``local_files_only``), so the checkpoint's own rules apply: the class
its ``model_type`` selects, BOS/EOS insertion by its post-processor, its added and special
tokens, and its chat template rendered with Hugging Face's jinja environment. (docs/models.md,
"Tokenizer", says why not the ``tokenizers`` library alone.)

``IncrementalDetokenizer`` turns a stream of generated ids into text as they arrive: each
``push`` returns the new printable text, holding back what the next ids could still change (a
UTF-8 sequence whose bytes are still arriving, a run of byte-fallback tokens); ``finish``
flushes the rest. The concatenation of all pushes and the finish is exactly
``tokenizer.decode(generated ids, skip_special_tokens=True)``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional, Union

__all__ = ["Tokenizer", "TokenizerError", "IncrementalDetokenizer", "load_eos_token_ids"]

# Files any of which makes a directory hold a tokenizer that AutoTokenizer can load.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "vocab.json",
    "tekken.json",
    "spiece.model",
    "vocab.txt",
)
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_REPLACEMENT = "\ufffd"
_PROBE_TEXT = "Hello world"


class TokenizerError(ValueError):
    """A checkpoint directory without a usable tokenizer; the message is one line."""


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _read_json(path: Path) -> Optional[dict]:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"{path}: unreadable JSON ({_one_line(exc)})") from None
    return data if isinstance(data, dict) else None


def _eos_ids_from(value: Any, where: str) -> Optional[frozenset[int]]:
    """An ``eos_token_id`` value (int, list of ints, or None) as a set; None when absent."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TokenizerError(f"{where}: eos_token_id must be an int or a list of ints, got {value!r}")
    if isinstance(value, int):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise TokenizerError(f"{where}: eos_token_id must be an int or a list of ints >= 0, got {value!r}")
    return frozenset(value) if value else None


def load_eos_token_ids(path: Union[str, os.PathLike], tokenizer_eos_id: Optional[int] = None) -> frozenset[int]:
    """The ids that end generation for the checkpoint at ``path``.

    generation_config.json's ``eos_token_id`` (an int or a list) when it has one, else
    config.json's (or its ``text_config``'s), else ``tokenizer_eos_id``; empty when none has one.
    """
    path = Path(path)
    gen = _read_json(path / "generation_config.json")
    if gen is not None:
        ids = _eos_ids_from(gen.get("eos_token_id"), str(path / "generation_config.json"))
        if ids is not None:
            return ids
    config = _read_json(path / "config.json")
    if config is not None:
        ids = _eos_ids_from(config.get("eos_token_id"), str(path / "config.json"))
        if ids is None and isinstance(config.get("text_config"), dict):
            ids = _eos_ids_from(config["text_config"].get("eos_token_id"), str(path / "config.json"))
        if ids is not None:
            return ids
    return frozenset() if tokenizer_eos_id is None else frozenset([int(tokenizer_eos_id)])


class Tokenizer:
    """A checkpoint's tokenizer (a transformers tokenizer) plus the ids that end generation."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Optional[Iterable[int]] = None, *, name: str = "") -> None:
        self.hf = hf_tokenizer
        self.name = name or str(getattr(hf_tokenizer, "name_or_path", "") or type(hf_tokenizer).__name__)
        if eos_token_ids is None:
            eos = hf_tokenizer.eos_token_id
            eos_token_ids = () if eos is None else (eos,)
        self.eos_token_ids: frozenset[int] = frozenset(int(i) for i in eos_token_ids)
        self.bos_token_id: Optional[int] = hf_tokenizer.bos_token_id
        self.pad_token_id: Optional[int] = hf_tokenizer.pad_token_id
        self.special_token_ids: frozenset[int] = frozenset(hf_tokenizer.all_special_ids)
        # Every id the tokenizer knows (base vocab and added tokens), and its byte-fallback tokens.
        vocab = hf_tokenizer.get_vocab()
        self.vocab_size: int = (max(vocab.values()) + 1) if vocab else 0
        self._known_ids = frozenset(vocab.values())
        self.byte_fallback: bool = _has_byte_fallback(hf_tokenizer)
        self.byte_token_ids: frozenset[int] = frozenset(
            i for tok, i in vocab.items() if self.byte_fallback and _BYTE_TOKEN.fullmatch(tok)
        )
        # decodes_to_nothing's answers for ids below vocab_size (so at most vocab_size entries),
        # and its probe: ids that decode to a complete, non-empty text (None: not built yet).
        # Shared by every detokenizer of this tokenizer; a racing thread only repeats a probe.
        self._silent: dict[int, bool] = {}
        self._probe: Optional[tuple[list[int], str]] = None

    # -- loading ---------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: Union[str, os.PathLike]) -> "Tokenizer":
        """Load the tokenizer of the checkpoint directory ``path`` (offline).

        ``TokenizerError`` (one line) when ``path`` is no directory, holds no tokenizer file,
        the tokenizer does not load, or it encodes text to no ids (a tokenizer.json of another
        shape than the class config.json's ``model_type`` selects).
        """
        path = Path(path)
        if not path.is_dir():
            raise TokenizerError(f"{path}: no such checkpoint directory")
        if not any((path / f).is_file() for f in _TOKENIZER_FILES):
            raise TokenizerError(
                f"{path}: no tokenizer in the checkpoint (none of {', '.join(_TOKENIZER_FILES)})"
            )
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:  # pragma: no cover - the environment ships transformers
            raise TokenizerError(f"{path}: loading a tokenizer needs transformers ({_one_line(exc)})") from None
        try:
            hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - transformers raises many kinds; report one line
            raise TokenizerError(f"{path}: cannot load the tokenizer ({_one_line(exc)})") from None
        try:
            probe = hf.encode(_PROBE_TEXT, add_special_tokens=False)
        except Exception as exc:  # noqa: BLE001
            raise TokenizerError(f"{path}: the tokenizer fails to encode text ({_one_line(exc)})") from None
        if not probe:
            model_type = (_read_json(path / "config.json") or {}).get("model_type")
            raise TokenizerError(
                f"{path}: the tokenizer ({type(hf).__name__}, picked for model_type {model_type!r}) encodes text "
                f"to no ids; its tokenizer.json does not fit that class"
            )
        eos = load_eos_token_ids(path, hf.eos_token_id)
        return cls(hf, eos, name=str(path))

    # -- encoding and decoding ---------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, with the checkpoint's BOS/EOS rules when ``add_special_tokens``.

        Special-token strings in ``text`` (``<s>``, ``<|im_end|>``...) become those tokens, as in
        transformers; use ``apply_chat_template`` for untrusted user text.
        """
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(
        self,
        conversation: Union[str, Sequence[Mapping[str, Any]]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """The prompt ids of a chat: ``conversation`` is a user message's text or a list of
        ``{"role": ..., "content": ...}`` messages; the assistant's generation prompt is added.

        The template's BOS and control tokens become their ids; the same strings inside the
        messages are encoded as plain text (``sanitize_control_tokens``), so a message cannot
        close its turn or forge another. ``template_kwargs`` go to the template (e.g.
        ``enable_thinking=False`` for Qwen3). ``TokenizerError`` without a chat template;
        ``ValueError`` when the template refuses the messages (roles not alternating...).
        """
        if not self.has_chat_template:
            raise TokenizerError(f"{self.name}: the tokenizer has no chat template")
        if isinstance(conversation, str):
            messages = [{"role": "user", "content": conversation}]
        else:
            messages = [dict(m) for m in conversation]
        if not messages:
            raise ValueError("a chat needs at least one message")
        try:
            ids = self.hf.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
                sanitize_control_tokens=True,
                **template_kwargs,
            )
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - jinja2's TemplateError (raise_exception in the template)
            raise ValueError(f"{self.name}: the chat template refuses these messages ({_one_line(exc)})") from exc
        return [int(i) for i in ids]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids`` (transformers' ``decode``); special tokens left out by default."""
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decodes_to_nothing(self, token_id: int) -> bool:
        """Whether ``decode`` leaves ``token_id`` out wherever it stands: a special token (with
        ``skip_special_tokens``) or an id the tokenizer does not know.

        Asked of ``decode`` itself rather than of ``special_token_ids``: which ids decode skips is
        the backend's (the Rust tokenizer's) own list, which a Python-side list need not match.
        The id is decoded after a probe text ("a") and is silent when it adds nothing: after a
        complete character every other id adds at least a character (a byte token U+FFFD at
        least, a "▁" piece a space, an added token its text). O(1): one decode of a few ids,
        remembered for ids below ``vocab_size``.
        """
        known = self._silent.get(token_id)
        if known is not None:
            return known
        probe_ids, probe_text = self._probe_text()
        if probe_ids:
            silent = self.decode(probe_ids + [token_id]) == probe_text
        else:  # no usable probe (a tokenizer that cannot spell "a"): the Python-side lists
            silent = token_id in self.special_token_ids or token_id not in self._known_ids
        if 0 <= token_id < self.vocab_size:
            self._silent[token_id] = silent
        return silent

    def _probe_text(self) -> tuple[list[int], str]:
        """Ids whose text is non-empty and ends in a complete character, and that text; ([], "")
        when the tokenizer has none such for "a"."""
        if self._probe is None:
            ids = self.encode("a", add_special_tokens=False)
            text = self.decode(ids) if ids else ""
            self._probe = (ids, text) if text and not text.endswith(_REPLACEMENT) else ([], "")
        return self._probe

    def detokenizer(self, prompt_ids: Sequence[int] = (), *, prompt_context: bool = False) -> "IncrementalDetokenizer":
        """An ``IncrementalDetokenizer`` for one sequence generated after ``prompt_ids``."""
        return IncrementalDetokenizer(self, prompt_ids, prompt_context=prompt_context)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self.name!r}, {type(self.hf).__name__}, vocab={self.vocab_size}, "
            f"eos={sorted(self.eos_token_ids)})"
        )


def _has_byte_fallback(hf_tokenizer: Any) -> bool:
    """Whether the backend's decoder has a ByteFallback step (SentencePiece-style <0xNN> tokens)."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None or backend.decoder is None:
        return False
    try:
        decoder = json.loads(backend.decoder.__getstate__())
    except Exception:  # noqa: BLE001 - a decoder that does not serialize: assume no byte fallback
        return False

    def walk(node: Any) -> bool:
        if isinstance(node, dict):
            if node.get("type") == "ByteFallback":
                return True
            return any(walk(v) for v in node.values())
        if isinstance(node, list):
            return any(walk(v) for v in node)
        return False

    return walk(decoder)


class IncrementalDetokenizer:
    """Text of a token stream as it is generated, one ``push`` per token.

    ``push(token_id)`` returns the text the new token makes final (often ``""``); ``finish()``
    returns what is left. Their concatenation equals ``tokenizer.decode(generated,
    skip_special_tokens=True)``: special tokens (EOS) print nothing.

    Each push decodes a short window, the last ids of the stream, and prints that text past
    what was printed of it. The window starts with ids whose text has printed (context): a
    token that decodes differently alone (a SentencePiece ``▁word`` loses its space at the
    start of a text) then prints what it adds in the middle of the text. What is held back:

    - a trailing U+FFFD (a UTF-8 sequence whose bytes may still be arriving; at most 3 bytes, so
      everything before it is final, as it is in ``decode``'s lossy UTF-8);
    - for byte-fallback tokenizers, a run of ``<0xNN>`` tokens that the stream ends in: such a
      run decodes as a whole (one invalid byte later turns all of it into U+FFFD), so it stays
      in the window, undecoded, until a token that is no byte token closes it.

    Cost, O(1) amortized per push: an id that ``decode`` leaves out (special, unknown:
    ``Tokenizer.decodes_to_nothing``) never enters the window; the window is cut back to its
    last ``CONTEXT_TOKENS`` ids once it is longer than ``MAX_WINDOW_TOKENS``, so each push
    decodes at most ``MAX_WINDOW_TOKENS`` ids, except the one push that closes a byte run,
    which decodes the run once. The printed position is kept relative to the window text's end
    when the window is cut: a decoder's text of the ids past the cut does not depend on the ids
    before it (the lossy UTF-8 decoder is in step again at the first byte that begins a
    character, within the last 3 ids of a held U+FFFD; a window that does not start the text
    strips no leading space), and the cut is taken only when the kept ids end in the same
    unprinted text.

    ``prompt_context=True`` starts the window with the last tokens of ``prompt_ids`` instead,
    so the text continues the prompt's exactly (``decode(prompt + generated)`` minus
    ``decode(prompt)``): with a SentencePiece tokenizer the first word keeps its leading space
    (a completion of "The capital of France is" prints " Paris", not "Paris").
    """

    # Prompt tokens kept as context in prompt_context mode (as vLLM does).
    PROMPT_CONTEXT_TOKENS = 5
    # Ids kept when the window is cut: more than the 3 ids a held incomplete character spans.
    CONTEXT_TOKENS = 4
    # The longest window a push decodes (but for a byte run it closes) before the window is cut.
    MAX_WINDOW_TOKENS = 8

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int] = (), *, prompt_context: bool = False) -> None:
        if not isinstance(tokenizer, Tokenizer):
            tokenizer = Tokenizer(tokenizer)
        self.tokenizer = tokenizer
        self.prompt_context = prompt_context
        # The last ids of the stream that decode to something (never a silent id); holds the
        # whole open byte run, if any. Only _emit and push change it.
        self._window: list[int] = self._prompt_tail(prompt_ids) if prompt_context else []
        # How many characters at the start of decode(_window) have been printed (or are the
        # prompt's).
        self._printed = len(tokenizer.decode(self._window)) if self._window else 0
        self._generated: list[int] = []
        self._finished = False

    def _prompt_tail(self, prompt_ids: Sequence[int]) -> list[int]:
        """The last ``PROMPT_CONTEXT_TOKENS`` ids of the prompt that decode to something, and
        more so as not to cut a run of byte tokens (it decodes as a whole)."""
        tok = self.tokenizer
        tail: list[int] = []  # reversed
        for token_id in reversed(prompt_ids):
            token_id = int(token_id)
            if tok.decodes_to_nothing(token_id):
                continue
            if len(tail) >= self.PROMPT_CONTEXT_TOKENS and not (
                token_id in tok.byte_token_ids and tail[-1] in tok.byte_token_ids
            ):
                break
            tail.append(token_id)
        tail.reverse()
        return tail

    @property
    def generated(self) -> list[int]:
        """The ids pushed so far."""
        return list(self._generated)

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it makes printable (maybe ``""``)."""
        if self._finished:
            raise RuntimeError("push after finish")
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            token_id = int(token_id)  # numpy / torch integer scalars
        if token_id < 0:
            raise ValueError(f"token ids are >= 0, got {token_id}")
        self._generated.append(token_id)
        if self.tokenizer.decodes_to_nothing(token_id):
            return ""  # decode leaves it out wherever it stands: it changes no text
        self._window.append(token_id)
        if token_id in self.tokenizer.byte_token_ids:
            return ""  # an open byte run: its text depends on the bytes still to come
        return self._emit(final=False)

    def finish(self) -> str:
        """The text still held back (an incomplete UTF-8 sequence prints as U+FFFD, as in ``decode``)."""
        if self._finished:
            return ""
        self._finished = True
        return self._emit(final=True) if self._window else ""

    def _emit(self, final: bool) -> str:
        """Decode the window; return its text past ``_printed`` that is final (all of it when
        ``final``). O(len(_window))."""
        text = self.tokenizer.decode(self._window)
        end = len(text)
        if not final and text.endswith(_REPLACEMENT):
            end -= 1  # maybe a character whose bytes are still arriving
        # text starts with the printed text for the decoders above; were it not so, printing
        # past the printed length is still the best guess. end <= _printed: nothing new (the
        # next id completes a character), or a cleanup (clean_up_tokenization_spaces) shortened
        # printed text, which cannot be taken back.
        delta = text[self._printed : end] if end > self._printed else ""
        self._printed = max(self._printed, end)
        if not final and len(self._window) > self.MAX_WINDOW_TOKENS and len(text) >= self._printed:
            self._cut_window(text)
        return delta

    def _cut_window(self, text: str) -> None:
        """Keep the last ``CONTEXT_TOKENS`` ids of the window (``text`` is its decode), with the
        printed position moved so that the same unprinted text follows it. O(CONTEXT_TOKENS)."""
        kept = self._window[-self.CONTEXT_TOKENS :]
        kept_text = self.tokenizer.decode(kept)
        unprinted = len(text) - self._printed
        if len(kept_text) < unprinted or not kept_text.endswith(text[self._printed :]):
            return  # the kept ids do not end in the same text: keep the window, cut at a later push
        self._window = kept
        self._printed = len(kept_text) - unprinted
