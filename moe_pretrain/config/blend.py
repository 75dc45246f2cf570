"""Data blends: which datasets a run (or one stage of it) trains on, in what token shares."""

from dataclasses import dataclass

from moe_pretrain.config.errors import require


@dataclass
class BlendConfig:
    """One dataset of a blend: the prefix preprocess wrote (PREFIX.bin/.idx/.json) and its token share."""

    path: str = ""
    weight: float = 1.0

    def check(self, where: str) -> None:
        require(bool(self.path), f"{where}.path is empty: give the prefix of a dataset written by "
                "python -m moe_pretrain.data.preprocess")
        require(self.weight > 0, f"{where}.weight={self.weight} must be > 0")


def check_long_documents(where: str, share: float | None, tokens: int) -> None:
    require(share is None or 0.0 <= share <= 1.0, f"{where}.long_doc_share={share} must be in [0, 1] (or null)")
    require(tokens >= 0, f"{where}.long_doc_tokens={tokens} must be >= 0")
