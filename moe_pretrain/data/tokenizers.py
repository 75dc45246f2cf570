"""Tokenizers the preprocessor can write datasets with, all read from local files (nothing is downloaded).

A spec names one: "byte" (default), "hf:<path to tokenizer.json>" (the `tokenizers` package) or
"tiktoken:<path to a .tiktoken BPE ranks file>" (the `tiktoken` package). The two file-based ones are
optional extras: `pip install 'moe-pretrain[data]'`.
"""

import base64
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from moe_pretrain.data.vocabulary import BYTES, Vocabulary

TIKTOKEN_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)
"""The pre-tokenization split of cl100k-style BPE files (the file holds only ranks, not this pattern)."""


@dataclass
class Tokenizer:
    vocabulary: Vocabulary
    encode: Callable[[str], list[int]]
    """Text -> ids in [0, vocabulary.base_size), no specials."""


def _file_fingerprint(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _local_file(spec: str, path: str) -> Path:
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"tokenizer {spec!r}: no such file {file} (tokenizers are read from local files only)")
    return file


def _optional(package: str):
    try:
        return __import__(package)
    except ImportError as err:
        raise ImportError(f"the {package!r} package is needed for this tokenizer: pip install "
                          f"'moe-pretrain[data]'") from err


def _hf(spec: str, path: str) -> Tokenizer:
    file = _local_file(spec, path)
    tokenizers = _optional("tokenizers")
    hf = tokenizers.Tokenizer.from_file(str(file))
    vocabulary = Vocabulary("hf", hf.get_vocab_size(with_added_tokens=True), _file_fingerprint(file), str(file))
    return Tokenizer(vocabulary, lambda text: hf.encode(text, add_special_tokens=False).ids)


def read_tiktoken_ranks(file: Path) -> dict[bytes, int]:
    """A .tiktoken file: one "<base64 token> <rank>" per line."""
    ranks = {}
    for number, line in enumerate(file.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        except ValueError as err:
            raise ValueError(f"{file}:{number}: not a tiktoken BPE line (<base64 token> <rank>): "
                             f"{line[:80]!r}") from err
    return ranks


def _tiktoken(spec: str, path: str) -> Tokenizer:
    file = _local_file(spec, path)
    tiktoken = _optional("tiktoken")
    ranks = read_tiktoken_ranks(file)
    encoding = tiktoken.Encoding(name=file.stem, pat_str=TIKTOKEN_PATTERN, mergeable_ranks=ranks, special_tokens={})
    vocabulary = Vocabulary("tiktoken", encoding.n_vocab, _file_fingerprint(file), str(file))
    return Tokenizer(vocabulary, encoding.encode_ordinary)


def load_tokenizer(spec: str) -> Tokenizer:
    kind, _, path = spec.partition(":")
    if kind == "byte" and not path:
        return Tokenizer(BYTES, lambda text: list(text.encode("utf-8")))
    if kind == "hf" and path:
        return _hf(spec, path)
    if kind == "tiktoken" and path:
        return _tiktoken(spec, path)
    raise ValueError(f"unknown tokenizer {spec!r}: use byte, hf:<tokenizer.json> or tiktoken:<file.tiktoken>")
