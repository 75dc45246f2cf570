"""Indexed datasets: preprocess -> read round trips with each tokenizer, blends and long-document shares,
and every kind of bad data failing with the file and record named."""

import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from moe_pretrain.config import ConfigError, DataConfig
from moe_pretrain.data import DataError, PretrainingData
from moe_pretrain.data.embedded import synthetic_image_dataset
from moe_pretrain.data.image_size import default_max_pixels, fitted_size
from moe_pretrain.data.indexed import IndexedDocuments
from moe_pretrain.data.preprocess import ImageRules, preprocess
from moe_pretrain.data.tokenizers import load_tokenizer
from moe_pretrain.operations.run_loop import run_training
from tests.models import tiny_config

TEXTS = ["def f(x):\n    return x + 1\n", "héllo wörld ✓", "the theory of the thing"]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def save_image(path: Path, value: int, shape=(3, 8, 8)) -> str:
    np.save(path, np.full(shape, value, dtype=np.uint8))
    return path.name


def test_byte_round_trip_with_interleaved_images(tmp_path):
    first, second = save_image(tmp_path / "a.npy", 10), save_image(tmp_path / "b.npy", 200)
    source = write_jsonl(tmp_path / "in.jsonl", [
        {"text": TEXTS[0]},
        {"text": "see <image> and then <image> end", "images": [first, second]},
        {"text": "caption only", "images": [first]},
    ])
    text_file = tmp_path / "notes.txt"
    text_file.write_text(TEXTS[1])
    preprocess([source, text_file], tmp_path / "out" / "ds", progress=False, rules=ImageRules(multiple=8))
    dataset = IndexedDocuments(tmp_path / "out" / "ds")
    vocab = dataset.vocabulary
    assert len(dataset) == 4 and dataset.image_shapes.tolist() == [[1, 3, 8, 8]] * 3
    assert dataset.images_per_document.tolist() == [0, 2, 1, 0]
    doc = dataset.document(0)
    assert doc.tokens.tolist() == [vocab.bos, *TEXTS[0].encode(), vocab.eos] and doc.images == []
    doc = dataset.document(1)
    assert doc.tokens.tolist() == [vocab.bos, *b"see ", vocab.image_start, vocab.image_end, *b" and then ",
                                   vocab.image_start, vocab.image_end, *b" end", vocab.eos]
    assert [int(image[0, 0, 0]) for image in doc.images] == [10, 200]
    doc = dataset.document(2)  # no marker: the image comes first
    assert doc.tokens[1:3].tolist() == [vocab.image_start, vocab.image_end]
    assert bytes(dataset.document(3).tokens[1:-1].tolist()).decode() == TEXTS[1]
    # Lengths as the packer sees them: the given tokens of each image (here 4, 1, 3) after BOS, body and EOS.
    bodies = [len(TEXTS[0].encode()), 4 + 2 + 10 + 2 + 4, 2 + len("caption only"), len(TEXTS[1].encode())]
    assert dataset.document_lengths(np.array([4, 1, 3])).tolist() == [n + 2 + k for n, k in zip(bodies, [0, 5, 3, 0])]


def test_images_keep_their_size_and_aspect_ratio_within_the_budget(tmp_path):
    """Native resolution: each image is stored at its own size, sides rounded to multiples of patch x merge,
    shrunk (aspect ratio kept) only past --max-image-pixels; the loader shrinks further to
    data.max_image_pixels and counts each image's tokens from its grid."""
    names = [save_image(tmp_path / "wide.npy", 9, (3, 56, 112)), save_image(tmp_path / "odd.npy", 5, (3, 30, 50)),
             save_image(tmp_path / "huge.npy", 200, (3, 280, 140)),
             save_image(tmp_path / "clip.npy", 80, (2, 3, 28, 28))]
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": "x", "images": [name]} for name in names])
    preprocess([source], tmp_path / "ds", progress=False, rules=ImageRules(max_pixels=112 * 56))
    dataset = IndexedDocuments(tmp_path / "ds")
    assert dataset.image_shapes.tolist() == [[1, 3, 56, 112], [1, 3, 28, 56], [1, 3, 112, 56], [2, 3, 28, 28]]
    assert int(dataset.document(2).images[0].mean()) == 200 and dataset.document(3).images[0].shape == (2, 3, 28, 28)
    cfg = tiny_config(f"data.blend=[{{path: {tmp_path / 'ds'}}}]", "model.vision.patch_size=14",
                      "data.image_size=56", "data.max_image_pixels=3136")
    data = PretrainingData(cfg)  # 56 x 56 pixels at most: 4 x 4 patches, 2 x 2 tokens
    assert data.grids[str(tmp_path / "ds")].tolist() == [[1, 2, 4], [1, 2, 4], [1, 4, 2], [2, 2, 2]]
    tokens, patches, grids = data.read_document((str(tmp_path / "ds"), 0))
    assert grids == [(1, 2, 4)] and patches.shape == (8, 588) and (tokens == data.vocabulary.image_patch).sum() == 2
    # BOS, IMAGE_START, the image's tokens, IMAGE_END, "x", EOS
    assert data.lengths[str(tmp_path / "ds")].tolist() == [1 + 1 + 2 + 1 + 1 + 1] * 3 + [1 + 1 + 1 + 1 + 1 + 1]


