"""Data blends: which datasets a run (or one stage of it) trains on, in what token shares."""

from dataclasses import dataclass

from moe_pretrain.config.errors import ConfigError, require


@dataclass
class BlendConfig:
    """One dataset of a blend: the prefix preprocess wrote (PREFIX.bin/.idx/.json) and its token share."""

    path: str = ""
    """The dataset's prefix: PREFIX.bin / .idx (and our PREFIX.json) written by python -m
    moe_pretrain.data.preprocess, or a Megatron pair."""
    weight: float = 1.0
    """Its share of the blend's tokens, relative to the other entries' weights."""
    tokenizer: str = ""
    """For a plain Megatron dataset (.bin / .idx without our .json): the tokenizer it was made with, as
    byte, hf:<tokenizer.json> or tiktoken:<file>; empty = data.tokenizer."""

    def check(self, where: str) -> None:
        require(bool(self.path), f"{where}.path is empty: give the prefix of a dataset written by "
                "python -m moe_pretrain.data.preprocess, or of a Megatron .bin / .idx pair")
        require(self.weight > 0, f"{where}.weight={self.weight} must be > 0")


def check_long_documents(where: str, share: float | None, tokens: int) -> None:
    require(share is None or 0.0 <= share <= 1.0, f"{where}.long_doc_share={share} must be in [0, 1] (or null)")
    require(tokens >= 0, f"{where}.long_doc_tokens={tokens} must be >= 0")


def megatron_data_path(value: str, key: str) -> list[dict]:
    """Megatron-LM's --data-path form, "0.3 /data/code 0.7 /data/web" (or one prefix alone), as blend entries."""
    words = value.split()
    if len(words) == 1:
        return [{"path": words[0]}]
    if not words or len(words) % 2:
        raise ConfigError(f"{key}={value!r}: expected weight / prefix pairs, as Megatron-LM's --data-path")
    entries = []
    for weight, path in zip(words[::2], words[1::2]):
        try:
            entries.append({"path": path, "weight": float(weight)})
        except ValueError as err:
            raise ConfigError(f"{key}={value!r}: {weight!r} is not a weight (expected weight / prefix pairs)") from err
    return entries
