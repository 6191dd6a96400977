"""Input pipelines: SentencePiece tokenizers, TFDS datasets (built-in EN->FR and stdlib LM
corpora, user files, WMT, LM1B) and packed, resumable, per-host grain loading."""

from transformer_jax.data.errors import DataError
from transformer_jax.data.inputs import (
    DATASET_NAMES,
    Datasets,
    build_datasets,
    default_dataset_config,
)
from transformer_jax.data.packing import FirstFitPackIterDataset, make_row
from transformer_jax.data.pipeline import (
    Features,
    checkpoint_args,
    make_eval_batches,
    make_train_iterator,
    to_global_batch,
)
from transformer_jax.data.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    Tokenizer,
    get_or_train_tokenizer,
)

__all__ = [
    "BOS_ID", "DATASET_NAMES", "EOS_ID", "PAD_ID", "UNK_ID", "DataError", "Datasets", "Features",
    "FirstFitPackIterDataset", "Tokenizer", "build_datasets", "checkpoint_args",
    "default_dataset_config", "get_or_train_tokenizer", "make_eval_batches", "make_row",
    "make_train_iterator", "to_global_batch",
]