def test_fitted_size_keeps_the_aspect_ratio_on_the_grid():
    assert fitted_size(56, 112, 10**9, 28) == (56, 112)  # on the grid, within budget: unchanged
    assert fitted_size(30, 50, 10**9, 28) == (28, 56)  # rounded to the grid
    assert fitted_size(5, 5, 10**9, 28) == (28, 28)  # at least one block
    assert fitted_size(7168, 3584, 3584 * 3584, 28) == (5068, 2520)  # shrunk by one factor, floored
    assert fitted_size(100000, 30, 28 * 28 * 4, 28) == (112, 28)  # a side held at one block: the other gives
    for H, W in [(1000, 3), (4000, 3000), (123, 4567)]:
        h, w = fitted_size(H, W, 3584 * 3584, 28)
        assert h % 28 == w % 28 == 0 and h * w <= 3584 * 3584
    assert default_max_pixels(8192, 14, 2) == 4096 * 784 and default_max_pixels(65536, 14, 2) == 3584 * 3584


def train_hf_tokenizer(path: Path) -> Path:
    tokenizers = pytest.importorskip("tokenizers", reason="the 'data' extra (tokenizers) is part of the test extra")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TEXTS * 20, trainer)
    tokenizer.save(str(path))
    return path


def write_tiktoken_file(path: Path) -> Path:
    """All 256 bytes, then merges for "th" and "the" (ranks must build up from their parts)."""
    tokens = [bytes([b]) for b in range(256)] + [b"th", b"the"]
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
    return path


@pytest.mark.parametrize("kind", ["hf", "tiktoken"])
def test_file_tokenizers_round_trip(tmp_path, kind):
    if kind == "hf":
        spec = f"hf:{train_hf_tokenizer(tmp_path / 'tokenizer.json')}"
    else:
        pytest.importorskip("tiktoken", reason="the 'data' extra (tiktoken) is part of the test extra")
        spec = f"tiktoken:{write_tiktoken_file(tmp_path / 'tiny.tiktoken')}"
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS])
    preprocess([source], tmp_path / "ds", tokenizer_spec=spec, progress=False)
    dataset = IndexedDocuments(tmp_path / "ds")
    tokenizer = load_tokenizer(spec)
    vocab = dataset.vocabulary
    assert vocab == tokenizer.vocabulary and vocab.kind == kind and vocab.fingerprint
    for i, text in enumerate(TEXTS):
        doc = dataset.document(i).tokens.tolist()
        assert doc[0] == vocab.bos and doc[-1] == vocab.eos and max(doc[1:-1]) < vocab.base_size
        assert doc[1:-1] == tokenizer.encode(text)
    if kind == "tiktoken":
        assert tokenizer.encode("the") == [257]  # the merges were applied
    else:
        import tokenizers
        assert tokenizers.Tokenizer.from_file(spec[3:]).decode(dataset.document(1).tokens[1:-1].tolist()) == TEXTS[1]


def lettered_dataset(tmp_path: Path, name: str, letter: str, lengths: list[int]) -> str:
    source = write_jsonl(tmp_path / f"{name}.jsonl", [{"text": letter * n} for n in lengths])
    preprocess([source], tmp_path / name, progress=False)
    return str(tmp_path / name)


def drawn_tokens(data: PretrainingData, documents: int) -> list:
    return [data._next_document() for _ in range(documents)]


