"""vLLM's front-end admission limits: `--max-num-queued-reqs` and `--max-num-queued-tokens`.

vLLM's API server checks them before it hands a request to the engine (vllm/v1/engine/async_llm.py,
`AsyncLLM.check_admission`, called from `AsyncLLM._add_request` right before
`OutputProcessor.add_request`; the same code in vLLM 0.33.0 and 0.34.0) and answers a request that
would break one with HTTP 503 (vllm/exceptions.py, `QueueOverflowError` and `MaxQueuedTokensError`,
both `GracefulHTTPError`s with `HTTPStatus.SERVICE_UNAVAILABLE`):

- `max_num_queued_reqs`: rejected when the unfinished requests (`OutputProcessor.
  get_num_unfinished_requests`: every request the API server added and has not yet seen finish,
  waiting or running) plus n (the request's sequences: 1, servesim's requests have one) exceed
  the limit. With several API servers (one per DP rank from vLLM 0.15) they add up their counts
  (vllm/v1/engine/admission_control.py, `SharedAdmissionStats`), so the count is over every rank.
- `max_num_queued_tokens`: rejected when the prompt tokens of the requests still in prefill
  (`OutputProcessor.get_num_queued_tokens`: the whole `prompt_len` of every request whose
  `is_prefilling` is still set, which `process_outputs` clears at the request's first output) are
  at least the limit. Chunks already computed and prefix-cache hits are not subtracted. Each API
  server counts only its own requests (no shared counter), which is why a DP group's several
  servers are refused with it (sim/app/options.py).

A request too long for the model (longer than --max-model-len, or than the whole KV cache) is
checked too: vLLM's HTTP server calls check_admission before it renders the prompt, where a prompt
too long is found (OpenAIServing._preflight in render_completion_request and render_chat_request,
vllm/entrypoints/openai/, 0.33.0 and 0.34.0), so over a limit it is answered 503, under them 400;
it is never counted (`check`, then `count` only for a request that runs).

When servesim counts: at the request's arrival at the engine (`Request.arrival_s`: after the API
server's own work where one is modelled, which is when AsyncLLM._add_request calls check_admission;
the same call in OpenAIServing._preflight, at the HTTP request's arrival before that work, is not
checked apart: servesim checks once, at the later instant), a request
admitted before it counts until its finish (`Request.finish_s`) and counts as in prefill until its
first token (`Request.first_token_s`), the instants servesim reports as the client seeing them
(the end of the step that emitted the token: docs/async-scheduling.md). An output at the very
instant of an arrival is seen after it (a cluster's router reads the replicas the same way,
sim/cluster.py), except by an arrival that the output caused: a closed loop's client sends its
next request when it has a request's last output, which the API server's OutputProcessor handed
it after counting that request finished (and the rest of the step's outputs with it), so a send
at that instant with no API server's time before the engine (`after_outputs`) finds them seen.

The counts are taken from those times, not from what the engine has applied when it takes the
request: a lone engine may have applied a whole run of steps past the arrival by then
(sim/fast_forward.py). What is needed is that every finish and first token before the arrival is
known when the arrival is checked, which holds where the limits are checked: at the engine's `submit`
(a lone engine, or one replica of a cluster: each replica's steps before the arrival are applied
when its engine takes it) and at a DP group's routing instant (sim/data_parallel.py: every rank's
steps that ended before it are applied).
"""

from __future__ import annotations

import heapq
from typing import Any

from sim.request import Request

# The reasons a rejected request carries (requests.csv's reject_reason), as vLLM's logs name the limits.
QUEUED_REQS_REASON = "HTTP 503 (max_num_queued_reqs): {count} requests unfinished, the limit is {limit}"
QUEUED_TOKENS_REASON = "HTTP 503 (max_num_queued_tokens): {count} prompt tokens in prefill, the limit is {limit}"


