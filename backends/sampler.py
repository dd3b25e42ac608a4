"""The sampler: the kernels vLLM's GPU runs after the LM head each step, by the requests' sampling
parameters and the vLLM version.

A benchmark's requests share their sampling parameters, so one path of vLLM's sampler runs every step:

- **greedy** (temperature 0: `vllm bench serve` sent it by default up to vLLM 0.14, and InferenceMAX's
  benchmark_serving.py sends `"temperature": 0.0`; from 0.15 `vllm bench serve` sends no sampling
  parameters unless given them): `Sampler.forward` casts the logits to fp32 and
  `Sampler.sample` takes their argmax (`all_greedy`; vllm/v1/sample/sampler.py).
- **random** (a temperature, no top-k or top-p): the temperature's division, a softmax, and
  `random_sample`: an exponential draw, a division and an argmax (vllm/v1/sample/ops/topk_topp_sampler.py,
  `TopKTopPSampler.forward_native`).
- **top-k** / **top-p** (with or without top-k): the mask that keeps the top k tokens or the top-p
  nucleus, before the draw. Which kernels do it depends on the version:
  - vLLM up to 0.16 (and 0.17-0.21 for batches under 8 rows): PyTorch. With a top-p,
    `apply_top_k_top_p` sorts the whole [rows, vocab] fp32 tensor (`logits.sort`), masks it and scatters
    it back; with a top-k alone, `apply_top_k_only` takes a `topk`. FlashInfer's sampler was opt-in
    (`VLLM_USE_FLASHINFER_SAMPLER`, default off: vllm/envs.py).
  - vLLM 0.17 to 0.21, 8 rows or more: vLLM's Triton kernel (`apply_top_k_top_p_triton`,
    vllm/v1/sample/ops/topk_topp_triton.py) instead of the sort.
  - vLLM 0.22 on: FlashInfer's rejection sampling by default (`VLLM_USE_FLASHINFER_SAMPLER` defaults to
    on; `TopKTopPSampler.forward_cuda`, `flashinfer_sample`).
  (The versions read from each release's vllm/envs.py and topk_topp_sampler.py, 0.11.2 to 0.34.0.)

A client that sends no sampling parameters (genai-perf, AIPerf: only the lengths) gets the server's defaults,
which vLLM takes from the model's `generation_config.json` (`ModelConfig.generation_config = "auto"`,
`get_diff_sampling_param`; the OpenAI server's `default_sampling_params`): Qwen3's sets temperature 0.6,
top_p 0.95 and top_k 20, so every step of such a benchmark on vLLM 0.12 sorts its logits.

Each kernel is priced as the dense model prices its elementwise kernels: the tables' kernel floor plus its
bytes over the tables' HBM bandwidth (`SamplerKernels.seconds`). The bytes are counted from the code, per
element of the [rows, vocab] logits; the sort from PyTorch's `launch_stable_sort_kernel`
(aten/src/ATen/native/cuda/Sort.cu): under 128 rows `segmented_sort_pairs_by_full_sort` (an index fill, a
radix sort of the fp32 keys with 8-byte values: a histogram and four 8-bit passes, a radix sort of the
segment ids, a gather: 156 bytes an element). From 128 rows PyTorch runs cub's segmented radix sort instead,
which a published measurement shows no cheaper per element (vllm-project/vllm#40376: 64 rows of 131,072
logits in 1.06 ms, 128 rows in 2.35 ms), so the same bytes are counted. Priced so, 128 rows of 151,936
logits take 1.9 ms on an H100 (2.98 TB/s, 2.45 us a kernel): the sort path moves 274 bytes an element where
the greedy path moves 12. That measurement (its GPU not named) gives 2.0-2.4 ms for 128 x 131,072 logits,
so the byte count is a lower bound of the sort's time (a radix sort does not stream at the full
bandwidth); FlashInfer's path at 0.35 ms in the same measurement is 63 bytes an element at 2.98 TB/s, close
to the 62 counted here.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sim.config import vllm_release
from sim.errors import ServesimError
from sim.jsonable import read_json_file

SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it is greedy (vllm/sampling_params.py)
TRITON_FROM_ROWS = 8  # vLLM 0.17-0.21 apply_top_k_top_p: `HAS_TRITON and logits.shape[0] >= 8`
TRITON_SINCE = (0, 17)  # apply_top_k_top_p_triton's first release
FLASHINFER_DEFAULT_SINCE = (0, 22)  # VLLM_USE_FLASHINFER_SAMPLER defaults to on


@dataclass(frozen=True)
class SamplerKernels:
    """One step's sampler: `kernels` launches moving `bytes_per_element` bytes per logits element."""

    kernels: int
    bytes_per_element: float

    def seconds(self, rows, vocab: int, floor_s: float, bandwidth: float):
        """Seconds for `rows` logits rows (an array or a number); 0 for no rows."""
        n = np.asarray(rows, dtype=np.float64)
        # Each kernel its floor and its share of the bytes (greedy's three 4-byte passes give, bit for bit,
        # what every step was priced before sampling was modelled)
        per_kernel = self.bytes_per_element / self.kernels
        return np.where(n > 0, self.kernels * (floor_s + n * vocab * per_kernel / bandwidth), 0.0)