def test_blend_token_shares_follow_the_weights(tmp_path):
    a = lettered_dataset(tmp_path, "a", "a", [30, 50, 70] * 20)
    b = lettered_dataset(tmp_path, "b", "b", [10, 200] * 20)
    cfg = tiny_config(f"data.blend=[{{path: {a}, weight: 0.7}}, {{path: {b}, weight: 0.3}}]")
    docs = drawn_tokens(PretrainingData(cfg), 600)
    from_a = sum(d.length for d in docs if d.origin[0] == a)
    share = from_a / sum(d.length for d in docs)
    assert abs(share - 0.7) < 0.01, share  # greedy token share: within one document of the target


def test_long_document_share_per_stage(tmp_path):
    """Natural mix: the two 80-token documents hold 160/1260 = 12.7% of the tokens (50 others of 22); the
    second stage asks for half its tokens from documents of >= 80 tokens."""
    path = lettered_dataset(tmp_path, "mixed", "x", [20] * 50 + [78] * 2)
    stages = ("stages=[{name: short, tokens: 768, seq_len: 96, batch_tokens: 384}, "
              "{name: long, tokens: 768, seq_len: 192, batch_tokens: 384, long_doc_share: 0.5, long_doc_tokens: 80}]")
    cfg = tiny_config(stages, "train.steps=4", f"data.blend=[{{path: {path}}}]")
    data = PretrainingData(cfg)
    natural = drawn_tokens(data, 500)
    natural_share = sum(d.length for d in natural if d.length >= 80) / sum(d.length for d in natural)
    assert abs(natural_share - 160 / 1260) < 0.02, natural_share
    data.set_stage(1)
    upsampled = drawn_tokens(data, 500)
    share = sum(d.length for d in upsampled if d.length >= 80) / sum(d.length for d in upsampled)
    assert abs(share - 0.5) < 0.02, share
    bad = tiny_config(stages.replace("long_doc_tokens: 80", "long_doc_tokens: 500"), "train.steps=4",
                      f"data.blend=[{{path: {path}}}]")
    with pytest.raises(ConfigError, match=r"stages\[1\]: long_doc_share=0.5 asks for long documents .* has none"):
        PretrainingData(bad)


def test_the_embedded_corpus_holds_documents_of_each_long_stages_length():
    """A stage that draws from long documents on the embedded corpus: its text then holds documents of the stage's
    sequence length (the images stay short), drawn for half the text's tokens (the images hold 10% of all: 45% of
    the stage's); a stage without a long share draws the 2 KB pieces as before."""
    from moe_pretrain.data.embedded import LONG_DOCUMENTS

    stages = ("stages=[{name: short, tokens: 768, seq_len: 96, batch_tokens: 384}, "
              "{name: long, tokens: 6144, seq_len: 3072, batch_tokens: 3072, long_doc_share: 0.5, "
              "long_doc_tokens: 2500}]")
    data = PretrainingData(tiny_config(stages, "train.steps=4"))
    text = next(path for path in data.lengths if "stdlib-text" in path)
    assert path_suffix(text) == "-long3072"
    assert int((data.lengths[text] >= 3072).sum()) == LONG_DOCUMENTS  # the 2 KB pieces are all shorter
    assert max(d.length for d in drawn_tokens(data, 300)) < 2500
    data.set_stage(1)
    drawn = drawn_tokens(data, 300)
    share = sum(d.length for d in drawn if d.length >= 2500) / sum(d.length for d in drawn)
    assert abs(share - 0.45) < 0.02, share


def path_suffix(path: str) -> str:
    return path[path.rindex("-long"):]


def test_a_blend_must_share_one_tokenizer_and_fit_the_model(tmp_path):
    byte = lettered_dataset(tmp_path, "bytes", "a", [10, 20])
    source = write_jsonl(tmp_path / "hf.jsonl", [{"text": t} for t in TEXTS])
    preprocess([source], tmp_path / "hf", tokenizer_spec=f"hf:{train_hf_tokenizer(tmp_path / 't.json')}",
               progress=False)
    with pytest.raises(ConfigError, match="a blend must share one tokenizer"):
        PretrainingData(tiny_config(f"data.blend=[{{path: {byte}}}, {{path: {tmp_path / 'hf'}}}]"))
    from moe_pretrain.training import Trainer
    with pytest.raises(ConfigError, match=r"model.vocab_size=256 is smaller than the 30\d ids of the data \(hf"):
        Trainer(tiny_config(f"data.blend=[{{path: {tmp_path / 'hf'}}}]", "model.vocab_size=256"))