class QueueLimits:
    """The admission limits of one API server's requests (a lone engine, a replica of a cluster,
    or a DP group, whose servers share their count): `check(r)` at each arrival, in arrival order, and
    `count(r)` for one that passed and runs;
    `finished(at)` for every admitted request that finishes. First tokens are read from the
    requests themselves (`Request.first_token_s`)."""

    def __init__(self, max_num_queued_reqs: int | None, max_num_queued_tokens: int | None):
        self.max_num_queued_reqs = max_num_queued_reqs
        self.max_num_queued_tokens = max_num_queued_tokens
        self.num_admitted = 0
        self._num_finished = 0  # finishes before the last arrival checked
        self._finishes: list[float] = []  # the others' times, a heap
        self._prefilling: list[Request] = []  # admitted; some may have had their first token since
        self._prefill_tokens = 0  # their prompt tokens
        self._prune_at = 64  # prune the list when it grows to this (kept about twice its live length)

    @classmethod
    def of(cls, config: Any) -> "QueueLimits | None":
        """The limits a scheduler config (sim.config.SchedulerConfig) sets, or None where it sets none."""
        reqs = getattr(config, "max_num_queued_reqs", None)
        tokens = getattr(config, "max_num_queued_tokens", None)
        return None if reqs is None and tokens is None else cls(reqs, tokens)

    def num_unfinished(self, at: float, after_outputs: bool = False) -> int:
        """Requests admitted and not finished before `at` (no earlier than the last arrival checked;
        `after_outputs`: nor at `at`)."""
        finishes = self._finishes
        while finishes and (finishes[0] < at or (after_outputs and finishes[0] == at)):
            heapq.heappop(finishes)
            self._num_finished += 1
        return self.num_admitted - self._num_finished

    def num_queued_tokens(self, at: float, after_outputs: bool = False) -> int:
        """Prompt tokens of the admitted requests without a first token before `at` (`after_outputs`: nor at `at`)."""
        self._prune(at, after_outputs)
        return self._prefill_tokens

    def _prune(self, at: float, after_outputs: bool = False) -> None:
        kept = [r for r in self._prefilling
                if r.first_token_s is None or r.first_token_s > at or (r.first_token_s == at and not after_outputs)]
        self._prefilling = kept
        self._prefill_tokens = sum(r.num_prompt_tokens for r in kept)
        self._prune_at = 2 * len(kept) + 64

    def check(self, r: Request, after_outputs: bool = False) -> str | None:
        """Check `r` at its arrival as AsyncLLM.check_admission does (n = 1): None, or why it is rejected
        (HTTP 503). It is not counted here: vLLM's API server checks a request before it renders its
        prompt (OpenAIServing._preflight), so one too long is answered 503 over the limit and 400
        under it, never counted; `count(r)` counts one that passed and runs. `after_outputs`: the
        outputs at the arrival's instant are seen before it (it is a send they caused)."""
        at = r.arrival_s
        limit = self.max_num_queued_reqs
        if limit is not None:
            count = self.num_unfinished(at, after_outputs)
            if count + 1 > limit:
                return QUEUED_REQS_REASON.format(count=count, limit=limit)
        limit = self.max_num_queued_tokens
        if limit is not None:
            # Only the prompts of requests with no first token yet count: the sum is pruned when it
            # reaches the limit (an arrival may then be rejected) or the list has grown.
            if self._prefill_tokens >= limit or len(self._prefilling) >= self._prune_at:
                self._prune(at, after_outputs)
            if self._prefill_tokens >= limit:
                return QUEUED_TOKENS_REASON.format(count=self._prefill_tokens, limit=limit)
        return None

    def count(self, r: Request) -> None:
        """Count `r`, which passed `check` at its arrival, from now on."""
        if self.max_num_queued_tokens is not None:
            self._prefilling.append(r)
            self._prefill_tokens += r.num_prompt_tokens
        self.num_admitted += 1

    def finished(self, at: float) -> None:
        """An admitted request finished at `at` (the end of the step that emitted its last token)."""
        if self.max_num_queued_reqs is not None:
            heapq.heappush(self._finishes, at)
