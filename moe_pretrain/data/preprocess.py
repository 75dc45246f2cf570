"""Turn text and JSONL files into an indexed dataset: `python -m moe_pretrain.data.preprocess`.

    python -m moe_pretrain.data.preprocess --input corpus.jsonl notes.txt --output data/mix \\
        [--tokenizer byte | hf:tokenizer.json | tiktoken:cl100k_base.tiktoken] [--text-key text]

A .jsonl file gives one document per line: {"text": "...", "images": ["a.npy", "b.png", ["f0.png", "f1.png"]]}.
Each "<image>" in the text marks where the next image goes; with no markers the images come first (a captioned
image). An image is a uint8 [C, H, W] .npy array (a clip: [t, C, H, W]), or an image file (PNG, JPEG, ...: needs
Pillow), or a list of frame files of one size (a clip of up to --max-frames frames), relative to the JSONL
file's folder. Images keep their own size and aspect ratio (native resolution): each is only resized to sides
that are multiples of --image-multiple (the model's patch x merge, 28 for the model class) and, if larger, to fit
--max-image-pixels (default the release's 3584 x 3584); training may shrink them further (data.max_image_pixels).
A bad image (missing, truncated or unreadable, of no area, in a mode with more than 8 bits per channel, more
frames than allowed, more pixels than any row can hold, or with --seq-len more tokens than such a row) stops the
run naming the file and the JSONL line. Any other input file is one document of text.
Nothing is downloaded: tokenizer files are read from the paths given.
"""

import argparse
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe_pretrain.data.image_size import RELEASE_MAX_PIXELS, fitted_size, resize
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


LONGEST_ROW = 1 << 20
"""Tokens of the model class's longest rows (its 1M-token stage)."""

EIGHT_BIT_MODES = frozenset({"1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr", "LAB",
                             "HSV"})
"""Pillow modes of at most 8 bits per channel: converting them to RGB loses nothing the model could use."""


@dataclass(frozen=True)
class ImageRules:
    """How preprocess sizes images, and which it refuses (the module docstring)."""

    max_pixels: int = RELEASE_MAX_PIXELS
    multiple: int = 28
    max_frames: int = 4
    seq_len: int | None = None
    """The shortest rows the dataset will be trained in: an image whose tokens (and two markers) exceed one
    stops preprocess (None: no check)."""

    @property
    def max_source_pixels(self) -> int:
        """More pixels than this fill more than the longest row at full resolution: refused before decoding."""
        return LONGEST_ROW * self.multiple * self.multiple


def _read_picture(path: Path, where: str, rules: ImageRules) -> np.ndarray:
    """uint8 [3, H, W] from an image file (Pillow), with its failures named."""
    try:
        from PIL import Image
    except ImportError as err:
        raise DataError(f"{where}: {path.name} needs Pillow (pip install pillow), or give a .npy array") from err
    Image.MAX_IMAGE_PIXELS = rules.max_source_pixels  # Pillow reads the header only, then we refuse past it
    too_large = (f"more than any row can hold ({rules.max_source_pixels} = {LONGEST_ROW} tokens of "
                 f"{rules.multiple} x {rules.multiple})")
    try:
        with Image.open(path) as picture:
            if picture.width * picture.height > rules.max_source_pixels:
                raise DataError(f"{where}: image {path} has {picture.width} x {picture.height} pixels, {too_large}")
            if picture.mode not in EIGHT_BIT_MODES:
                raise DataError(f"{where}: image {path} is in mode {picture.mode!r} (more than 8 bits per channel or "
                                "not a colour image); convert it to 8-bit RGB or greyscale")
            picture.load()  # a truncated file fails here, not later in training
            return np.asarray(picture.convert("RGB")).transpose(2, 0, 1)
    except DataError:
        raise
    except Image.DecompressionBombError as err:
        raise DataError(f"{where}: image {path} has {err}: {too_large}") from err
    except (OSError, SyntaxError, ValueError) as err:
        raise DataError(f"{where}: image {path} cannot be read ({err})") from err


def _read_array(path: Path, where: str) -> np.ndarray:
    try:
        image = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise DataError(f"{where}: image {path} cannot be read ({err})") from err
    if image.dtype != np.uint8 or image.ndim not in (3, 4):
        raise DataError(f"{where}: image {path} must be uint8 [C, H, W] or a clip [t, C, H, W], got {image.dtype} "
                        f"{list(image.shape)}")
    return image


