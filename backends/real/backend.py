"""`RealBackend`: every step the policy schedules is run through a real decoder with a paged KV
cache, and its measured time advances the simulated clock."""

from __future__ import annotations

import numpy as np

from backends.kv_capacity import activation_peak_bytes
from sim.backend import StepResult
from sim.batch import Batch
from sim.config import check_block_size
from sim.errors import ServesimError
from sim.tokens import TokenSpec

try:
    import torch
except ImportError:  # the one-line error names the extra to install
    raise ServesimError("the real backend needs torch (and triton on a GPU): pip install -e '.[real]'") from None

from backends.model_config import ModelConfig
from backends.real import kv_cache
from backends.real.model import Decoder, check_runnable
from backends.real.ops import TORCH_OPS, triton_ops
from backends.real.runner import ModelRunner
from backends.real.weights import init_random, load_safetensors

DEVICES = ("cpu", "cuda")


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.1f} GiB"


def _cpu_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "cpu"


def _cuda_free_bytes(device: "torch.device") -> tuple[int, int]:
    """(free, total) device memory, counting what this process's allocator holds unused as free
    (a backend built after another one was dropped finds that memory again)."""
    free, total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device), total


def num_parameters(cfg: ModelConfig) -> int:
    """The parameters the decoder holds, every expert of its MoE layers included: counted on a model
    built on torch's meta device (shapes only, no memory), so dense and MoE layers count alike."""
    return sum(p.numel() for p in Decoder(cfg, torch.float32, torch.device("meta")).parameters())


def _device(name: str) -> "torch.device":
    if name not in DEVICES:
        raise ServesimError(f"unknown device {name!r}; choose one of {', '.join(DEVICES)}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ServesimError(f"--device cuda: torch {torch.__version__} sees no CUDA GPU on this machine; "
                            "use --device cpu (or install a CUDA build of torch)")
    return torch.device(name)