# Bytes per logits element and kernels of each piece (read + write, 4-byte fp32 values, 8-byte int64 indices).
CAST_AND_ARGMAX = SamplerKernels(3, 12.0)  # greedy: the bf16 -> fp32 cast (6) and the argmax (4), priced as
# three 4-byte passes, as servesim priced every step's sampler before sampling parameters were modelled
RANDOM = SamplerKernels(6, 46.0)  # cast 6, temperature div_ 8, softmax 12, exponential_ 4, div_ 12, argmax 4
SORT = SamplerKernels(11, 156.0)  # index fill 8, pairs sort 100 (histogram 4 + 4 x 24), segment sort 24, gather 24
TOP_K_MASK = SamplerKernels(4, 14.0)  # `logits_sort < kth` (5) and masked_fill_ (9)
TOP_P_MASK = SamplerKernels(6, 34.0)  # softmax 12, cumsum 8, `<= 1 - p` 5, masked_fill_ 9
SCATTER_BACK = SamplerKernels(2, 24.0)  # logits_sort.scatter: a copy (8) and the scatter (16)
TOPK_ONLY = SamplerKernels(7, 30.0)  # torch.topk's radix select (four reads, 16) and the mask (14)
TRITON_MASK = SamplerKernels(2, 20.0)  # vLLM's Triton top-k/top-p kernel: four reads and a write
FLASHINFER_BOTH = SamplerKernels(5, 62.0)  # cast 6, temperature 8, top_k_mask_logits 20, softmax 12, rejection 16
FLASHINFER_ONE = SamplerKernels(4, 42.0)  # cast 6, temperature 8, softmax 12, top-k or top-p rejection 16


def plus(*parts: SamplerKernels) -> SamplerKernels:
    return SamplerKernels(sum(p.kernels for p in parts), sum(p.bytes_per_element for p in parts))


@dataclass(frozen=True)
class Sampling:
    """The requests' sampling parameters, as vLLM's SamplingParams holds them (top_k 0: off)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    source: str = "greedy"  # where they came from, for summary.json and validate.csv

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def path(self, vocab: int) -> str:
        """greedy, random, top-k or top-p (top-p with or without a top-k): which of vLLM's paths runs.
        A top-k of 0, -1 or the vocabulary or more is no top-k (SamplingMetadata leaves k None); a top-p
        of 1 no top-p; a greedy request ignores both (SamplingParams sets them off at temperature 0)."""
        if self.greedy:
            return "greedy"
        if self.top_p < 1.0:
            return "top-p"
        if 0 < self.top_k < vocab:
            return "top-k"
        return "random"

    def describe(self) -> str:
        if self.greedy:
            return f"greedy ({self.source})" if self.source != "greedy" else "greedy"
        parts = [f"temperature={self.temperature:g}"]
        if self.top_p < 1.0:
            parts.append(f"top_p={self.top_p:g}")
        if self.top_k > 0:
            parts.append(f"top_k={self.top_k}")
        text = ",".join(parts)
        return text if self.source == "given" else f"{text} ({self.source})"

    def to_json(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "source": self.source}


GREEDY = Sampling()
SAMPLING_KEYS = ("temperature", "top_p", "top_k")


class PricesSampler:
    """What a cost model prices its sampler for (`sampler_seconds`): the requests' sampling parameters and the
    vLLM version whose sampler runs them (None: the newest). Setting either to a new value calls the model's
    `_forget_sampler`, which drops what it priced with the ones before (its tables by logits rows, its steps and
    decode runs): `sim validate` keeps one model for a deployment's rows, whose clients may sample otherwise."""

    _sampling: Sampling = GREEDY
    _sampler_version: str | None = None

    @property
    def sampling(self) -> Sampling:
        return self._sampling

    @sampling.setter
    def sampling(self, value: Sampling) -> None:
        if value != self._sampling:
            self._sampling = value
            self._forget_sampler()

    @property
    def sampler_version(self) -> str | None:
        return self._sampler_version

    @sampler_version.setter
    def sampler_version(self, value: str | None) -> None:
        if value != self._sampler_version:
            self._sampler_version = value
            self._forget_sampler()

    def _forget_sampler(self) -> None:
        raise NotImplementedError


