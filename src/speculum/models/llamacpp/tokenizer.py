"""The GGUF's own tokenizer, with the small part of the Hugging Face tokenizer interface speculum uses.

A :class:`LlamaCppTokenizer` wraps the ``llama_cpp.Llama`` object of a loaded model: token ids are
llama.cpp's, text round-trips through llama.cpp's own tokenize / detokenize, and the chat template is the
one stored in the GGUF. It exists only beside a loaded model, so ``llama_cpp`` is imported where used.

:meth:`LlamaCppTokenizer.token_bytes` gives the bytes each token adds to a text: llama.cpp's own piece of
every token (``llama_token_to_piece``), exact for every tokenizer a GGUF can hold.
"""
from __future__ import annotations

import ctypes
from typing import Any, Sequence

from ...validation import InputError
from ..base import check_token_ids

__all__ = ["LlamaCppTokenizer"]


class LlamaCppTokenizer:
    """The GGUF's own tokenizer with the small part of the Hugging Face interface speculum uses.

    ``encode`` parses special tokens in the text (as Hugging Face does); ``apply_chat_template`` renders
    the chat template stored in the GGUF (``tokenizer.chat_template``) with jinja2, like transformers.

    Example:
        >>> ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}])   # doctest: +SKIP
        >>> tok.decode(tok.encode("Hello world"))                                   # doctest: +SKIP
        'Hello world'
    """

    def __init__(self, llama: Any, *, eos_token_id: int | None, bos_token_id: int | None) -> None:
        self._llama = llama
        self.vocab_size = int(llama.n_vocab())
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        self.chat_template: str | None = llama.metadata.get("tokenizer.chat_template")
        self._vocab_map: dict[str, int] | None = None

    def get_vocab(self) -> dict[str, int]:
        """Token text -> id for every token (as Hugging Face's ``get_vocab``; used to pair drafts)."""
        if self._vocab_map is None:
            import llama_cpp  # the optional [llamacpp] extra: present whenever a Llama object is

            vocab = llama_cpp.llama_model_get_vocab(self._llama.model)
            self._vocab_map = {
                (llama_cpp.llama_vocab_get_text(vocab, token_id) or b"").decode("utf-8", errors="replace"): token_id
                for token_id in range(self.vocab_size)
            }
        return self._vocab_map

    def token_bytes(self) -> list[bytes | None]:
        """``(vocab_size,)`` the bytes each token id adds mid-text: llama.cpp's piece of the token, or None
        for a token that adds no text (control, end-of-generation, unknown and unused tokens, empty pieces)."""
        import llama_cpp  # the optional [llamacpp] extra: present whenever a Llama object is

        vocab = llama_cpp.llama_model_get_vocab(self._llama.model)
        count = min(self.vocab_size, int(llama_cpp.llama_vocab_n_tokens(vocab)))
        no_text = 0
        for flag in ("LLAMA_TOKEN_ATTR_CONTROL", "LLAMA_TOKEN_ATTR_UNKNOWN", "LLAMA_TOKEN_ATTR_UNUSED"):
            no_text |= int(getattr(llama_cpp, flag, 0))
        get_attr = getattr(llama_cpp, "llama_vocab_get_attr", None)
        is_control = getattr(llama_cpp, "llama_vocab_is_control", None)
        is_eog = getattr(llama_cpp, "llama_vocab_is_eog", None)
        buffer = ctypes.create_string_buffer(256)
        out: list[bytes | None] = [None] * self.vocab_size
        for token_id in range(count):
            if ((get_attr is not None and int(get_attr(vocab, token_id)) & no_text)
                    or (is_control is not None and is_control(vocab, token_id))
                    or (is_eog is not None and is_eog(vocab, token_id))):
                continue
            # lstrip=0: the piece as it appears mid-text; special=False: control text is never rendered.
            length = llama_cpp.llama_token_to_piece(vocab, token_id, buffer, len(buffer), 0, False)
            if length < 0:  # the piece is longer than the buffer: -length is the size it needs
                buffer = ctypes.create_string_buffer(-length)
                length = llama_cpp.llama_token_to_piece(vocab, token_id, buffer, len(buffer), 0, False)
            out[token_id] = buffer.raw[:length] or None
        return out

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds BOS only where the GGUF asks for it."""
        if not isinstance(text, str):
            raise InputError(f"text must be a str, got {type(text).__name__}")
        return list(self._llama.tokenize(text.encode("utf-8"), add_bos=add_special_tokens, special=True))

    def __call__(self, texts: str | Sequence[str], add_special_tokens: bool = True) -> dict:
        """``{"input_ids": ...}`` of one text or a list of texts, as a transformers tokenizer answers."""
        if isinstance(texts, str):
            return {"input_ids": self.encode(texts, add_special_tokens)}
        return {"input_ids": [self.encode(text, add_special_tokens) for text in texts]}

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``token_ids`` (invalid UTF-8 at a cut multi-byte character becomes U+FFFD)."""
        ids = check_token_ids(token_ids, self.vocab_size, name="token_ids")
        return self._llama.detokenize(ids, special=not skip_special_tokens).decode("utf-8", errors="replace")

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self.decode([token_id])

    def apply_chat_template(
        self,
        messages: Sequence[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        return_dict: bool = False,
    ):
        """Render ``messages`` with the GGUF's chat template: token ids (``tokenize``) or the prompt text.

        ``return_dict=True`` returns ``{"input_ids": ids}`` like a Hugging Face ``BatchEncoding``."""
        if self.chat_template is None:
            raise InputError("this GGUF file has no chat template (metadata tokenizer.chat_template)")
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter  # the [llamacpp] extra, as above

        formatter = Jinja2ChatFormatter(
            template=self.chat_template,
            eos_token=self._token_text(self.eos_token_id),
            bos_token=self._token_text(self.bos_token_id),
            add_generation_prompt=add_generation_prompt,
        )
        text = formatter(messages=list(messages)).prompt
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)  # the template already holds any BOS
        return {"input_ids": ids} if return_dict else ids
