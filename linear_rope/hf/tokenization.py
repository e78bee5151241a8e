"""ByteTokenizer: the model's vocabulary is the 256 bytes of UTF-8 text, id = byte value."""
from __future__ import annotations

from transformers import PreTrainedTokenizer

from .remote import add_tokenizer_auto_map, write_remote_code

__all__ = ["ByteTokenizer"]


class ByteTokenizer(PreTrainedTokenizer):
    """Text -> its UTF-8 bytes, one id per byte (0..255), and back (bytes that do not decode
    become U+FFFD). No BOS or EOS is added: the model was trained on raw byte streams. Byte 0
    (NUL) pads, on the left by default, as a decoder-only model's batched generation needs;
    padding is always under a 0 attention mask, so the model never reads it."""

    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, pad_token: str = "\x00", padding_side: str = "left", **kwargs):
        kwargs.setdefault("clean_up_tokenization_spaces", False)  # decode gives the bytes' text, as is
        super().__init__(pad_token=pad_token, padding_side=padding_side, **kwargs)

    @property
    def vocab_size(self) -> int:
        return 256

    def get_vocab(self) -> dict[str, int]:
        return {chr(i): i for i in range(256)}

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return [chr(b) for b in text.encode("utf-8")]

    def _convert_token_to_id(self, token: str) -> int:
        if not (isinstance(token, str) and len(token) == 1 and ord(token) < 256):  # never the pad id in silence
            raise ValueError(f"token {token!r} is not a byte: ByteTokenizer's tokens are the 256 single "
                             f"characters U+0000..U+00FF, one per byte")
        return ord(token)

    def _convert_id_to_token(self, index: int) -> str:
        if not 0 <= index < 256:  # never dropped in silence: an id past the bytes is not text
            raise ValueError(f"token id {index} is not a byte (0..255): ByteTokenizer cannot decode it")
        return chr(index)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return bytes(ord(t) for t in tokens if len(t) == 1 and ord(t) < 256).decode("utf-8", errors="replace")

    def build_inputs_with_special_tokens(self, token_ids_0: list[int], token_ids_1: list[int] | None = None) -> list[int]:
        return token_ids_0 + (token_ids_1 or [])  # nothing added: no BOS, EOS or separator

    def get_special_tokens_mask(self, token_ids_0: list[int], token_ids_1: list[int] | None = None,
                                already_has_special_tokens: bool = False) -> list[int]:
        return [0] * (len(token_ids_0) + len(token_ids_1 or []))

    def save_pretrained(self, save_directory, *args, **kwargs):
        """``PreTrainedTokenizer.save_pretrained``, plus ``modeling_linear_rope.py`` and the
        ``auto_map`` that lets ``AutoTokenizer`` load it with ``trust_remote_code=True``."""
        files = super().save_pretrained(save_directory, *args, **kwargs)
        for f in files:
            if str(f).endswith("tokenizer_config.json"):
                add_tokenizer_auto_map(f)
        write_remote_code(save_directory)
        return files

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, ...]:
        return ()  # no vocabulary file: the vocabulary is the bytes