def check_sampling(flag: str, temperature, top_p, top_k, where: str) -> tuple[float, float, int]:
    """The three values checked as vLLM's SamplingParams._verify_args checks them; refused naming `where`."""
    try:
        t = float(temperature) + 0.0  # (-0 is 0)
        p = float(top_p)
    except (TypeError, ValueError):
        raise ServesimError(f"{where}: temperature and top_p must be numbers, got {temperature!r} and {top_p!r}") from None
    if isinstance(top_k, bool) or not isinstance(top_k, (int, float, str)):
        raise ServesimError(f"{where}: top_k must be a whole number, got {top_k!r}")
    try:
        k_float = float(top_k)
    except ValueError:
        raise ServesimError(f"{where}: top_k must be a whole number, got {top_k!r}") from None
    if not math.isfinite(t) or t < 0:
        raise ServesimError(f"{where}: temperature must be a number of 0 or more (0: greedy), got {temperature!r}")
    if t > 1e4:
        raise ServesimError(f"{where}: temperature {t:g} is past 10,000, not a sampling temperature")
    if not math.isfinite(p) or not 0.0 < p <= 1.0:
        raise ServesimError(f"{where}: top_p must be in (0, 1], got {top_p!r}")
    if not math.isfinite(k_float) or k_float != int(k_float) or k_float < -1 or k_float > 2**31 - 1:
        raise ServesimError(f"{where}: top_k must be a whole number, -1 or 0 (off) or more, got {top_k!r}")
    return t, p, max(0, int(k_float))


def parse_sampling(text: str, flag: str = "--sampling") -> Sampling | str:
    """`greedy`, `model` (returned as the string: the model's generation config, resolved with the model) or
    `temperature=T[,top_p=P][,top_k=K]` (the others at vLLM's neutral values: top_p 1, top_k off)."""
    value = str(text).strip()
    if value in ("greedy", "model"):
        return GREEDY if value == "greedy" else "model"
    given: dict[str, str] = {}
    for part in value.split(","):
        key, sep, number = part.partition("=")
        key = key.strip()
        if not sep or key not in SAMPLING_KEYS:
            raise ServesimError(f"{flag} takes greedy, model or temperature=T[,top_p=P][,top_k=K], got {text!r}")
        if key in given:
            raise ServesimError(f"{flag} gives {key} twice in {text!r}")
        given[key] = number.strip()
    if "temperature" not in given:
        raise ServesimError(f"{flag} {text!r}: give the temperature too (temperature=0 is greedy, which ignores "
                            "top_p and top_k)")
    t, p, k = check_sampling(flag, given["temperature"], given.get("top_p", 1.0), given.get("top_k", 0),
                             f"{flag} {text!r}")
    return Sampling(t, p, k, "given")


# The generation_config.json of the models servesim's presets and the tables package name, where it sets
# sampling defaults (huggingface.co/<repo>/blob/main/generation_config.json; the models' cards state them:
# Qwen3's "Temperature=0.6, TopP=0.95, TopK=20, and MinP=0 (the default setting in generation_config.json)").
KNOWN_GENERATION_CONFIGS = (
    (re.compile(r"(^|/)Qwen3-(0\.6B|1\.7B|4B|8B|14B|32B|30B-A3B|235B-A22B)(-FP8)?$"), (0.6, 0.95, 20)),
    (re.compile(r"(^|/)(Meta-)?Llama-3\.1-(8B|70B|405B)-Instruct(-FP8)?$"), (0.6, 0.9, 0)),
)


# transformers' GenerationConfig defaults: vLLM reads a generation config through `to_diff_dict()`
# (vllm/config/model.py, ModelConfig.try_get_generation_config), which leaves out a value equal to them, so a
# file's `top_k: 50` gives vLLM no top-k at all (its own default), where transformers would sample the top 50.
TRANSFORMERS_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50}


