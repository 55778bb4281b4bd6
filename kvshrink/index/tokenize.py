"""Turn a ``prompt`` (or chat ``messages``) into the token ids vLLM will see, for ``/lookup``.

Tokenizers load lazily (transformers is heavy) from the folder configured under ``tokenizers:``
for the model, else from the model name itself (a local path or a cached hub id; this service
never downloads). Completions are encoded like vLLM's completions endpoint (special tokens added);
chat messages go through the model's chat template with the generation prompt, then are encoded
without adding special tokens again, as vLLM's chat endpoint does.
"""

from __future__ import annotations

import threading
from typing import Any

from kvshrink.errors import ConfigError


class Tokenizers:
    def __init__(self, paths: dict[str, str]) -> None:
        self._paths = dict(paths)
        self._loaded: dict[str, Any] = {}
        self._lock = threading.Lock()

    def get(self, model: str):
        with self._lock:
            tok = self._loaded.get(model)
            if tok is None:
                from transformers import AutoTokenizer

                source = self._paths.get(model, model)
                try:
                    tok = AutoTokenizer.from_pretrained(source, local_files_only=True)
                except (OSError, ValueError) as exc:
                    raise ConfigError(f"tokenizers.{model}", f"no tokenizer for model {model!r} at {source!r}: "
                                      f"{exc}") from exc
                self._loaded[model] = tok
            return tok

    def encode_prompt(self, model: str, prompt: str) -> list[int]:
        return list(self.get(model).encode(prompt))

    def encode_messages(self, model: str, messages: list[dict]) -> list[int]:
        tok = self.get(model)
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tok.encode(text, add_special_tokens=False))
