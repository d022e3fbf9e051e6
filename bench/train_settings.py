"""
What every benchmark sets up the way train.py does, so a benchmark measures
what training runs (the fused Linear's timed choice included).

    import train_settings; train_settings.set_training_precision()
"""

import torch


def set_training_precision():
    """TF32 for fp32 matmuls and cuDNN convolutions, as train.py sets it (its two `allow_tf32 = True` lines;
    tests/test_layers_fused_gpu_paths.py checks they still match)."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
