"""Data layer: Megatron's indexed datasets, tokenizers, GPT/BERT sample builders and blends."""

from .bert_dataset import BertDataset
from .blend import BlendedDataset, blending_indices, parse_data_path
from .build import build_datasets, check_vocab, parse_split, split_document_ranges
from .gpt_dataset import GPTDataset
from .indexed_dataset import IndexedDataset, IndexedDatasetBuilder, best_fitting_dtype
from .tokenizers import Tokenizer, build_tokenizer

__all__ = [
    "BertDataset",
    "BlendedDataset",
    "GPTDataset",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "Tokenizer",
    "best_fitting_dtype",
    "blending_indices",
    "build_datasets",
    "build_tokenizer",
    "check_vocab",
    "parse_data_path",
    "parse_split",
    "split_document_ranges",
]