def load_image(entry: str | list[str], folder: Path, where: str, rules: ImageRules = ImageRules()) -> np.ndarray:
    """uint8 [C, H, W] (or a clip [t, C, H, W]) at the size it is stored at: a .npy array, an image file, or a
    list of frame files of one size; each side a multiple of rules.multiple, within rules.max_pixels."""
    names = entry if isinstance(entry, list) else [entry]
    if not names or not all(isinstance(name, str) for name in names):
        raise DataError(f"{where}: an image is a file name or a list of frame file names, got {entry!r}")
    frames = []
    for name in names:
        path = folder / name
        if not path.is_file():
            raise DataError(f"{where}: image file {path} not found")
        frames.append(_read_array(path, where) if path.suffix == ".npy" else _read_picture(path, where, rules))
    if len({frame.shape for frame in frames}) > 1:
        raise DataError(f"{where}: the frames of clip {names} differ in size: {[list(f.shape) for f in frames]}")
    image = frames[0] if len(frames) == 1 else np.stack(frames)
    t, _, H, W = (1, *image.shape) if image.ndim == 3 else image.shape
    if 0 in image.shape:
        raise DataError(f"{where}: image {names[0]} has no area ({list(image.shape)})")
    if t > rules.max_frames:
        raise DataError(f"{where}: clip {names} has {t} frames, more than --max-frames={rules.max_frames}")
    if H * W > rules.max_source_pixels:
        raise DataError(f"{where}: image {names[0]} has {W} x {H} pixels, more than any row can hold")
    h, w = fitted_size(H, W, rules.max_pixels, rules.multiple)
    tokens = h * w // (rules.multiple * rules.multiple)
    if rules.seq_len is not None and tokens + 2 > rules.seq_len + 1:
        raise DataError(f"{where}: image {names[0]} becomes {tokens} tokens at {w} x {h} pixels, more than a row of "
                        f"--seq-len={rules.seq_len} holds; lower --max-image-pixels")
    return resize(image, h, w)


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


def jsonl_records(path: Path, text_key: str, images_key: str, rules: ImageRules
                  ) -> Iterator[tuple[str, list[np.ndarray], str, int]]:
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
            entries = record.get(images_key, [])
            if not isinstance(entries, list):
                raise DataError(f"{where}: {images_key!r} must be a list of images")
            images = [load_image(entry, path.parent, where, rules) for entry in entries]
            yield text, images, where, len(line)


def records(path: Path, text_key: str, images_key: str, rules: ImageRules
            ) -> Iterator[tuple[str, list[np.ndarray], str, int]]:
    if path.suffix == ".jsonl":
        yield from jsonl_records(path, text_key, images_key, rules)
        return
    data = path.read_bytes()
    try:
        yield data.decode("utf-8"), [], str(path), len(data)
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text (byte {err.start})") from err


def preprocess(inputs: list[Path], output: Path, tokenizer_spec: str = "byte", text_key: str = "text",
               images_key: str = "images", progress: bool = True, rules: ImageRules = ImageRules()) -> DatasetWriter:
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
            for text, images, where, size in records(path, text_key, images_key, rules):
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
    parser.add_argument("--max-image-pixels", type=int, default=RELEASE_MAX_PIXELS,
                        help="images larger than this are shrunk to it, aspect ratio kept (default 3584 x 3584)")
    parser.add_argument("--image-multiple", type=int, default=28,
                        help="image sides are multiples of this: the model's patch size x merge (14 x 2)")
    parser.add_argument("--max-frames", type=int, default=4, help="most frames of a clip")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="refuse an image that alone fills a row of this many tokens")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        rules = ImageRules(args.max_image_pixels, args.image_multiple, args.max_frames, args.seq_len)
        writer = preprocess(args.input, args.output, args.tokenizer, args.text_key, args.images_key,
                            not args.no_progress, rules)
    except (DataError, ValueError, FileNotFoundError, ImportError) as err:
        print(f"preprocess: {err}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}: {writer.documents} documents, {writer.tokens} tokens, {writer.image_count} images "
          f"({writer.vocabulary.kind} tokenizer, vocabulary {writer.vocabulary.size})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
