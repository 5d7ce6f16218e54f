import os

import torch

# Triton kernels run under the interpreter on machines without CUDA.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Every engine built in the tests poisons padded buffers and validates metadata values
# (the descriptor contract) at every step.
os.environ.setdefault("RUNG_DEBUG_PADDING", "1")

torch.set_num_threads(min(2, torch.get_num_threads()))
