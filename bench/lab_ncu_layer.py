"""Lab (kept in history only): one full-size layer's gluon experts at N tokens, run a few times, for ncu."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_expert_kernels import random_layer, routed_inputs  # noqa: E402

layer = random_layer(False, seed=3)
layer.to_fragment_order()
inputs = routed_inputs(int(sys.argv[1]), seed=5)
for _ in range(3):
    layer.forward_fragments(*inputs)
torch.cuda.synchronize()
