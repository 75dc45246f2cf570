"""Byte-level tokenizer: ids 0..255 are bytes, then the special tokens (needs no vocabulary file)."""

PAD, BOS, EOS, IMAGE_START, IMAGE_END, IMAGE_PATCH = range(256, 262)
SPECIAL_NAMES = {PAD: "<pad>", BOS: "<bos>", EOS: "<eos>", IMAGE_START: "<image>",
                 IMAGE_END: "</image>", IMAGE_PATCH: "<patch>"}
VOCAB_SIZE = 262
"""Ids in use; the model's vocab_size may be larger (rounded up for efficient GEMMs)."""


def encode(text: str | bytes) -> list[int]:
    """UTF-8 bytes as ids (no BOS/EOS; documents add them)."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    return list(data)


def decode(ids: list[int]) -> str:
    """Bytes back to text; special tokens rendered by name, undecodable bytes replaced."""
    out, pending = [], bytearray()
    for i in ids:
        if i < 256:
            pending.append(i)
            continue
        out.append(pending.decode("utf-8", errors="replace"))
        pending.clear()
        out.append(SPECIAL_NAMES.get(i, f"<{i}>"))
    out.append(pending.decode("utf-8", errors="replace"))
    return "".join(out)


def is_text_target(token: int) -> bool:
    """Tokens the loss is computed on: bytes and end-of-document (not BOS, padding or image tokens)."""
    return token < 256 or token == EOS
