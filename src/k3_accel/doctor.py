"""``k3-accel doctor``: would vLLM draft with this server? Checked the way vLLM's client checks it.

Given the draft server's address and the target exactly as vLLM would be
started (model directory, ``--speculative-config``, ``--max-num-seqs``,
``--max-num-batched-tokens``), it reads the target's facts from the
checkpoints (no vLLM needed), says hello with the real client, applies every
compatibility rule (:mod:`k3_accel.transport.handshake`), times a few
propose round trips with rows shaped like the target's, and prints a verdict
a person can act on. Exit 0 only when vLLM would draft.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from k3_accel.transport import handshake
from k3_accel.vllm.spec_decode.methods import HIDDEN_METHODS, draft_architectures, draft_signature
from k3_accel.vllm.spec_decode.session import aux_layer_ids

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
           "half": torch.float16, "float": torch.float32}


class DoctorError(ValueError):
    """The target description itself is unusable (a missing file, bad JSON)."""


@dataclass
class Report:
    lines: list[tuple[str, str]] = field(default_factory=list)    # (mark, text)
    ok: bool = True

    def good(self, text: str) -> None:
        self.lines.append(("ok", text))

    def note(self, text: str) -> None:
        self.lines.append(("note", text))

    def bad(self, text: str) -> None:
        self.lines.append(("FAIL", text))
        self.ok = False

    def render(self, verdict: str) -> str:
        width = max(len(m) for m, _ in self.lines) if self.lines else 4
        body = "\n".join(f"  [{m:>{width}}] {t}" for m, t in self.lines)
        return f"{body}\n\n{verdict}"


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise DoctorError(f"{what}: {path} not found") from None
    except ValueError as exc:
        raise DoctorError(f"{what}: {path} is not JSON ({exc})") from None


def _prompt_lookup(spec: dict[str, Any]) -> tuple[int | None, int | None]:
    """vLLM's ``prompt_lookup_min``/``max`` for ``ngram``: 5/5 when neither is given, one the other
    when only one is, integers >= 1 with min <= max (DoctorError as vLLM refuses otherwise)."""
    lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
    if spec.get("method") != "ngram":
        return lo, hi
    for key, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise DoctorError(f"--speculative-config: {key}={value!r}: expected an integer >= 1")
    if lo is None and hi is None:
        lo = hi = 5
    lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
    if lo > hi:
        raise DoctorError(f"--speculative-config: prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
    return lo, hi


def target_needs(model: str, spec: dict[str, Any], max_num_seqs: int) -> tuple[handshake.TargetNeeds, Any]:
    """The target's side of the checks, from its checkpoint and speculative config (the aux
    layers by the plugin's own rule: vLLM's resolution, ascending, each once)."""
    cfg = _read_json(Path(model) / "config.json", "target model")
    text = cfg.get("text_config", cfg)
    method = spec.get("method")
    k = spec.get("num_speculative_tokens")
    archs: list[str] = []
    layers: tuple[int, ...] = ()
    draft: dict[str, Any] = {}
    if isinstance(method, str) and spec.get("model"):
        draft = _read_json(Path(spec["model"]) / "config.json", "draft model (speculative_config.model)")
        if method == "dspark" and k is None:        # vLLM: a DSpark draft's K is its block size
            k = draft.get("block_size", draft.get("dspark_block_size"))
    if not isinstance(method, str) or not isinstance(k, int) or k < 1:
        raise DoctorError("--speculative-config needs \"method\" and \"num_speculative_tokens\" >= 1")
    if spec.get("model"):
        archs = draft_architectures(method, draft)      # as vLLM renames them
        if method == "dspark" and spec.get("dspark_draft_topk") is not None:
            draft = {**draft, "dspark_draft_topk": spec["dspark_draft_topk"]}   # vLLM's override
        if method in HIDDEN_METHODS:
            layers = aux_layer_ids(SimpleNamespace(method=method, model=spec["model"], draft_model_config=(
                SimpleNamespace(hf_config=SimpleNamespace(**draft)))))
    lookup_min, lookup_max = _prompt_lookup(spec)
    hidden = int(text.get("hidden_size", 0))
    dtype = _DTYPES.get(str(text.get("torch_dtype") or text.get("dtype") or "bfloat16"), torch.bfloat16)
    ships = method in HIDDEN_METHODS
    needs = handshake.TargetNeeds(context_width=len(layers) * hidden if ships else 0, hidden_dtype=dtype,
                                  num_speculative_tokens=k, vocab_size=int(text.get("vocab_size", 0)),
                                  hidden_size=hidden if ships else 0, aux_layer_ids=layers if ships else (),
                                  max_requests=max_num_seqs,
                                  draft=draft_signature(SimpleNamespace(
                                      method=method, prompt_lookup_min=lookup_min, prompt_lookup_max=lookup_max,
                                      draft_model_config=(
                                          SimpleNamespace(hf_config=SimpleNamespace(**draft)))))
                                  if spec.get("model") or method == "ngram" else {})
    spec_ns = SimpleNamespace(method=method, draft_model_config=SimpleNamespace(architectures=archs),
                              draft_heads=int(draft.get("num_attention_heads", 0)) if spec.get("model") else 0,
                              draft_tp=spec.get("draft_tensor_parallel_size"),
                              draft_sample_method=spec.get("draft_sample_method", "greedy"))
    return needs, spec_ns


def draft_tp_note(spec: Any, tensor_parallel_size: int) -> str | None:
    """What to say when vLLM alone would refuse the draft at this TP (its heads do not divide it)."""
    heads = getattr(spec, "draft_heads", 0)
    if spec.method not in HIDDEN_METHODS or tensor_parallel_size <= 1 or not heads or spec.draft_tp is not None \
            or heads % tensor_parallel_size == 0:
        return None
    return (f"draft TP: the draft config has {heads} attention heads, not divisible by TP {tensor_parallel_size}; "
            f"vLLM alone refuses that, so k3-accel sets \"draft_tensor_parallel_size\": 1 (the draft never runs "
            f"on the target). Write it into --speculative-config to be explicit.")


def draft_tp_refusal(spec: Any, tensor_parallel_size: int) -> str | None:
    """Why vLLM refuses the draft TP written into the speculative config (None: it does not)."""
    draft_tp, heads = getattr(spec, "draft_tp", None), getattr(spec, "draft_heads", 0)
    if spec.method not in HIDDEN_METHODS or draft_tp is None:
        return None
    if draft_tp not in (1, tensor_parallel_size):
        return (f"draft_tensor_parallel_size {draft_tp} is not 1 or the target's TP {tensor_parallel_size}; "
                f"vLLM refuses it")
    if heads and heads % draft_tp:
        return (f"draft TP: the draft config has {heads} attention heads, not divisible by "
                f"draft_tensor_parallel_size {draft_tp}; vLLM refuses it (write 1)")
    return None


def diagnose(address: str, needs: handshake.TargetNeeds, spec: Any, *, max_batched_tokens: int,
             curve_server_key: str | None = None, curve_client_key: str | None = None,
             timeout_ms: int = 10000, round_trips: int = 20, tensor_parallel_size: int = 1) -> Report:
    from k3_accel.transport.api import ClientSettings
    from k3_accel.transport.client import DraftClient
    from k3_accel.vllm.spec_decode.methods import unserved_reason

    report = Report()
    tp_note = draft_tp_note(spec, tensor_parallel_size)
    if tp_note is not None:
        report.note(tp_note)
    refused = draft_tp_refusal(spec, tensor_parallel_size)
    if refused is not None:
        report.bad(refused)
        return report
    why = unserved_reason(spec)
    if why is not None:
        report.bad(f"speculative method: {why}; set method to dflash, dspark or ngram")
        return report
    ring = _test_ring(needs)
    settings = ClientSettings(address=address, timeout_ms=timeout_ms, max_rows=max(max_batched_tokens, 64),
                              context_width=needs.context_width, hidden_dtype=needs.hidden_dtype,
                              num_speculative_tokens=needs.num_speculative_tokens,
                              target_vocab_size=needs.vocab_size, hidden_size=needs.hidden_size,
                              aux_layer_ids=needs.aux_layer_ids, max_requests=needs.max_requests, draft=needs.draft,
                              curve_server_key=curve_server_key, curve_client_key=curve_client_key,
                              client_name="k3-accel-doctor",
                              # never a full-size device ring here: a small test ring or none
                              device_plane="off" if ring is None and torch.cuda.is_available() else "auto")
    client = DraftClient(settings, device_ring=ring).start()
    try:
        _check(client, needs, max_batched_tokens, report)
        if report.ok:
            _sampling(spec, client.caps, report)
            _time(client, needs, round_trips, report)
    finally:
        client.close()
    return report


def _check(client, needs: handshake.TargetNeeds, max_batched_tokens: int, report: Report) -> None:
    state = client.state.value
    if state != "ready" and client.link.problem is None:
        report.bad(f"no answer from {client.settings.address} ({state}): is k3-draft-server running there, "
                   f"reachable from this host, and (for CURVE) are the keys right?")
        return
    if client.link.problem is not None:
        for problem in client.link.problem.split("; "):
            report.bad(problem)
        return
    caps = client.caps
    report.good(f"hello: engine {caps.engine}, protocol {caps.protocol}, server {client.link.conn.server_id}")
    report.good(f"vocabulary {needs.vocab_size or '?'}, K {needs.num_speculative_tokens} <= {caps.max_spec_tokens}"
                + (f", aux layers {list(needs.aux_layer_ids)} x hidden {needs.hidden_size}"
                   if caps.needs_hidden_states else ""))
    for warning in handshake.warnings(caps, needs):
        report.note(warning + " (raise the server's --max-requests)")
    row_bytes = 8 + needs.context_width * needs.hidden_dtype.itemsize
    largest = max_batched_tokens * row_bytes
    if largest > caps.max_message_bytes:
        parts = -(-largest // caps.max_message_bytes)
        report.note(f"message limit: a full step ({largest / 2**20:.0f} MiB) goes out as ~{parts} messages of "
                    f"<= {caps.max_message_bytes / 2**20:.0f} MiB (works; raise --max-message-mb to send fewer)")
    else:
        report.good(f"message limit {caps.max_message_bytes / 2**20:.0f} MiB holds a full step "
                    f"({largest / 2**20:.1f} MiB)")
    _fair_share(caps, report)
    if caps.needs_hidden_states:
        _device_plane(client, report)


def _sampling(spec: Any, caps, report: Report) -> None:
    """What ``draft_sample_method: probabilistic`` gets from this server."""
    if getattr(spec, "draft_sample_method", "greedy") != "probabilistic":
        return
    if caps.sampling:
        report.note("draft_sample_method probabilistic: the server samples each request's drafts with its "
                    "temperature and seed as vLLM does in-tree; vLLM verifies them as point masses (exact; "
                    "lower acceptance than in-tree, usually than greedy drafts)")
    else:
        report.note(f"draft_sample_method probabilistic: engine {caps.engine} drafts greedily; the drafts are "
                    f"verified as point masses (exact)")


def _test_ring(needs: handshake.TargetNeeds):
    """A small device ring on this host's GPU, to ask the server whether it can open one (the
    target's own ring is max_num_batched_tokens rows; the answer is the same). None without CUDA."""
    from k3_accel.transport.device_plane import DeviceRing
    if not torch.cuda.is_available() or needs.context_width <= 0:
        return None
    try:
        return DeviceRing(2, 64, needs.context_width, needs.hidden_dtype, "cuda")
    except Exception:  # noqa: BLE001 - then the report says why there is no device plane
        return None


