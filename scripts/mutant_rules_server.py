"""Rule mutants of the draft server's edges and engines that the first rule set left out: one per module
(the Triton kernels and CUDA graphs only with a GPU). Written from each module's rule, not its tests."""
from __future__ import annotations

from mutant import Mutant

D = "server/engines/dflash/"
V33 = ".venv-vllm033"    # the DSpark math is checked against vLLM 0.33's own module

SERVER_MUTANTS = (
    Mutant("cli-bind-without-curve", "k3-draft-server binds a non-loopback host only with CURVE or the flag",
           "server/cli.py", "check_bind(args.host, bool(args.curve_secret_key), args.allow_insecure_remote)",
           "check_bind(args.host, True, args.allow_insecure_remote)", ("tests/test_curve.py",)),
    Mutant("http-always-ready", "/readyz says 503 until the engine is loaded and accepting", "server/http.py",
           "self._send(200 if ok else 503,", "self._send(200,", ("tests/test_server.py", "tests/test_server_metrics.py")),
    Mutant("loop-closed-session-kept", "a connection whose session ended (bye elsewhere) is unbound",
           "server/loop.py", "        if conn.session is not None and not self.service.store.is_open(conn.session):",
           "        if False:", ("tests/test_server_sessions.py", "tests/test_server_state_machine.py")),
    Mutant("base-room-unchecked", "an ingest is admitted only with pool room for it", "server/engines/base.py",
           "        return self.pool.blocks_needed(self.table(state), start, count)", "        return 0",
           ("tests/test_server_capacity.py", "tests/test_server_state_machine.py")),
    # ------------------------------------------------------------- DFlash checkpoint and engine
    Mutant("dflash-config-swa", "a sliding-window DFlash draft is refused, not served with full attention",
           D + "config.py", '    if dcfg.get("use_swa") or "sliding_attention" in layer_types or by_flag:', "    if False:",
           ("tests/test_dflash_checkpoint.py",)),
    Mutant("weights-d2t-past-vocab", "d2t never maps a draft id past the target's vocabulary", D + "weights.py",
           "    if target_ids.min() < 0 or target_ids.max() >= cfg.vocab_size:", "    if target_ids.min() < 0:",
           ("tests/test_dflash_checkpoint.py",)),
    Mutant("tensors-escape-dir", "a checkpoint's files lie inside its directory", D + "tensors.py",
           "    if real != real_root and real_root not in real.parents:", "    if False:",
           ("tests/test_dflash_checkpoint.py",)),
    Mutant("kv-fork-no-copy", "a fork's copied partial block holds the source's K/V", D + "kv_cache.py",
           "        self.kv[:, :, dst, :rows] = self.kv[:, :, src, :rows]", "        pass",
           ("tests/test_dflash_engine.py", "tests/test_dflash_pool.py", "tests/test_server_dflash.py")),
    Mutant("host-tables-lose-head", "a grown block-table mirror keeps its first blocks", D + "host_tables.py",
           "            grown[:first] = arr[:first]", "            pass",
           ("tests/test_host_tables.py", "tests/test_dflash_engine.py", "tests/test_dflash_pool.py", "tests/test_server_dflash.py")),
    Mutant("model-d2t-unmapped", "a reduced-vocabulary draft's ids are mapped to target ids", D + "model.py",
           "    return ids if fw.d2t is None else ids + fw.d2t[ids]", "    return ids",
           ("tests/test_dflash_engine.py",)),
    Mutant("ops-torch-not-causal", "a causal draft's block queries see only earlier block keys", D + "ops_torch.py",
           "        block_ok = block_ok.tril()", "        pass", ("tests/test_dflash_engine.py",)),
    Mutant("engine-ingest-past-pool", "an ingest the pool cannot hold is CAPACITY, nothing changed",
           D + "engine.py", "        if need > self.pool.free_blocks:", "        if False:",
           ("tests/test_dflash_pool.py", "tests/test_dflash_engine.py", "tests/test_server_dflash.py")),
    Mutant("triton-any-block-size", "the Triton kernels run only block sizes they support", D + "ops_triton.py",
           "    if not _pow2(block_rows):", "    if False:", ("tests/test_dflash_gpu.py",)),
    Mutant("triton-attention-scale", "paged attention scales by head_dim^-0.5 (GPU kernel)", D + "triton_attention.py",
           "(hd ** -0.5) * _LOG2E", "(hd ** -0.5) * _LOG2E * 1.25", ("tests/test_dflash_gpu.py",)),
    Mutant("graphs-no-max-bucket", "every batch size up to the maximum has a captured graph", D + "graphs.py",
           "        self.buckets = sorted({b for b in BUCKETS if b < max_batch} | {max_batch})",
           "        self.buckets = sorted({b for b in BUCKETS if b < max_batch})",
           ("tests/test_dflash_gpu.py", "tests/test_graph_stored_rows.py")),
    # ------------------------------------------------------------- DSpark
    Mutant("dspark-capture-ids-unshifted", "eagle capture indices are layer id + 1", D + "dspark_config.py",
           "        return [int(i) - 1 for i in captured]", "        return [int(i) for i in captured]",
           ("tests/test_dspark_rules.py", "tests/test_dspark_engine.py", "tests/test_doctor_dspark.py"), V33),
    Mutant("dspark-d2t-unmapped", "DSpark draft ids are mapped to target ids", D + "ops_torch.py",
           "        prev = pick if d2t is None else pick + d2t[pick]", "        prev = pick",
           ("tests/test_dspark_vllm_module.py",), V33),
    Mutant("dspark-claims-confidence", "hello advertises confidence only with a confidence head",
           D + "dspark_engine.py", "confidence=self.heads.confidence_w is not None", "confidence=True",
           ("tests/test_dspark_rules.py", "tests/test_dspark_engine.py", "tests/test_doctor_dspark.py")),
    Mutant("dspark-half-confidence-head", "a checkpoint with half a confidence head is refused",
           D + "dspark_weights.py", "    if cfg.confidence_head and len(present) == 3:", "    if False:",
           ("tests/test_dspark_rules.py", "tests/test_dspark_engine.py")),
)
