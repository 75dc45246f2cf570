"""Tokenizer, embedded corpus, synthetic images, packing and label masking."""

import itertools

import numpy as np
import pytest
import torch

from moe_pretrain.config import ConfigError
from moe_pretrain.data import IGNORE_INDEX, PretrainingData
from moe_pretrain.data import tokenizer as tok
from moe_pretrain.data.embedded import split_text
from moe_pretrain.data.packing import DocumentRef, RowPlan, Segment, SequencePacker, assemble_row
from moe_pretrain.data.patches import image_grid, patchify
from moe_pretrain.data.stdlib_corpus import stdlib_source_files
from moe_pretrain.data.synthetic_images import image_size, make_image
from tests.models import tiny_config


def test_tokenizer_round_trip_and_specials():
    text = "def f(x):\n    return 'héllo' ✓\n"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and tok.decode(ids) == text
    assert tok.decode([tok.BOS, *tok.encode("a"), tok.EOS]) == "<bos>a<eos>"
    assert tok.VOCAB_SIZE == 262 and tok.is_text_target(tok.EOS) and not tok.is_text_target(tok.IMAGE_PATCH)


def test_stdlib_corpus_is_found_and_excludes_site_packages():
    files = stdlib_source_files()
    assert len(files) > 500
    assert any(f.name == "os.py" for f in files)
    assert not any("site-packages" in f.parts for f in files)


def test_split_text_cuts_at_line_breaks():
    data = b"".join(f"line {i}\n".encode() for i in range(100))
    pieces = split_text(data, 50)
    assert b"".join(pieces) == data
    assert all(len(p) <= 50 and p.endswith(b"\n") for p in pieces)
    assert split_text(b"x" * 120, 50) == [b"x" * 50, b"x" * 50, b"x" * 20]