def _device_plane(client, report: Report) -> None:
    """Which path a target on this host would ship its hidden rows by, and why."""
    plane = client.stats()["device_plane"]
    if plane["path"] == "device":
        report.good("device plane: the server opened a ring of this host's GPU, so a target here ships its "
                    "hidden rows GPU to GPU (CUDA IPC), control on the socket")
    else:
        report.note(f"device plane off, hidden rows take the host path (pinned memory, the socket): "
                    f"{plane['reason']}")


def _fair_share(caps, report: Report) -> None:
    """The share of the server this target would be guaranteed now (hello says, for a new session)."""
    if not caps.fair_share:
        report.note("fair share: this server guarantees no share of its pool (an older server): another "
                    "busy target can leave this one without drafts")
        return
    mib = caps.share_blocks * caps.pool_bytes / max(caps.pool_blocks, 1) / 2**20
    report.good(f"fair share now: {caps.share_blocks} of {caps.pool_blocks} pool blocks ({mib:.1f} MiB) and "
                f"{caps.share_requests} of {caps.max_requests_total} requests guaranteed (weight "
                f"{caps.share_weight}); unused room beyond it may be borrowed")


def _time(client, needs: handshake.TargetNeeds, n: int, report: Report) -> None:
    from k3_accel.transport.api import StepInput
    width, vocab = needs.context_width, max(needs.vocab_size, 2)
    gen = torch.Generator().manual_seed(0)
    times, drafted = [], 0
    for i in range(n + 1):
        rows = 16 if i == 0 else 1
        start = 0 if i == 0 else 15 + i
        tokens = torch.randint(0, vocab, (rows,), generator=gen)
        hidden = torch.randn(rows, width, generator=gen).to(needs.hidden_dtype) if width else None
        inp = StepInput(["doctor"], [rows], torch.arange(start, start + rows), tokens, [True],
                        [int(tokens[-1])], [start + rows], k=needs.num_speculative_tokens, hidden=hidden)
        t0 = time.perf_counter()
        out = client.step(inp)
        if i:
            times.append(time.perf_counter() - t0)
            drafted += int((out.drafts >= 0).sum())
    if client.is_disabled("doctor"):
        report.bad(f"the server refused a step: {client.book.records['doctor'].disabled}")
        return
    report.good(f"propose round trip over {n} steps: median {statistics.median(times) * 1e3:.2f} ms, "
                f"max {max(times) * 1e3:.2f} ms ({drafted} draft tokens; random rows, so few are useful)")


