"""Data: learnable synthetic sets (the embedded defaults), token batches for Hugging Face tasks,
readers for CIFAR-10 and MNIST, any torch Dataset and local Hugging Face datasets.

Every `data` config option targets one of these factories; each returns a `TensorData` (held in
memory) or a `LoaderData` (through a DataLoader): both follow `memexp.data.tensors.Data`.
"""

from memexp.data.loader import LoaderData, dataset, hf_local
from memexp.data.readers import cifar10, mnist
from memexp.data.synthetic import synthetic_hf_tokens, synthetic_images, synthetic_tokens
from memexp.data.tensors import Batch, Columns, Data, Split, TensorData

__all__ = ["Batch", "Columns", "Data", "LoaderData", "Split", "TensorData", "cifar10", "dataset",
           "hf_local", "mnist", "synthetic_hf_tokens", "synthetic_images", "synthetic_tokens"]