def test_images_are_deterministic_captioned_and_of_four_sizes():
    a, caption_a = make_image(3, 7, 56)
    b, caption_b = make_image(3, 7, 56)
    c, _ = make_image(3, 8, 56)
    assert np.array_equal(a, b) and caption_a == caption_b and not np.array_equal(a[:, :28, :28], c[:, :28, :28])
    assert a.shape == (3, *image_size(3, 7, 56)) and a.min() >= -1 and a.max() <= 1
    assert caption_a.startswith("a ") and caption_a.endswith(".")
    assert {image_size(3, i, 56) for i in range(40)} == {(56, 56), (56, 28), (28, 56), (28, 28)}
    patches = patchify(a, 14)
    H, W = a.shape[1:]
    assert patches.shape == (H // 14 * W // 14, 588)
    assert np.array_equal(patches[1].reshape(3, 14, 14), a[:, :14, 14:28])  # first row, second patch


def test_patchify_cuts_clips_frame_major_then_row_major():
    clip = np.arange(2 * 3 * 8 * 12, dtype=np.float32).reshape(2, 3, 8, 12)
    patches = patchify(clip, 4)
    assert patches.shape == (2 * 2 * 3, 3 * 16) and image_grid(clip.shape, 4) == (2, 2, 3)
    # Frame 1, patch row 1, column 2: rows 4:8, columns 8:12 of the second frame, channels outermost.
    assert np.array_equal(patches[1 * 6 + 1 * 3 + 2].reshape(3, 4, 4), clip[1, :, 4:8, 8:12])


def test_packer_keeps_boundaries_and_never_cuts_images():
    image_tokens = np.array([tok.BOS, tok.IMAGE_START, tok.IMAGE_PATCH, tok.IMAGE_END, 65, tok.EOS])
    text_tokens = np.array([tok.BOS, *range(97, 97 + 8), tok.EOS])
    image, text = DocumentRef(("images", 0), 6, True), DocumentRef(("text", 5), 10, False)
    documents = itertools.cycle([text, image])
    packer = SequencePacker(lambda: next(documents), seq_len=14)
    plan1, plan2 = packer.next_row(), packer.next_row()
    # Row 1: text (10 tokens), then the 6-token image does not fit the 5 left: padding.
    assert plan1 == RowPlan([Segment(("text", 5), 0, 10, False)], 5)
    # Row 2: the image, then the text cut after 9 of its 10 tokens.
    assert plan2 == RowPlan([Segment(("images", 0), 0, 6, True), Segment(("text", 5), 0, 9, False)], 0)
    # The cut text continues as a new segment, and remembers where it came from (for resume).
    assert (packer.pending.origin, packer.pending.offset, packer.pending.length) == (("text", 5), 9, 1)
    assert packer.next_row().segments[0] == Segment(("text", 5), 9, 1, False)

    documents = {("images", 0): (image_tokens, np.ones((4, 3), np.float32), [(1, 2, 2)]),
                 ("text", 5): (text_tokens, None, [])}
    row1, row2 = (assemble_row(plan, documents.__getitem__, tok.PAD) for plan in (plan1, plan2))
    assert row1.tokens.tolist() == [*text_tokens, *[tok.PAD] * 5]
    assert row1.doc_ids.tolist() == [0] * 10 + [1] * 5 and row1.patches == [] and row1.grids == []
    assert row2.tokens.tolist() == [*image_tokens, *text_tokens[:9]]
    assert row2.doc_ids.tolist() == [0] * 6 + [1] * 9 and len(row2.patches) == 1 and row2.grids == [(1, 2, 2)]


def test_ranks_without_patches_read_the_same_tokens_and_no_pixels(monkeypatch):
    """A pipeline's later stages get the same tokens, labels and image mask, and never read a pixel."""
    cfg = tiny_config("data.image_fraction=0.3", "data.seq_len=128", "data.text_doc_bytes=256")
    full = PretrainingData(cfg).next_batch(8)
    data = PretrainingData(cfg)
    for dataset in data.datasets.values():
        monkeypatch.setattr(dataset, "images", None)  # any pixel read would now fail
    light = data.next_batch(8, with_patches=False)
    assert int(full.image_mask.sum()) > 0 and light.patches.shape == (0, 48)
    for name in ("tokens", "labels", "doc_ids", "image_mask"):
        assert torch.equal(getattr(full, name), getattr(light, name)), name
    assert full.grids == light.grids


def test_batches_mask_non_text_and_cross_document_targets():
    cfg = tiny_config("data.image_fraction=0.3", "data.seq_len=128", "data.text_doc_bytes=256")
    data = PretrainingData(cfg)
    batch = data.next_batch(8)
    assert batch.tokens.shape == batch.labels.shape == batch.doc_ids.shape == (8, 128)
    grids = batch.image_grids
    assert batch.patches.shape == (sum(t * h * w for t, h, w in grids), 48)
    assert int(batch.image_mask.sum()) == sum(h // 2 * (w // 2) for _, h, w in grids) > 0
    assert len({(h, w) for _, h, w in grids}) > 1  # images of several sizes in one batch
    kept = batch.labels[batch.labels != IGNORE_INDEX]
    assert ((kept < 256) | (kept == tok.EOS)).all()
    # A target is never taken across a document boundary.
    crossing = batch.doc_ids[:, 1:] != batch.doc_ids[:, :-1]
    assert (batch.labels[:, :-1][crossing] == IGNORE_INDEX).all()
    assert (batch.tokens[batch.image_mask] == tok.IMAGE_PATCH).all()


def test_embedded_images_round_trip_through_the_dataset():
    """An image read back from the cached dataset is the generated one, to the uint8 quantisation."""
    cfg = tiny_config("data.image_fraction=1.0", "data.seq_len=128")
    data = PretrainingData(cfg)
    doc = data._next_document()
    tokens, patches, grids = data.read_document(doc.origin)
    image, caption = make_image(cfg.data.seed, doc.origin[1], cfg.data.image_size)
    assert np.abs(patches - patchify(image, 4)).max() <= 1 / 127.5 + 1e-6
    assert tok.decode(tokens.tolist()).endswith(caption + "<eos>")
    assert grids == [image_grid(image.shape, 4)]
    assert (tokens == tok.IMAGE_PATCH).sum() * 4 == len(patches) and len(tokens) == doc.length


def test_image_token_share_follows_config():
    cfg = tiny_config("data.image_fraction=0.25")
    data = PretrainingData(cfg)
    docs = [data._next_document() for _ in range(400)]
    image_tokens = sum(d.length for d in docs if d.is_image)
    share = image_tokens / sum(d.length for d in docs)
    assert abs(share - 0.25) < 0.02, share  # the mixer tracks the share to within one text document


def test_image_documents_that_cannot_fit_a_row_are_refused():
    cfg = tiny_config("data.seq_len=64")
    with pytest.raises(ConfigError, match=r"data.seq_len=64: .*synthetic-images.* record \d+ takes \d+ tokens"):
        PretrainingData(cfg)


def test_batches_are_deterministic():
    cfg = tiny_config("data.image_fraction=0.25", "data.seq_len=128")
    first = PretrainingData(cfg)
    second = PretrainingData(cfg)
    for _ in range(5):
        a, b = first.next_batch(8), second.next_batch(8)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.labels, b.labels)
        assert torch.equal(a.patches, b.patches)


def test_position_resumes_exactly_from_its_counters(tmp_path):
    """state() -> a fresh pipeline's load_state() continues with the very next row, even when that row
    starts with the rest of a cut document, and even when the embedded corpus is cached elsewhere
    (another machine's home directory)."""
    cfg = tiny_config("data.image_fraction=0.25", "data.seq_len=128")
    running = PretrainingData(cfg)
    for _ in range(3):
        running.next_batch(8)
    state = running.state()
    assert state["pending"] is not None and state["rows"] == 24
    assert not state["pending"][0].startswith("/")  # saved by name, not by cache path
    resumed = PretrainingData(tiny_config("data.image_fraction=0.25", "data.seq_len=128",
                                          f"data.cache_dir={tmp_path / 'elsewhere'}"))
    resumed.load_state(state)
    for _ in range(3):
        a, b = running.next_batch(8), resumed.next_batch(8)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.patches, b.patches)
