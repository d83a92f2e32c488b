"""The served tokenizer, for callers that speak in token ids (the OpenAI-compatible API and
the tokenizer endpoints evaluation tools read)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from memlm.engine.core import EngineCore
from memlm.engine.errors import EngineInputError


class TokensMixin(EngineCore):
    """Text to ids and back with the model's own tokenizer; its special tokens and template."""

    @property
    def vocab_size(self) -> int:
        """Token ids the model scores: 0 to ``vocab_size - 1``."""
        return self.encoder.vocab_size

    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        """The ids ``score`` and ``start_generation`` read for ``text``; ``special``: with
        the special tokens the tokenizer adds around a text (for callers that ask)."""
        if not special:
            return self.encoder.tokenize(text)
        ids: list[int] = self.encoder.tokenizer(text, add_special_tokens=True)["input_ids"]
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens spelt out."""
        text: str = self.encoder.tokenizer.decode(list(ids))
        return text

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each id decoded alone."""
        return self.encoder.token_strings(ids)

    def tokenizer_info(self) -> dict[str, Any]:
        """The special tokens, the chat template (None when the tokenizer has none) and the
        positions a context may hold."""
        tok = self.encoder.tokenizer
        return {
            "eos_token": tok.eos_token,
            "bos_token": tok.bos_token,
            "pad_token": tok.pad_token,
            "chat_template": tok.chat_template,
            "max_positions": self.encoder.max_positions,
        }

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The token ids of a conversation in the tokenizer's chat template, ending where
        the assistant's answer begins; EngineInputError when there is no template."""
        tok = self.encoder.tokenizer
        if not tok.chat_template:
            raise EngineInputError(
                f"the model {self.encoder.name} has no chat template: use /v1/completions"
            )
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # the template writes the special tokens itself, so none are added around it
        return self.encoder.tokenize(text)
