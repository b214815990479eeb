"""Data: learnable synthetic sets (the embedded defaults) and readers for CIFAR-10 and MNIST.

Every `data` config option targets one of these factories; each returns a `TensorData`.
"""

from memexp.data.readers import cifar10, mnist
from memexp.data.synthetic import synthetic_images, synthetic_tokens
from memexp.data.tensors import Batch, Split, TensorData

__all__ = ["Batch", "Split", "TensorData", "cifar10", "mnist", "synthetic_images",
           "synthetic_tokens"]