@pytest.fixture
def dataset(tmp_path):
    save_image(tmp_path / "img.npy", 7)
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": f"record {i} " * 20, "images": ["img.npy"]}
                                                 for i in range(6)])
    preprocess([source], tmp_path / "ds", progress=False)
    return tmp_path / "ds"


def test_truncated_bin_names_the_file_and_record(dataset):
    bin_path = Path(f"{dataset}.bin")
    data = bin_path.read_bytes()
    bin_path.write_bytes(data[:len(data) // 2])
    # 6 records of 182 uint16 ids (364 bytes): half the file holds records 0-2 whole.
    with pytest.raises(DataError, match=r"ds\.bin: 1092 bytes, but .*ds\.idx describes 2184 .*incomplete record: 3"):
        IndexedDocuments(dataset)


def test_an_idx_of_another_dataset_is_refused(dataset, tmp_path):
    other = lettered_dataset(tmp_path, "other", "z", [5, 6, 7])
    shutil.copy(f"{other}.idx", f"{dataset}.idx")
    with pytest.raises(DataError, match=r"ds\.idx: 3 documents, but .*ds\.json records 6"):
        IndexedDocuments(dataset)
    Path(f"{dataset}.idx").write_bytes(b"garbage")
    with pytest.raises(DataError, match=r"ds\.idx: not a readable Megatron index"):
        IndexedDocuments(dataset)


def test_token_ids_outside_the_vocabulary_name_the_record(dataset):
    """A .bin rewritten (by another tool) with an id >= 262 in record 4: caught when that record is read."""
    source = IndexedDocuments(dataset)
    builder = IndexedDatasetBuilder(f"{dataset}.new.bin", dtype=np.uint16)
    for i in range(len(source)):
        body = source.tokens[i].astype(np.int64)
        if i == 4:
            body[3] = 300
        builder.add_document(body, [body.size])
    builder.finalize(f"{dataset}.new.idx")
    for suffix in (".bin", ".idx"):
        shutil.move(f"{dataset}.new{suffix}", f"{dataset}{suffix}")
    reopened = IndexedDocuments(dataset)
    reopened.document(3)
    with pytest.raises(DataError, match=r"ds\.bin: record 4 holds token id 300, outside the vocabulary of 262"):
        reopened.document(4)


def test_bad_images_stop_preprocess_naming_file_and_line(tmp_path):
    from PIL import Image

    Image.fromarray(np.zeros((40, 60, 3), np.uint8)).save(tmp_path / "ok.png")
    Image.fromarray(np.zeros((40, 60, 3), np.uint8)).save(tmp_path / "cut.png")
    (tmp_path / "cut.png").write_bytes((tmp_path / "cut.png").read_bytes()[:60])
    Image.fromarray(np.zeros((40, 60), np.uint16)).save(tmp_path / "deep.png")
    save_image(tmp_path / "empty.npy", 0, (3, 0, 8))
    save_image(tmp_path / "long.npy", 0, (5, 3, 28, 28))
    cases = [("cut.png", r"image .*cut\.png cannot be read"), ("deep.png", r"image .*deep\.png is in mode 'I;16'"),
             ("empty.npy", r"image empty\.npy has no area"),
             ("long.npy", r"clip \['long\.npy'\] has 5 frames, more than --max-frames=4"),
             ("ok.png", r"image ok\.png becomes 2 tokens at 56 x 28 pixels, more than a row of --seq-len=2 holds"),
             (["ok.png", "empty.npy"], "the frames of clip .* differ in size")]
    for entry, message in cases:
        source = write_jsonl(tmp_path / "in.jsonl", [{"text": "fine"}, {"text": "bad", "images": [entry]}])
        with pytest.raises(DataError, match=r"in\.jsonl:2: " + message):
            preprocess([source], tmp_path / "out", progress=False, rules=ImageRules(seq_len=2))
        assert not list(tmp_path.glob("out*"))  # nothing half-written
    rules = ImageRules(multiple=1)  # more pixels than a row of 1M tokens of 1 x 1 pixels holds
    Image.fromarray(np.zeros((1025, 1024), np.uint8)).save(tmp_path / "vast.png")
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": "bad", "images": ["vast.png"]}])
    with pytest.raises(DataError, match=r"in\.jsonl:1: image .*vast\.png has 1024 x 1025 pixels, more than any row"):
        preprocess([source], tmp_path / "out", progress=False, rules=rules)
    # In training: images of another channel count than the model's.
    save_image(tmp_path / "grey.npy", 1, (1, 28, 28))
    write_jsonl(tmp_path / "grey.jsonl", [{"text": "a", "images": ["grey.npy"]}])
    preprocess([tmp_path / "grey.jsonl"], tmp_path / "grey", progress=False)
    with pytest.raises(ConfigError, match=r"grey holds images of 1 channels, model.vision.channels=3"):
        PretrainingData(tiny_config(f"data.blend=[{{path: {tmp_path / 'grey'}}}]"))


def test_image_shapes_that_disagree_with_the_pixels_are_refused(dataset):
    shapes = np.load(f"{dataset}.images.shapes.npy")
    shapes[2] = (1, 3, 4, 4)
    np.save(f"{dataset}.images.shapes.npy", shapes)
    with pytest.raises(DataError, match=r"ds\.images\.bin: record 2 has an image of 2352 values, its shape "
                                        r"\[1, 3, 4, 4\] says 48"):
        IndexedDocuments(dataset)


def test_empty_and_unfinished_datasets_are_refused(tmp_path):
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(DataError, match=r"out: no documents were written \(empty input\)"):
        preprocess([empty], tmp_path / "out", progress=False)
    path = lettered_dataset(tmp_path, "ok", "a", [3])
    meta = json.loads(Path(f"{path}.json").read_text())
    Path(f"{path}.json").write_text(json.dumps({**meta, "documents": 0}))
    with pytest.raises(DataError, match=r"ok: the dataset is empty \(0 documents\)"):
        IndexedDocuments(path)
    Path(f"{path}.json").unlink()
    with pytest.raises(DataError, match=r"ok\.json: missing; .* not a dataset written by .*preprocess"):
        IndexedDocuments(path)


@pytest.mark.timeout(120)
def test_preprocess_command_line(tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS])
    done = subprocess.run([sys.executable, "-m", "moe_pretrain.data.preprocess", "--input", str(source),
                           "--output", str(tmp_path / "ds")], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout and "3 documents" in done.stdout and "[####" in done.stderr
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    failed = subprocess.run([sys.executable, "-m", "moe_pretrain.data.preprocess", "--input",
                             str(tmp_path / "bad.jsonl"), "--output", str(tmp_path / "bad")],
                            capture_output=True, text=True, timeout=100)
    assert failed.returncode == 1 and "bad.jsonl:2: not valid JSON" in failed.stderr
    assert not list(tmp_path.glob("bad.*bin"))


@pytest.mark.timeout(120)
def test_embedded_corpus_is_built_once_under_concurrency(tmp_path):
    """Two processes building the same cache at once: one builds, both use the same finished dataset."""
    code = ("import sys; from moe_pretrain.config import DataConfig; from moe_pretrain.log import setup_logging; "
            "from moe_pretrain.data.embedded import synthetic_image_dataset as s; setup_logging(); "
            f"print(s(DataConfig(cache_dir={str(tmp_path)!r}, embedded_images=3000), 3))")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=100) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    built = [out.strip().splitlines()[-1] for out, _ in outputs]  # the log line, if any, comes first
    assert built[0] == built[1]
    assert sum("INFO data: building" in out for out, _ in outputs) == 1
    assert len(IndexedDocuments(built[0])) == 3000
    assert not list(tmp_path.glob("*.tmp*"))
    prefix = synthetic_image_dataset(DataConfig(cache_dir=str(tmp_path), embedded_images=3000), 3)
    assert str(prefix) == built[0]  # reused, not rebuilt


def test_training_reads_a_preprocessed_blend(tmp_path):
    """A few steps on two preprocessed datasets: the loss falls and the stream position resumes."""
    a = lettered_dataset(tmp_path, "a", "ab", [40] * 30)
    b = lettered_dataset(tmp_path, "b", "cd", [40] * 30)
    from moe_pretrain.training import Trainer
    cfg = tiny_config(f"data.blend=[{{path: {a}}}, {{path: {b}}}]", "train.steps=12", "logging.progress=false",
                      f"train.run_dir={tmp_path / 'run'}", "data.image_fraction=0")
    history = run_training(Trainer(cfg))
    assert history[-1]["loss"] < history[0]["loss"] - 1.0
    assert torch.isfinite(torch.tensor([h["loss"] for h in history])).all()
