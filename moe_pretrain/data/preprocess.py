"""Turn text and JSONL files into an indexed dataset: `python -m moe_pretrain.data.preprocess`.

    python -m moe_pretrain.data.preprocess --input corpus.jsonl notes.txt --output data/mix \\
        [--tokenizer byte | hf:tokenizer.json | tiktoken:cl100k_base.tiktoken] [--text-key text]

A .jsonl file gives one document per line: {"text": "...", "images": ["a.npy", "b.png"]}. Each "<image>"
in the text marks where the next image goes; with no markers the images come first (a captioned image).
Images are uint8 [C, H, W] .npy arrays, or PNG/JPEG files when Pillow is installed, relative to the JSONL
file's folder; every image of a dataset has one shape. Any other file is one document of text.
Nothing is downloaded: tokenizer files are read from the paths given.
"""

import argparse
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from moe_pretrain.data.indexed import DataError, DatasetWriter
from moe_pretrain.data.tokenizers import Tokenizer, load_tokenizer
from moe_pretrain.progress import bar, show

IMAGE_MARKER = "<image>"


class Progress:
    """Bytes of input done, redrawn in place on a terminal, a line every few seconds in a log."""

    def __init__(self, total: int, stream=sys.stderr, every_s: float = 5.0):
        self.total, self.stream = max(total, 1), stream
        self.start = self.last = time.perf_counter()
        self.every_s = 0.2 if stream.isatty() else every_s

    def update(self, done: int, documents: int, final: bool = False) -> None:
        now = time.perf_counter()
        if not final and now - self.last < self.every_s:
            return
        self.last = now
        rate = done / max(now - self.start, 1e-9) / 2**20
        show(f"{bar(done, self.total)} {done / 2**20:,.1f}/{self.total / 2**20:,.1f} MiB {documents:,} documents "
             f"{rate:,.1f} MiB/s", self.stream, final)


def load_image(path: Path, where: str) -> np.ndarray:
    """uint8 [C, H, W] from a .npy array or (with Pillow) an image file."""
    if not path.is_file():
        raise DataError(f"{where}: image file {path} not found")
    if path.suffix == ".npy":
        image = np.load(path, allow_pickle=False)
    else:
        try:
            from PIL import Image
        except ImportError as err:
            raise DataError(f"{where}: {path.name} needs Pillow (pip install pillow), or give a .npy array") from err
        with Image.open(path) as picture:
            image = np.asarray(picture.convert("RGB")).transpose(2, 0, 1)
    if image.dtype != np.uint8 or image.ndim != 3:
        raise DataError(f"{where}: image {path} must be uint8 [C, H, W], got {image.dtype} {list(image.shape)}")
    return image


def encode_record(text: str, images: list[np.ndarray], tokenizer: Tokenizer, where: str) -> list[int]:
    """Body ids: the text with an IMAGE_START, IMAGE_END pair at each <image> (or all images first)."""
    vocab = tokenizer.vocabulary
    pieces = text.split(IMAGE_MARKER)
    if len(pieces) == 1:
        pieces = [""] * len(images) + pieces
    if len(pieces) - 1 != len(images):
        raise DataError(f"{where}: {len(pieces) - 1} {IMAGE_MARKER} markers but {len(images)} images")
    body = tokenizer.encode(pieces[0]) if pieces[0] else []
    for piece in pieces[1:]:
        body += [vocab.image_start, vocab.image_end]
        body += tokenizer.encode(piece) if piece else []
    return body


def jsonl_records(path: Path, text_key: str, images_key: str) -> Iterator[tuple[str, list[np.ndarray], str, int]]:
    with path.open("rb") as lines:
        for number, line in enumerate(lines, start=1):
            where = f"{path}:{number}"
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{where}: not valid JSON ({err.msg})") from err
            text = record.get(text_key) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise DataError(f"{where}: no string field {text_key!r}")
            images = [load_image(path.parent / name, where) for name in record.get(images_key, [])]
            yield text, images, where, len(line)


def records(path: Path, text_key: str, images_key: str) -> Iterator[tuple[str, list[np.ndarray], str, int]]:
    if path.suffix == ".jsonl":
        yield from jsonl_records(path, text_key, images_key)
        return
    data = path.read_bytes()
    try:
        yield data.decode("utf-8"), [], str(path), len(data)
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text (byte {err.start})") from err


def preprocess(inputs: list[Path], output: Path, tokenizer_spec: str = "byte", text_key: str = "text",
               images_key: str = "images", progress: bool = True) -> DatasetWriter:
    """Write the dataset; on any error nothing is left under the output prefix."""
    for path in inputs:
        if not path.is_file():
            raise DataError(f"{path}: input file not found")
    tokenizer = load_tokenizer(tokenizer_spec)
    writer = DatasetWriter(output, tokenizer.vocabulary)
    bar = Progress(sum(p.stat().st_size for p in inputs)) if progress else None
    done = 0
    try:
        for path in inputs:
            for text, images, where, size in records(path, text_key, images_key):
                writer.add(encode_record(text, images, tokenizer, where), images, where)
                done += size
                if bar:
                    bar.update(done, writer.documents)
        writer.finalize()
    except BaseException:
        writer.abort()
        raise
    if bar:
        bar.update(done, writer.documents, final=True)
    return writer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_pretrain.data.preprocess", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, type=Path, help=".jsonl or text files")
    parser.add_argument("--output", required=True, type=Path, help="dataset prefix: writes PREFIX.bin/.idx/.json")
    parser.add_argument("--tokenizer", default="byte", help="byte | hf:<tokenizer.json> | tiktoken:<file>")
    parser.add_argument("--text-key", default="text")
    parser.add_argument("--images-key", default="images")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        writer = preprocess(args.input, args.output, args.tokenizer, args.text_key, args.images_key,
                            not args.no_progress)
    except (DataError, ValueError, FileNotFoundError, ImportError) as err:
        print(f"preprocess: {err}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}: {writer.documents} documents, {writer.tokens} tokens, {writer.image_count} images "
          f"({writer.vocabulary.kind} tokenizer, vocabulary {writer.vocabulary.size})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