def run(args: argparse.Namespace) -> int:
    try:
        from k3_accel.config import check_address
        check_address(args.address, "address")
        spec = json.loads(args.speculative_config)
        if not isinstance(spec, dict):
            raise DoctorError("--speculative-config: expected a JSON object")
        needs, spec_ns = target_needs(args.model, spec, args.max_num_seqs)
        _check_curve(args.curve_server_key, args.curve_client_key)
    except (DoctorError, ValueError) as exc:
        print(f"k3-accel doctor: {exc}")
        return 2
    report = diagnose(args.address, needs, spec_ns, max_batched_tokens=args.max_num_batched_tokens,
                      curve_server_key=args.curve_server_key, curve_client_key=args.curve_client_key,
                      timeout_ms=args.timeout_ms, tensor_parallel_size=args.tensor_parallel_size)
    verdict = ("VERDICT: vLLM would draft with this server." if report.ok else
               "VERDICT: vLLM would NOT draft with this server (it would run as stock vLLM, outputs "
               "unchanged). Fix the FAIL lines above.")
    print(f"k3-accel doctor: {args.address}\n{report.render(verdict)}")
    return 0 if report.ok else 1


def _check_curve(server_key: str | None, client_key: str | None) -> None:
    """DoctorError naming the flag when the CURVE keys cannot serve (one alone, a file that holds
    no certificate, a client certificate without its secret key), as the client would load them."""
    import zmq.auth
    if not server_key and not client_key:
        return
    if not server_key or not client_key:
        raise DoctorError("--curve-server-key and --curve-client-key go together")
    for flag, path in (("--curve-server-key", server_key), ("--curve-client-key", client_key)):
        try:
            _public, secret = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as exc:
            raise DoctorError(f"{flag} {path}: {exc}") from None
        if flag == "--curve-client-key" and secret is None:
            raise DoctorError(f"{flag} {path}: holds no secret key (give the client's *.key_secret file)")