def generation_config_sampling(model_name: str, config_dir: Path | None) -> Sampling | None:
    """The server's default sampling for `model_name` under vLLM's `--generation-config auto`: the
    `generation_config.json` beside its config.json where there is one, else the known repo's; None when
    neither is known. A file that sets no temperature, top_p or top_k (or sets one null, which vLLM's
    `get_diff_sampling_param` skips, or to transformers' default, `TRANSFORMERS_DEFAULTS`) gives vLLM's defaults
    (temperature 1, no top-p or top-k); one set to a string or true is refused. The source names the file read."""
    if config_dir is not None:
        path = Path(config_dir) / "generation_config.json"
        if path.exists() and not path.is_file():  # (a folder, a pipe: not read, nor passed over for the known repo's)
            raise ServesimError(f"{path}: cannot read it: not a file")
        if path.is_file():
            data = read_json_file(path, "generation config")  # (servesim's one reader of JSON files and its errors)
            values = []
            for key, default in (("temperature", 1.0), ("top_p", 1.0), ("top_k", 0)):
                value = data.get(key)
                if value is None:
                    value = default
                elif isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ServesimError(f"{path}: {key} = {value!r}, expected a number")
                elif value == TRANSFORMERS_DEFAULTS[key]:  # dropped by to_diff_dict: vLLM's own default applies
                    value = default
                values.append(value)
            t, p, k = check_sampling("--sampling model", *values, str(path))
            return Sampling(t, p, k, str(path))
    for pattern, (t, p, k) in KNOWN_GENERATION_CONFIGS:
        if pattern.search(model_name):
            return Sampling(t, p, k, f"generation_config.json of {model_name}")
    return None


def sampler_kernels(path: str, rows: int, vllm_version: str | None) -> SamplerKernels:
    """The kernels vLLM `vllm_version` (None: the newest) runs to sample `rows` logits rows on `path`."""
    if path == "greedy":
        return CAST_AND_ARGMAX
    if path == "random":
        return RANDOM
    release = vllm_release(vllm_version)
    if release is None or release >= FLASHINFER_DEFAULT_SINCE:
        return FLASHINFER_BOTH if path == "top-p" else FLASHINFER_ONE  # (top-p here may carry a top-k: the fused call)
    if release >= TRITON_SINCE and rows >= TRITON_FROM_ROWS:
        return plus(RANDOM, TRITON_MASK)
    if path == "top-k":
        return plus(RANDOM, TOPK_ONLY)
    return plus(RANDOM, SORT, TOP_K_MASK, TOP_P_MASK, SCATTER_BACK)


def sampler_seconds(sampling: Sampling, vllm_version: str | None, rows, vocab: int, floor_s: float,
                    bandwidth: float) -> np.ndarray:
    """Seconds of the sampler for each of `rows` (an array of logits rows per step)."""
    n = np.asarray(rows, dtype=np.int64)
    path = sampling.path(vocab)
    if path == "greedy" or path == "random":
        return sampler_kernels(path, 0, vllm_version).seconds(n, vocab, floor_s, bandwidth)
    out = np.zeros(n.shape, dtype=np.float64)
    # The kernels depend on the rows (vLLM 0.17-0.21: Triton from 8 rows): by stretch.
    for low, mask in ((0, n < TRITON_FROM_ROWS), (TRITON_FROM_ROWS, n >= TRITON_FROM_ROWS)):
        if np.any(mask):
            out[mask] = sampler_kernels(path, low, vllm_version).seconds(n[mask], vocab, floor_s, bandwidth)
    return out


def config_dir_of(model_arg: str) -> Path | None:
    """The folder of a --model given as a folder or a config.json (None for a preset or another file name)."""
    p = Path(model_arg)
    if p.is_dir():
        return p
    if p.is_file() and p.name == "config.json":
        return p.parent
    return None


def resolve_sampling(spec: str, model_name: str, model_arg: str, flag: str = "--sampling") -> Sampling:
    """--sampling's value for a run of `model_name` (--model `model_arg`): greedy, the given parameters, or with
    `model` the server's defaults from the model's generation config (`generation_config_sampling`)."""
    parsed = parse_sampling(spec, flag)
    if isinstance(parsed, Sampling):
        return parsed
    found = generation_config_sampling(model_name, config_dir_of(model_arg))
    if found is None:
        raise ServesimError(f"{flag} model: no generation config is known for {model_name} (servesim knows Qwen3's and "
                            "Llama 3.1 Instruct's, and reads generation_config.json beside a --model config.json): give "
                            f"{flag} temperature=T[,top_p=P][,top_k=K] as its generation_config.json sets them")
    return found