class RealBackend:
    name = "real"
    supports_fast_forward = False  # every step is executed: sampled tokens feed the next one

    def __init__(self, model: str | ModelConfig, device: str = "cpu", block_size: int = 16,
                 num_blocks: int | None = None, seed: int = 0, weights: str | None = None, gpu_memory_utilization: float = 0.9, *,
                 max_num_batched_tokens: int = 2048, max_num_seqs: int = 256, cpu_threads: int | None = 1,
                 cuda_graphs: bool = True):
        """`cpu_threads`: torch's intra-op threads on the CPU (process-wide; None keeps torch's own
        choice). One by default: a toy model gains nothing from more, and its measured step times
        then stay steady when other processes share the cores. `cuda_graphs`: replay decode-only
        steps of up to `max_num_seqs` requests from captured CUDA graphs (GPU only)."""
        check_block_size(block_size)
        if num_blocks is not None and num_blocks < 1:
            raise ServesimError(f"--num-blocks must be at least 1, got {num_blocks}")
        self.cfg = model if isinstance(model, ModelConfig) else ModelConfig.from_preset(model)
        self.model_name = self.cfg.name
        check_runnable(self.cfg)
        self.device = _device(device)
        if self.device.type == "cpu" and cpu_threads is not None:
            torch.set_num_threads(cpu_threads)
        self.block_size = block_size
        is_cuda = self.device.type == "cuda"
        self.dtype = torch.bfloat16 if is_cuda else torch.float32
        element = torch.empty(0, dtype=self.dtype).element_size()
        weight_bytes = num_parameters(self.cfg) * element
        reserve = activation_peak_bytes(self.cfg, max_num_batched_tokens, max_num_seqs)  # vLLM's profile run's
        where = torch.cuda.get_device_name(self.device) if is_cuda else "this machine's memory"

        if is_cuda:
            free, total = _cuda_free_bytes(self.device)
            usable = free - total * (1.0 - gpu_memory_utilization)
        else:
            usable = _cpu_available_bytes() * gpu_memory_utilization
        if weight_bytes + reserve > usable:
            raise ServesimError(
                f"model {self.model_name} is too large for {where}: {_gib(weight_bytes)} of weights and "
                f"{_gib(reserve)} of activations, {_gib(max(usable, 0))} usable; choose a smaller model "
                f"(see `sim models`)")

        self.model = Decoder(self.cfg, self.dtype, self.device)
        if weights is None:
            init_random(self.model, seed)
        else:
            load_safetensors(self.model, weights)

        per_block = kv_cache.bytes_per_block(self.cfg, block_size, self.dtype)
        use_graphs = is_cuda and cuda_graphs
        num_scratch = 1 if use_graphs else 0  # the padding rows' block, past the block manager's ids
        if is_cuda:
            free, total = _cuda_free_bytes(self.device)
            budget = free - total * (1.0 - gpu_memory_utilization) - reserve
        else:
            budget = usable - weight_bytes - reserve
        if num_blocks is None:
            if not is_cuda:
                budget = min(budget, kv_cache.CPU_DEFAULT_CACHE_BYTES)
            num_blocks = int(budget // per_block) - num_scratch
            if num_blocks < 1:
                raise ServesimError(f"no room for a KV cache on {where}: one block of {block_size} tokens needs "
                                    f"{per_block / 2**20:.1f} MiB, {_gib(max(budget, 0))} is left after the weights")
        elif (num_blocks + num_scratch) * per_block > budget:
            raise ServesimError(f"--num-blocks {num_blocks} needs {_gib(num_blocks * per_block)} of KV cache; "
                                f"{_gib(max(budget, 0))} is left on {where} after the weights")
        self.num_blocks = num_blocks
        self.kv_caches = kv_cache.allocate(self.cfg, num_blocks + num_scratch, block_size, self.dtype, self.device)
        self.ops = triton_ops() if is_cuda else TORCH_OPS
        self.runner = ModelRunner(self.model, self.ops, self.kv_caches, block_size, self.device,
                                  TokenSpec(seed, self.cfg.vocab_size))
        self.device_name = torch.cuda.get_device_name(self.device) if is_cuda else _cpu_name()
        self._warm_up()
        self.cuda_graph_error: str | None = None  # why decode steps run eagerly although graphs were asked for
        if use_graphs:
            from backends.real.cuda_graphs import DecodeGraphs

            try:
                self.runner.graphs = DecodeGraphs(self.model, self.ops, self.kv_caches, block_size, self.device,
                                                  max_num_seqs, scratch_block=num_blocks)
            except RuntimeError as e:  # capture is refused by some drivers and setups: measure eagerly
                self.cuda_graph_error = str(e).splitlines()[0] if str(e) else type(e).__name__

    def _warm_up(self) -> None:
        """Run one step of each kind once, so that Triton's compilation (one variant per attention tile
        shape, with and without split-KV) and lazy initialisation are never measured as a step. The
        blocks written here are overwritten by their next owner before anyone reads them."""
        longest = 1024 if self.device.type == "cuda" else 256  # a long decode is split on a GPU
        n = min(self.num_blocks * self.block_size, longest)
        if n < 4:
            return
        table = list(range(-(-n // self.block_size)))
        tokens = np.arange(n, dtype=np.int64) % self.cfg.vocab_size
        steps = [[("a", 0, n - 1, False)],  # a long prefill chunk
                 [("a", n - 1, 1, True), ("b", 0, 2, False)],  # a decode beside a short chunk
                 [("b", 2, 1, True)],  # a short decode-only step
                 [("a", n - 1, 1, True)]]  # a long decode-only step
        for step in steps:
            batch = Batch()
            for request_id, num_computed, num_scheduled, is_decode in step:
                batch.add(request_id, num_computed, num_scheduled, table, needs_logits=True, is_decode=is_decode,
                          token_source=tokens)
            self.runner.execute(batch)

    def execute(self, batch: Batch) -> StepResult:
        sampled, parts = self.runner.execute(batch)
        return StepResult(sum(parts.values()), parts, sampled_token_ids=sampled)
