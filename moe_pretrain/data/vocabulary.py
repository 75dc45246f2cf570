"""The id space a dataset was written in: the tokenizer's ids, then our six special tokens after them.

Every tokenizer (bytes, a Hugging Face tokenizer.json, a tiktoken BPE file) gets the same specials,
appended after its own vocabulary, so the model and the packer never depend on which one made the data.
The byte tokenizer's specials land at 256..261, the ids moe_pretrain.data.tokenizer uses.
"""

from dataclasses import asdict, dataclass

SPECIALS = ("pad", "bos", "eos", "image_start", "image_end", "image_patch")


@dataclass(frozen=True)
class Vocabulary:
    kind: str
    """"byte", "hf" (a tokenizer.json read by the `tokenizers` package) or "tiktoken" (a BPE ranks file)."""
    base_size: int
    """Ids the tokenizer itself uses (0..base_size-1); the specials follow."""
    fingerprint: str = ""
    """SHA-256 of the tokenizer file ("" for bytes): two datasets share ids only if this matches."""
    source: str = ""
    """The tokenizer file the data was written with (informational: the data may move machines)."""

    @property
    def size(self) -> int:
        return self.base_size + len(SPECIALS)

    def special(self, name: str) -> int:
        return self.base_size + SPECIALS.index(name)

    pad = property(lambda self: self.special("pad"))
    bos = property(lambda self: self.special("bos"))
    eos = property(lambda self: self.special("eos"))
    image_start = property(lambda self: self.special("image_start"))
    image_end = property(lambda self: self.special("image_end"))
    image_patch = property(lambda self: self.special("image_patch"))

    @property
    def non_text(self) -> tuple[int, ...]:
        """Targets no loss is taken on: everything special except end-of-document."""
        return tuple(self.special(name) for name in SPECIALS if name != "eos")

    def special_ids(self) -> dict[str, int]:
        """Every special token's id by name (saved in checkpoints: exports name them for serving engines)."""
        return {name: self.special(name) for name in SPECIALS}

    def to_dict(self) -> dict:
        return asdict(self)

    def same_ids(self, other: "Vocabulary") -> bool:
        """Whether two datasets' ids mean the same tokens (the tokenizer file's location may differ)."""
        return (self.kind, self.base_size, self.fingerprint) == (other.kind, other.base_size, other.fingerprint)


BYTES = Vocabulary("byte", 256)
