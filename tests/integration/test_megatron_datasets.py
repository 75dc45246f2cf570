"""Datasets Megatron-LM's own tools wrote (.bin / .idx from megatron-core's IndexedDatasetBuilder, no sidecar),
and Megatron-LM's --data-path blend form."""

import gc

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from moe_pretrain.config import ConfigError
from moe_pretrain.data import DataError, PretrainingData
from moe_pretrain.data.indexed import IndexedDocuments
from moe_pretrain.operations.run_loop import run_training
from moe_pretrain.training import Trainer
from tests.models import tiny_config

TEXT = b"def f(x):\n    return x * 2\n" * 8


def megatron_dataset(prefix, documents: list[list[bytes]], dtype=np.uint16) -> str:
    """Byte-tokenized documents as Megatron's preprocess_data.py writes them: one sequence per sentence
    (several per document when split), end_document() after each."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for sentences in documents:
        for sentence in sentences:
            builder.add_item(torch.tensor(list(sentence), dtype=torch.int64))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def test_a_megatron_dataset_reads_with_the_configured_tokenizer(tmp_path):
    prefix = megatron_dataset(tmp_path / "code", [[TEXT[:100]], [TEXT[:40], TEXT[40:90]], [TEXT[5:130]]])
    with pytest.raises(DataError, match=r"code\.json: missing; .* a Megatron \.bin / \.idx pair, set data\.tokenizer"):
        IndexedDocuments(prefix)
    dataset = IndexedDocuments(prefix, "byte")
    vocab = dataset.vocabulary
    assert len(dataset) == 3 and dataset.plain
    assert dataset.document_lengths(0).tolist() == [102, 92, 127]  # sentences of a document joined, + BOS / EOS
    assert dataset.document(1).tokens.tolist() == [vocab.bos, *TEXT[:90], vocab.eos]


def test_training_on_megatron_datasets_given_as_a_data_path(tmp_path):
    code = megatron_dataset(tmp_path / "code", [[TEXT[i:i + 150]] for i in range(0, 60, 3)])
    prose = megatron_dataset(tmp_path / "prose", [[b"a plain sentence. " * 5, b"and another one."]] * 20,
                             dtype=np.int32)
    cfg = tiny_config(f"data.blend=0.3 {code} 0.7 {prose}", "data.tokenizer=byte", "train.steps=2",
                      "logging.progress=false", f"train.run_dir={tmp_path / 'run'}", "data.seq_len=128")
    assert [(b.path, b.weight) for b in cfg.data.blend] == [(code, 0.3), (prose, 0.7)]
    batch = PretrainingData(cfg).next_batch(4)
    assert int(batch.image_mask.sum()) == 0 and batch.tokens.max() < 262
    history = run_training(Trainer(cfg))
    assert len(history) == 2 and all(np.isfinite(h["loss"]) for h in history)
    with pytest.raises(ConfigError, match=r"data\.blend='0\.3 /a 0\.7': expected weight / prefix pairs"):
        tiny_config("data.blend=0.3 /a 0.7")


def test_ids_outside_the_tokenizer_are_refused_naming_the_record(tmp_path):
    builder = IndexedDatasetBuilder(f"{tmp_path / 'bad'}.bin", dtype=np.uint16)
    for tokens in ([1, 2, 3], [4, 300]):
        builder.add_item(torch.tensor(tokens))
        builder.end_document()
    builder.finalize(f"{tmp_path / 'bad'}.idx")
    dataset = IndexedDocuments(str(tmp_path / "bad"), "byte")
    with pytest.raises(DataError, match=r"bad\.bin: record 1 holds token id 300, outside the 256 ids of its tokenizer"):
        dataset.document(1)


def test_an_empty_megatron_dataset_names_its_bin_in_one_error(tmp_path, capfd):
    """The .bin was empty: the error named the .idx and megatron-core's half-built reader printed two tracebacks."""
    prefix = megatron_dataset(tmp_path / "empty", [])
    with pytest.raises(DataError, match=r"empty\.bin: empty \(0 bytes\): the dataset .*empty holds no tokens$"):
        IndexedDocuments(prefix, "byte")
    gc.collect()  # a half-built reader's destructor would print here
    assert "Traceback" not in capfd.readouterr().err
