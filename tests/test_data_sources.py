"""Every data source loads offline with stable ids that name the source's own rows."""
from __future__ import annotations

import gzip
import os

import numpy as np
import pandas as pd
import pytest
import torch

from pipeline.data import MissingSourceError, load_source
from pipeline.data.fashion_mnist import DEFAULT_ROOT, fashion_mnist_dataset, read_idx
from pipeline.data.image_folder import image_folder_dataset
from pipeline.data.parquet import parquet_dataset
from pipeline.data.sources import digits_dataset
from pipeline.data.text_corpora import corpus_dataset, corpus_file
from pipeline.hf_local import load_tokenizer


def test_offline_environment():
    assert os.environ.get("HF_HUB_OFFLINE") == "1" and os.environ.get("HF_DATASETS_OFFLINE") == "1"


def _same(a, b):
    return all(torch.equal(a[s].sample_ids, b[s].sample_ids) for s in a) and \
        all(torch.equal(a[s].columns[k], b[s].columns[k]) for s in a for k in a[s].columns)


@pytest.mark.parametrize("corpus", ["reuters-r8", "20newsgroups"])
def test_text_corpus_ids_are_file_rows(corpus):
    options = {"max_length": 32, "per_class": 3, "test_per_class": 2, "seed": 1}
    first, second = load_source(corpus, options), load_source(corpus, dict(options))
    assert _same(first, second)
    frame = pd.read_csv(corpus_file(corpus, "train"), sep="\t", skiprows=[1, 2], dtype=str, keep_default_na=False)
    ds = corpus_dataset(corpus, per_class=3, test_per_class=2, seed=1)["train"]
    names = ds.features["label"].names
    tok = load_tokenizer("all-MiniLM-L6-v2")
    train = first["train"]
    assert train.sample_ids.tolist() == ds["sample_id"]
    for pos in (0, len(train) - 1):
        sid = int(train.sample_ids[pos])
        assert names[int(train.columns["y"][pos])] == frame["Category"][sid]
        expected = tok(frame["Text"][sid], truncation=True, max_length=32)["input_ids"]
        got = train.columns["input_ids"][pos][train.columns["attention_mask"][pos].bool()].tolist()
        assert got == expected
    assert train.columns["input_ids"].shape[1] <= 32
    assert len(set(train.columns["y"].tolist())) == len(names)


def test_reuters_r8_full_split_sizes():
    ds = corpus_dataset("reuters-r8")
    assert (len(ds["train"]), len(ds["test"])) == (5485, 2189)
    assert ds["train"].features["label"].names == ["acq", "crude", "earn", "grain", "interest", "money-fx", "ship", "trade"]
    assert ds["train"]["sample_id"][:3] == [0, 1, 2]


def test_fashion_mnist_ids_are_file_rows():
    options = {"classes": [7, 2], "per_class": 5, "test_per_class": 3, "image_size": 16, "channels": 3, "seed": 4}
    first, second = load_source("fashion-mnist", options), load_source("fashion-mnist", dict(options))
    assert _same(first, second)
    images = read_idx(DEFAULT_ROOT / "train-images-idx3-ubyte.gz")
    labels = read_idx(DEFAULT_ROOT / "train-labels-idx1-ubyte.gz")
    train = first["train"]
    assert len(train) == 10 and train.columns["x"].shape == (10, 3, 16, 16)
    ids = train.sample_ids.numpy()
    assert np.array_equal(labels[ids], train.columns["label_orig"].numpy())
    assert set(labels[ids].tolist()) == {7, 2}
    assert np.array_equal(np.where(labels[ids] == 7, 0, 1), train.columns["y"].numpy())  # order of classes
    raw = fashion_mnist_dataset(classes=[7, 2], per_class=5, test_per_class=3, seed=4)["train"]
    assert np.array_equal(np.asarray(raw.with_format("numpy")["image"]), images[ids])
    full = load_source("fashion-mnist", {"per_class": 2, "flatten": True, "normalize": False})
    assert full["train"].columns["x"].shape == (20, 784)
    pos = 0
    assert torch.allclose(full["train"].columns["x"][pos] * 255, torch.from_numpy(images[int(full["train"].sample_ids[pos])].reshape(-1)).float())


def test_fashion_mnist_missing_files_name_the_package(tmp_path):
    with pytest.raises(MissingSourceError, match="apt-get install dataset-fashion-mnist"):
        load_source("fashion-mnist", {"root": str(tmp_path)})


