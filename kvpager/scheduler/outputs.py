"""A computed step's tokens, taken into the sequences, and the requests they finish.

The runner returns one row per computed sequence: the float32 logits of its last token, sampled
here under the request's parameters with the sample's own generator, or (a greedy step) their
argmax, the token itself. A prompt just computed gives the first token of every sample of its
request. A sample ends at a stop token (kept in its output) or at ``max_new_tokens``; its
sequence is then freed by the next Step, and once every sample of a request has ended the
request leaves the running queue with its ``RequestOutput``. ``on_token`` streams each token as
it is taken; a restarted request recomputes the tokens it had (greedy and seeded sampling give
the same ones), and they are not streamed again.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .queues import RequestQueues
from .request import Group, RequestOutput, SeqState, sample
from .stats import SchedulerStats

# Called for every sampled token: (request id, sample index, token id, finish reason or "").
TokenCallback = Callable[[str, int, int, str], None]


class OutputCollector:
    """Takes the rows of computed steps into the sequences of ``queues``; keeps the finished
    requests' outputs (``finished``, by request id)."""

    def __init__(self, queues: RequestQueues, stats: SchedulerStats, on_token: Optional[TokenCallback]) -> None:
        self._queues = queues
        self._stats = stats
        self.on_token = on_token
        self.finished: dict[str, RequestOutput] = {}

    def take(self, computed: list[tuple[SeqState, int]], greedy: bool, rows: torch.Tensor) -> None:
        """Emit each computed sequence's token(s): ``computed`` holds (sequence, its context length
        after the step) per row of ``rows``. O(S) (greedy ids leave the tensor in one call)."""
        for (seq, ctx), row in zip(computed, rows.tolist() if greedy else rows):
            seq.num_cached = ctx
            if seq.finish_reason:      # finished while this step was in flight: its token is dropped
                continue
            group = self._queues.group_of[seq.seq_id]
            # A prompt just computed gives the first token of every sample of its request.
            targets = group.seqs if ctx == len(group.request.prompt) and seq is group.seqs[0] else [seq]
            for target in targets:
                target.num_cached = ctx
                token = row if greedy else sample(row, group.request.params, target.generator)
                self._emit(group, target, token)

    def _emit(self, group: Group, seq: SeqState, token: int) -> None:
        params = group.request.params
        seq.tokens.append(token)
        seq.num_generated += 1
        self._stats.tokens_generated += 1
        if token in params.stop_token_ids:
            seq.finish_reason = "stop"
        elif seq.num_generated == params.max_new_tokens:
            seq.finish_reason = "length"
        if self.on_token is not None and (seq.num_generated > seq.streamed
                                          or (seq.finish_reason and not seq.finish_streamed)):
            # A restarted request recomputes its tokens (the same ones, greedy or seeded): the
            # stream carries on where it was instead of repeating them.
            self.on_token(group.request.request_id, group.seqs.index(seq), token, seq.finish_reason)
        if seq.finish_reason:
            self._queues.to_free.append(seq)
            if group.done:
                self._queues.running.remove(group)
                self._stats.requests_finished += 1
                prompt_len = len(group.request.prompt)
                self.finished[group.request.request_id] = RequestOutput(
                    group.request.request_id, [s.tokens[prompt_len:] for s in group.seqs],
                    [s.finish_reason for s in group.seqs])
