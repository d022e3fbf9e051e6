"""Shared test setup: without a GPU, Triton kernels run on CPU tensors in Triton's
interpreter, which must be switched on before anything imports triton."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
