"""Rule mutants of the thirtieth session, for modules the earlier sets probed least (one mutant or
none each): the sender thread, the failure queue, the client's telemetry, the server's CURVE guard,
its HTTP endpoints and metrics, which methods go remote, DFlash and DSpark config validation, the
draft/target weight checks and rank consensus. Each names the tests that must notice."""
from __future__ import annotations

from mutant import Mutant

SND = "transport/sender.py"
FQ = "transport/failures.py"
TM = "transport/timing.py"
SEC = "server/security.py"
HTTP = "server/http.py"
MET = "server/metrics.py"
METH = "vllm/spec_decode/methods.py"
DCFG = "server/engines/dflash/config.py"
DSP = "server/engines/dflash/dspark_config.py"
WTS = "server/engines/dflash/weights.py"
CONS = "comm/consensus.py"
FAULTS = ("tests/test_transport_faults.py",)
FAILURES = ("tests/test_transport_failures.py", "tests/test_transport_faults.py")
TELEMETRY = ("tests/test_transport_settings.py", "tests/test_rules_transport_s22.py", "tests/test_transport_rules.py")
CURVE = ("tests/test_curve.py", "tests/test_security_rules.py")
HEALTH = ("tests/test_http_rules.py", "tests/test_server_metrics.py")
METRICS = ("tests/test_server_metrics.py", "tests/test_http_rules.py")
METHODS = ("tests/test_vllm_methods.py", "tests/test_vllm_v1_hook.py")
CHECKPOINT = ("tests/test_dflash_checkpoint.py",)
DSPARK = ("tests/test_dspark_rules.py", "tests/test_doctor_dspark.py", "tests/test_vllm_v2_dspark.py")
CONSENSUS = ("tests/test_comm_consensus.py",)
S30_MUTANTS = (
    Mutant("s30-sender-not-broken", "a failed send marks the link broken, like a socket failure", SND,
           "                self.broken = exc\n", "", FAULTS),
    Mutant("s30-sender-no-heartbeat", "an idle link sends heartbeats (keeps the server's lease)", SND,
           "            except queue.Empty:\n                self._beat()\n",
           "            except queue.Empty:\n                pass\n", FAULTS),
    Mutant("s30-failures-all-dropped", "a failure of every request disables every request", FQ,
           "        failure = Failure(FailureKind(kind), tuple(ids), detail, all_requests)",
           "        failure = Failure(FailureKind(kind), tuple(ids), detail)", FAILURES),
    Mutant("s30-failures-newest-first", "failures drain oldest first", FQ,
           "        return items\n", "        return items[::-1]\n", FAILURES),
    Mutant("s30-timing-peak-is-first", "a phase's max_ms is its longest time, not its first", TM,
           "        if seconds > self.peak:", "        if self.count == 1:", TELEMETRY),
    Mutant("s30-timing-bool-as-seconds", "a server timing that is not a number (true/false) is ignored", TM,
           "            if isinstance(value, (int, float)) and not isinstance(value, bool):",
           "            if isinstance(value, (int, float)):", TELEMETRY),
    Mutant("s30-security-public-key-only", "a CURVE key file without a secret key is a SecurityError", SEC,
           "    if secret is None:", "    if False:", CURVE),
    Mutant("s30-security-authorized-not-dir", "--curve-authorized-keys must be a directory", SEC,
           "    if not Path(authorized_dir).is_dir():", "    if False:", CURVE),
    Mutant("s30-http-scrape-not-flushed", "/metrics shows what was recorded before the scrape", HTTP,
           "                on_scrape()\n", "", HEALTH),
    Mutant("s30-http-query-string", "a probe with a query string reaches its endpoint", HTTP,
           '            path = self.path.split("?", 1)[0]', "            path = self.path", HEALTH),
    Mutant("s30-metrics-label-cap-off-by-one", "at most MAX_SESSION_LABELS sessions get their own label", MET,
           "        if len(self._session_names) < MAX_SESSION_LABELS:",
           "        if len(self._session_names) <= MAX_SESSION_LABELS:", METRICS),
    Mutant("s30-metrics-pool-used-is-free", "the used-blocks gauge counts blocks in use, not free ones", MET,
           '        self.pool_used.set(s["pool_blocks"] - s["pool_free_blocks"])',
           '        self.pool_used.set(s["pool_free_blocks"])', METRICS),
    Mutant("s30-metrics-tokens-as-requests", "tokens_proposed counts draft tokens, not requests", MET,
           "        self.tokens_proposed += tokens", "        self.tokens_proposed += requests",
           ("tests/test_server.py::test_ingest_then_propose_gives_prompt_lookup", *METRICS)),
    Mutant("s30-methods-dspark-no-arch", "a DSpark draft config naming no architecture is not served", METH,
           "        if unserved or not archs:", "        if unserved:", METHODS),
    Mutant("s30-methods-no-address-remote", "no draft address: vLLM drafts as it would without the plugin", METH,
           "    if spec is None or not from_vllm(vllm_config).draft_address:", "    if spec is None:", METHODS),
    Mutant("s30-dflash-mask-is-vocab", "the mask token id is inside the vocabulary", DCFG,
           "    if mask_id >= vocab:", "    if mask_id > vocab:", CHECKPOINT),
    Mutant("s30-dflash-layer-duplicates", "target layer ids are each listed once", DCFG,
           "    if len(set(ids)) != len(ids):", "    if False:", CHECKPOINT),
    Mutant("s30-dflash-block-size-one", "a DFlash block holds at least 2 rows", DCFG,
           "    if block < 2:", "    if block < 1:", CHECKPOINT),
    Mutant("s30-weights-layer-past-target", "a target layer id the target lacks is refused (ids from 0)", WTS,
           "    bad = [i for i in cfg.target_layer_ids if i >= info.num_layers]",
           "    bad = [i for i in cfg.target_layer_ids if i > info.num_layers]", CHECKPOINT),
    Mutant("s30-weights-vocab-mismatch", "a draft of another vocabulary than its target is refused", WTS,
           "    if info.vocab_size != cfg.vocab_size:", "    if False:", CHECKPOINT),
    Mutant("s30-weights-d2t-same-vocab", "a d2t table with equal vocabularies is a broken checkpoint", WTS,
           "        if d2t is not None:\n            raise", "        if False:\n            raise", CHECKPOINT),
    Mutant("s30-dspark-topk-vs-target-vocab", "dspark_draft_topk is bounded by the draft vocabulary", DSP,
           "        if topk > base.draft_vocab_size:", "        if topk > base.vocab_size:", DSPARK),
    Mutant("s30-dspark-signature-vocab-default", "a draft config without draft_vocab_size drafts the full vocabulary",
           DSP, '"draft_vocab_size": cfg.get("draft_vocab_size") or vocab,',
           '"draft_vocab_size": cfg.get("draft_vocab_size"),', DSPARK),
    Mutant("s30-consensus-value-after-failure", "a failed consensus hands no rank its value", CONS,
           "    return Outcome(value if failure is None else None, failure)",
           "    return Outcome(value, failure)", CONSENSUS),
    Mutant("s30-consensus-abandon-skipped", "ranks that built a value release it when another rank failed", CONS,
           "    if not outcome.ok and built and abandon is not None:", "    if False:", CONSENSUS),
)
