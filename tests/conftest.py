import os

import torch

# Triton kernels run under the interpreter on machines without CUDA.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Every engine built in the tests poisons padded buffers and validates metadata values
# (the descriptor contract) at every step.
os.environ.setdefault("RUNG_DEBUG_PADDING", "1")

# NOTE: tiny test models gain nothing from a second OpenMP thread, and on a busy 2-core
# machine a spinning second thread makes HF's oracle several times slower.
torch.set_num_threads(1)
