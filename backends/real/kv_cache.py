"""The paged KV cache: per layer, K and V as `[num_blocks, block_size, num_kv_heads, head_dim]`.

Block ids are the simulator's: the block manager hands out ids in [0, num_blocks), the batch's
block tables carry them, and the attention kernel reads exactly those blocks.
"""

from __future__ import annotations

import numpy as np
import torch

from backends.model_config import ModelConfig

# On the CPU the cache is a toy: at most this much, unless --num-blocks asks for more.
CPU_DEFAULT_CACHE_BYTES = 1 << 30


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block over all layers."""
    element = torch.empty(0, dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * element


def allocate(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
             device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed caches, one (K, V) pair per layer. On the CPU numpy's zeros are calloc'ed, so pages
    the run never touches cost nothing."""
    shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)

    def zeros():
        if device.type == "cpu" and dtype == torch.float32:
            return torch.from_numpy(np.zeros(shape, dtype=np.float32))
        return torch.zeros(shape, dtype=dtype, device=device)

    return [(zeros(), zeros()) for _ in range(cfg.num_hidden_layers)]
