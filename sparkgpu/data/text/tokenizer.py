"""The user's tokenizer as plain data: shipped to Spark executors once, loaded where text is encoded.

A :class:`TokenizerSpec` holds the tokenizer's ``tokenizer.json`` text (the ``tokenizers``
library's own serialisation), its chat template and the special tokens the template may name.
It pickles as those strings, so a Spark job carries it in its task once, and an executor needs
the ``tokenizers`` package (plus ``transformers`` to render chat templates), not the files
the tokenizer came from.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

from sparkgpu.errors import ConfigurationError

__all__ = ["TokenizerSpec"]


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """A fast tokenizer, its chat template and special tokens, as strings.

    Attributes:
        json: The ``tokenizers.Tokenizer`` serialised (``Tokenizer.to_str()``).
        chat_template: Jinja chat template, or ``None``.
        special_tokens: Special token name -> text (``eos_token``, ``bos_token``, ...), passed
            to the chat template as HF's ``apply_chat_template`` does.
        eos_token_id: Id of the end-of-sequence token, or ``None``.
        pad_token_id: Id of the padding token, or ``None``.
    """

    json: str
    chat_template: str | None
    special_tokens: dict
    eos_token_id: int | None
    pad_token_id: int | None

    @classmethod
    def of(cls, tokenizer, *, chat_template: str | None = None, eos_token: str | None = None) -> "TokenizerSpec":
        """The spec of a ``PreTrainedTokenizerFast``, a ``tokenizers.Tokenizer`` or a local tokenizer folder.

        Args:
            tokenizer: The tokenizer, or the path of a folder ``AutoTokenizer.from_pretrained`` reads.
            chat_template: A template to use instead of the tokenizer's own.
            eos_token: The end-of-sequence token's text, for a ``tokenizers.Tokenizer`` (which does
                not know which token ends a sequence); a ``PreTrainedTokenizerFast``'s own is used otherwise.

        Raises:
            ConfigurationError: Not one of those types, a slow (Python) tokenizer, or an
                ``eos_token`` the vocabulary does not have.
        """
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = _load_folder(os.fspath(tokenizer))
        if type(tokenizer).__module__.startswith("tokenizers") and hasattr(tokenizer, "to_str"):
            return cls._of_backend(tokenizer, {}, chat_template, eos_token, None)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ConfigurationError(
                f"tokenizer= is a {type(tokenizer).__name__}; give a transformers PreTrainedTokenizerFast "
                "(AutoTokenizer.from_pretrained(..., use_fast=True)), a tokenizers.Tokenizer, or a local "
                "folder holding tokenizer.json"
            )
        template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):  # named templates: the default one, as apply_chat_template picks it
            template = template.get("default")
        special = {k: str(v) for k, v in (tokenizer.special_tokens_map or {}).items() if isinstance(v, str)}
        if eos_token is not None:
            special["eos_token"] = eos_token
        return cls._of_backend(backend, special, template, special.get("eos_token"), tokenizer.pad_token_id)

    @classmethod
    def _of_backend(cls, backend, special: dict, template, eos_token, pad_token_id) -> "TokenizerSpec":
        eos_id = None
        if eos_token is not None:
            eos_id = backend.token_to_id(eos_token)
            if eos_id is None:
                raise ConfigurationError(
                    f"eos_token={eos_token!r} is not in the tokenizer's vocabulary; pass the text of its "
                    "end-of-sequence token"
                )
            special = {**special, "eos_token": eos_token}
        return cls(backend.to_str(), template, dict(sorted(special.items())), eos_id, pad_token_id)

    @property
    def digest(self) -> str:
        """SHA-256 of everything that decides the token ids (vocabulary, rules, template, special tokens)."""
        payload = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(payload.encode("utf-8")).hexdigest()

    def describe(self) -> dict:
        """What the dataset's index records about the tokenizer (no vocabulary)."""
        return {
            "digest": self.digest,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "chat_template": self.chat_template is not None,
        }

    def load(self):
        """The ``tokenizers.Tokenizer`` (where text is encoded: an executor or a writer thread)."""
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigurationError(
                "encoding text needs the tokenizers package where it runs (the Spark executors too): "
                "pip install tokenizers"
            ) from None
        return Tokenizer.from_str(self.json)


def _load_folder(path: str):
    if not os.path.isdir(path):
        raise ConfigurationError(
            f"tokenizer={path!r} is not a folder; give a local folder holding tokenizer.json (what "
            "tokenizer.save_pretrained() writes) or a tokenizer object"
        )
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigurationError("reading a tokenizer folder needs transformers: pip install 'sparkgpu[hf]'") from None
    return AutoTokenizer.from_pretrained(path)