def add_parser(sub) -> None:
    from k3_accel.server.cli import int_in
    doc = sub.add_parser("doctor", help="check that a draft server fits a target, as vLLM would",
                         description=__doc__.splitlines()[0])
    doc.add_argument("address", help="the draft server: tcp://HOST:PORT or ipc://PATH")
    doc.add_argument("--model", required=True, metavar="DIR", help="the target model directory (as for vllm serve)")
    doc.add_argument("--speculative-config", required=True, metavar="JSON",
                     help='as for vLLM, e.g. \'{"method": "dflash", "model": "/models/draft", '
                          '"num_speculative_tokens": 7}\'')
    doc.add_argument("--max-num-seqs", type=int_in(1), default=1024, help="as for vLLM (default: 1024)")
    doc.add_argument("--tensor-parallel-size", "-tp", type=int_in(1), default=1, help="as for vLLM (default: 1)")
    doc.add_argument("--max-num-batched-tokens", type=int_in(1), default=8192, help="as for vLLM (default: 8192)")
    doc.add_argument("--curve-server-key", metavar="FILE", help="server public key (zmq.auth format)")
    doc.add_argument("--curve-client-key", metavar="FILE", help="this client's certificate with its secret key")
    doc.add_argument("--timeout-ms", type=int_in(1), default=10000)
