"""Building transport :class:`StepInput` objects and client settings for tests."""
from __future__ import annotations

import torch

from k3_accel.transport.api import ClientSettings, StepInput


def settings(address: str, **kw) -> ClientSettings:
    # a propose waits as long as any message here (the step-sized propose timeout has its own tests)
    base = dict(address=address, timeout_ms=20000, propose_timeout_ms=20000, max_rows=4096,
                num_speculative_tokens=4, backoff_initial_ms=20, backoff_max_ms=200)
    base.update(kw)
    return ClientSettings(**base)


def step(req_ids, chunks, *, sampled=None, anchors=None, k=4, prompts=None, hidden=None) -> StepInput:
    """A StepInput from per-request ``(start_position, [token ids])`` chunks.

    ``anchors[i]`` is the anchor token of request i (its position is the end
    of its chunk); default: the chunk's last token + 1.
    """
    counts = [len(toks) for _, toks in chunks]
    positions = torch.cat([torch.arange(s, s + len(t), dtype=torch.int64) for s, t in chunks]) \
        if chunks else torch.empty(0, dtype=torch.int64)
    token_ids = torch.tensor([x for _, t in chunks for x in t], dtype=torch.int64)
    sampled = sampled if sampled is not None else [True] * len(req_ids)
    anchors = anchors if anchors is not None else [(t[-1] + 1 if t else 0) for _, t in chunks]
    return StepInput(list(req_ids), counts, positions, token_ids, sampled, anchors,
                     [s + len(t) for s, t in chunks], k=k, prompt_token_ids=prompts, hidden=hidden)


def random_hidden(n: int, width: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g).to(dtype)


def wait_until(cond, timeout: float = 60.0, interval: float = 0.01) -> bool:
    """Poll ``cond`` until it holds or ``timeout`` seconds pass (a deadline, never a speed claim)."""
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval)
    return bool(cond())


def drafts_again(client, timeout: float = 60.0) -> bool:
    """Step fresh requests (history 1 2 1, anchor 2) until one gets the ngram draft 1 2 again:
    the client reconnects only inside steps, so recovery is something steps must drive."""
    names = iter(range(10 ** 9))

    def attempt() -> bool:
        out = client.step(step([f"fresh-{next(names)}"], [(0, [1, 2, 1])], anchors=[2]))
        return out.drafts[0, :2].tolist() == [1, 2]
    return wait_until(attempt, timeout, interval=0.02)


def held_copies(monkeypatch):
    """From now until ``monkeypatch.undo()``, every staged copy of rows (a deferred ingest's
    device -> pinned copy) stays "running" until the returned event is set: the sender thread
    holds those rows back, as a slow copy would."""
    import threading

    from k3_accel.transport import layout
    copied = threading.Event()

    class SlowCopy:
        def synchronize(self):
            copied.wait(30)
    stage = layout.stage
    monkeypatch.setattr(layout, "stage", lambda *a, **kw: (stage(*a, **kw), SlowCopy())[1])
    return copied
