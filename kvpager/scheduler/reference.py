"""The oracle for end-to-end checks: greedy generation with a plain contiguous KV cache."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .request import Request


def generate_contiguous(model, requests: list[Request],
                        on_request: Optional[Callable[[int], None]] = None) -> dict[str, list[list[int]]]:
    """Greedy tokens per request (all n samples are equal under greedy decoding), computed one
    sequence at a time with past keys and values concatenated per step (``model`` is a
    ``worker.model`` decoder of tensor-parallel size 1: its ``forward_contiguous``). A sample
    ends at a stop token (included) or after ``max_new_tokens``. ``on_request`` is called with
    the number of requests done after each (progress)."""
    outputs = {}
    for done, request in enumerate(requests, start=1):
        params = request.params
        if params.temperature > 0:
            raise ValueError("the contiguous reference checks greedy decoding only")
        past: list[tuple[torch.Tensor, torch.Tensor]] = []
        logits = model.forward_contiguous(request.prompt, 0, past)
        generated = [int(torch.argmax(logits))]
        while len(generated) < params.max_new_tokens and generated[-1] not in params.stop_token_ids:
            position = len(request.prompt) + len(generated) - 1
            logits = model.forward_contiguous([generated[-1]], position, past)
            generated.append(int(torch.argmax(logits)))
        outputs[request.request_id] = [list(generated) for _ in range(params.n)]
        if on_request is not None:
            on_request(done)
    return outputs
