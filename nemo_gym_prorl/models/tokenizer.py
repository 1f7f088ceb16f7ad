"""A model's vocabulary and chat template, read from its GGUF file (no weights needed)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path

import llama_cpp

from nemo_gym_prorl.models.chat_template import ChatTemplate


class Tokenizer:
    def __init__(self, llama: llama_cpp.Llama) -> None:
        self._llama = llama
        self._model = llama._model
        self.vocab_size = llama.n_vocab()
        metadata = llama.metadata
        template = metadata.get("tokenizer.chat_template")
        if not template:
            raise ValueError(f"{llama.model_path}: the GGUF carries no chat template (tokenizer.chat_template)")
        self.bos_token_id = llama.token_bos()
        self.eos_token_id = llama.token_eos()
        self.chat_template = ChatTemplate(
            template,
            bos_token=self._token_text(self.bos_token_id),
            eos_token=self._token_text(self.eos_token_id),
        )

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        return cls(llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False))

    def with_chat_template(self, source: str) -> Tokenizer:
        """The same vocabulary rendering conversations with another chat template (a model's template fixed
        upstream, or one that differs from what its GGUF carries)."""
        other = copy.copy(self)
        current = self.chat_template
        other.chat_template = ChatTemplate(source, bos_token=current.bos_token, eos_token=current.eos_token)
        return other

    def _token_text(self, token_id: int) -> str:
        return self._model.token_get_text(token_id) if token_id >= 0 else ""

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in it (``<|im_start|>``) become their ids.

        One llama.cpp call, its buffer sized by the text (every token spans a byte at least; BOS and EOS besides):
        llama-cpp-python's own `tokenize` sizes it by the training context, which a vocab-only model reads as 0,
        so it tokenized every text twice."""
        if not text:
            return []
        data = text.encode()
        room = len(data) + 2
        ids = (llama_cpp.llama_token * room)()
        n = llama_cpp.llama_tokenize(self._model.vocab, data, len(data), ids, room, add_bos, True)
        if n < 0:
            raise RuntimeError(f"llama.cpp could not tokenize a {len(data)}-byte text (it asked for {-n} tokens)")
        return ids[:n]

    def decode(self, token_ids: list[int], special: bool = False) -> str:
        """Text of token ids; special tokens are left out (as vLLM's skip_special_tokens) unless `special`."""
        return self._model.detokenize(token_ids, special=special).decode("utf-8", errors="replace")

    def piece(self, token_id: int) -> str:
        return self._model.token_to_piece(token_id, special=True).rstrip(b"\0").decode("utf-8", errors="replace")

    def is_end_of_generation(self, token_id: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._model.vocab, token_id))

    def generation_end(self, generated: list[int]) -> str:
        """The text of the end-of-generation token `generated` ends with; "" when it ends otherwise (cut)."""
        return self.piece(generated[-1]) if generated and self.is_end_of_generation(generated[-1]) else ""


_CONTEXT_TOKENS = 4  # of a resumed stream's given tokens, decoded with its first piece (which keeps its leading space)


class StreamDecoder:
    """The text of tokens that arrive one at a time, each piece given once.

    As vLLM's incremental detokenizer: a token's piece is the decoding of a short window ending at it less that of
    the window before it (a tokenizer that drops a text's leading space still gives each piece its own), and a
    piece that ends in an incomplete UTF-8 character waits for the token that completes it. Linear in the text's
    length; decoding everything so far for each token is quadratic, and gives a character split over two tokens
    as U+FFFD followed by nothing. `context`: tokens whose text was given already (a generation resumed)."""

    def __init__(self, tokenizer: Tokenizer, context: Sequence[int] = ()) -> None:
        self._decode = tokenizer.decode
        self._window = list(context[-_CONTEXT_TOKENS:])  # the last piece's tokens and those since
        self._given = len(self._window)  # the window's first tokens, whose text was given

    def push(self, token: int) -> str:
        self._window.append(token)
        return self._piece(final=False)

    def flush(self) -> str:
        """What is still held back (the incomplete character a cut generation ends with, as U+FFFD)."""
        return self._piece(final=True)

    def _piece(self, *, final: bool) -> str:
        given = self._decode(self._window[: self._given])
        text = self._decode(self._window)
        if len(text) <= len(given) or (text.endswith("\ufffd") and not final):
            return ""
        del self._window[: self._given]
        self._given = len(self._window)
        return text[len(given) :]

