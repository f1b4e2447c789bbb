"""Datasets with stable sample ids (importing this package registers the built-in sources)."""
from pipeline.data.sampleset import SampleIdError, SampleSet
from pipeline.data.sources import SOURCES, MissingSourceError, load_source, register_source
from pipeline.data import fashion_mnist, image_folder, parquet, synthetic_identities, text_corpora  # noqa: E402,F401  (register)

__all__ = ["SampleSet", "SampleIdError", "SOURCES", "MissingSourceError", "load_source", "register_source"]
