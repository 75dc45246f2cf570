"""GPU fast paths, each beside the PyTorch reference it must match (STYLE.md rule 4)."""