def test_digits_ids_and_image_options():
    from sklearn.datasets import load_digits

    a, b = load_source("digits", {"image_size": 16, "channels": 3}), load_source("digits", {"image_size": 16, "channels": 3})
    assert _same(a, b)
    assert a["train"].columns["x"].shape[1:] == (3, 16, 16)
    flat = load_source("digits")
    bunch = load_digits()
    ids = flat["test"].sample_ids.numpy()
    assert np.allclose(flat["test"].columns["x"].numpy(), bunch.data[ids] / 16.0)
    assert digits_dataset()["test"]["sample_id"] == ids.tolist()


def test_parquet_with_features_multilabel_and_text(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({
        "sample_id": [40, 10, 30, 20], "a": [1.0, 2.0, 3.0, 4.0], "b": [[0.0, 1.0]] * 4,
        "tags": [[0], [1, 2], [], [2]], "label": [0, 1, 1, 0],
        "text": ["grain prices rose", "oil output", "the bank cut rates", "ship sank"],
    })
    pq.write_table(table, tmp_path / "train.parquet")
    dense = load_source("parquet", {"path": str(tmp_path / "train.parquet"), "features": ["a", "b"]})["train"]
    assert dense.sample_ids.tolist() == [40, 10, 30, 20]
    assert dense.columns["x"][1].tolist() == [2.0, 0.0, 1.0] and dense.columns["y"].tolist() == [0, 1, 1, 0]
    multi = load_source("parquet", {"path": str(tmp_path / "train.parquet"), "features": ["a"], "label_column": "tags",
                                    "label_type": "multilabel", "num_labels": 3})["train"]
    assert multi.columns["y"].tolist()[1] == [0.0, 1.0, 1.0]
    text = load_source("parquet", {"path": {"train": str(tmp_path / "train.parquet")}, "text_column": "text",
                                   "tokenizer": "all-MiniLM-L6-v2", "max_length": 8})["train"]
    assert text.columns["input_ids"].shape[0] == 4 and text.columns["input_ids"][0, 0] == 101
    with pytest.raises(ValueError, match="exactly one of"):
        load_source("parquet", {"path": str(tmp_path / "train.parquet")})
    pq.write_table(table.drop(["sample_id"]), tmp_path / "noid.parquet")
    with pytest.raises(ValueError, match="ids_from_rows"):
        parquet_dataset(path=str(tmp_path / "noid.parquet"), features=["a"])
    rows = load_source("parquet", {"path": str(tmp_path / "noid.parquet"), "features": ["a"], "ids_from_rows": True})
    assert rows["train"].sample_ids.tolist() == [0, 1, 2, 3]


def test_image_folder_ids_are_sorted_paths(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, people in (("train", ["bob", "alice"]), ("test", ["alice", "bob"])):
        for person in people:
            (tmp_path / split / person).mkdir(parents=True)
            for k in range(2):
                arr = rng.integers(0, 255, (20, 12, 3), dtype=np.uint8)
                Image.fromarray(arr).save(tmp_path / split / person / f"{k}.{'png' if k == 0 else 'jpg'}")
    options = {"root": str(tmp_path), "image_size": 16, "channels": 3}
    a, b = load_source("image-folder", options), load_source("image-folder", dict(options))
    assert _same(a, b)
    ds = image_folder_dataset(root=str(tmp_path), image_size=16)
    paths = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.*"))
    for split in ("train", "test"):
        for sid, path in zip(ds[split]["sample_id"], ds[split]["path"]):
            assert paths[sid] == path
    assert a["test"].sample_ids.tolist() == [0, 1, 2, 3] and a["train"].sample_ids.tolist() == [4, 5, 6, 7]
    assert a["train"].columns["y"].tolist() == [0, 0, 1, 1]  # alice = 0, bob = 1 (sorted names)
    assert a["train"].columns["x"].shape == (4, 3, 16, 16)
    flat = tmp_path / "flat"
    for person in ("p1", "p2"):
        (flat / person).mkdir(parents=True)
        for k in range(3):
            Image.fromarray(rng.integers(0, 255, (8, 8), dtype=np.uint8)).save(flat / person / f"{k}.png")
    split = load_source("image-folder", {"root": str(flat), "image_size": 8, "channels": 1, "test_every": 3})
    assert split["test"].sample_ids.tolist() == [0, 3] and len(split["train"]) == 4


def test_unknown_source_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown; choose one of"):
        load_source("imagenet")


def test_gzip_idx_reader_roundtrip(tmp_path):
    data = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    header = bytes([0, 0, 8, 3]) + b"".join(int(d).to_bytes(4, "big") for d in data.shape)
    with gzip.open(tmp_path / "x.gz", "wb") as fh:
        fh.write(header + data.tobytes())
    assert np.array_equal(read_idx(tmp_path / "x.gz"), data)
