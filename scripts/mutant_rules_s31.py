"""Rule mutants of the thirty-first session: one for each rule its fixes made (settings, the
hello, the controller's learning, checkpoint reading as vLLM 0.33 reads it, the server's
startup, hello label, connections and pool, the client's frees, re-arming, lost messages and
anchors). Each names the tests that must notice."""
from __future__ import annotations

from mutant import Mutant

TF = "tests/test_transport_faults.py"
TC = "tests/test_transport_client.py"
CKPT = ("tests/test_dflash_checkpoint.py",)
S31_MUTANTS = (
    Mutant("s31-config-blank-env", "an exported but blank variable is unset, for every setting", "config.py",
           'elif setting.env and env.get(setting.env, "").strip():', "elif setting.env and setting.env in env:",
           ("tests/test_config.py",)),
    Mutant("s31-hello-internal-retried", "a hello refused INTERNAL is retried, not an incompatible server",
           "transport/link.py", "_HELLO_RETRIED = (p.ErrorCode.SHUTTING_DOWN.value, p.ErrorCode.INTERNAL.value)",
           "_HELLO_RETRIED = (p.ErrorCode.SHUTTING_DOWN.value,)", ("tests/test_link_review.py",)),
    Mutant("s31-hint-trimmed-learnt", "drafts the server's confidence trims count as expected acceptance",
           "vllm/spec_decode/controller.py", "        if learn.any():", "        if False:",
           ("tests/test_controller.py",)),
    Mutant("s31-expired-not-learnt", "drafts the GPU deadline dropped are not learnt as rejected",
           "vllm/spec_decode/pipeline.py", "                        self.controller.given = {}",
           "                        pass", ("tests/test_pipeline_watchdog.py",)),
    Mutant("s31-rope-theta-default", "a draft config without rope_theta gets the theta vLLM reads",
           "server/engines/dflash/config.py", "DEFAULT_ROPE_THETA = 10_000.0", "DEFAULT_ROPE_THETA = 1_000_000.0",
           CKPT),
    Mutant("s31-qwen3-head-dim", "a qwen3 draft config without head_dim gets Qwen3Config's 128",
           "server/engines/dflash/config.py",
           '    default_head_dim = QWEN3_HEAD_DIM if cfg.get("model_type") == "qwen3" else hidden // heads',
           "    default_head_dim = hidden // heads", CKPT),
    Mutant("s31-mask-embedding-refused", "a DFlash draft shipping mask_embedding.pt is refused, not ignored",
           "server/engines/dflash/weights.py", "    if config is None and (root / MASK_EMBEDDING_FILE).exists():",
           "    if False:", CKPT),
    Mutant("s31-sliding-by-flag", "layers use_sliding_window makes sliding are refused",
           "server/engines/dflash/config.py", "and first_sliding < layers", "and first_sliding > layers", CKPT),
    Mutant("s31-doctor-topk-override", "doctor checks the top-k --speculative-config sets",
           "doctor.py", '        if method == "dspark" and spec.get("dspark_draft_topk") is not None:',
           "        if False:", ("tests/test_doctor_dspark.py::test_a_top_k_set_in_the_speculative_config_is_the_one_checked",)),
    Mutant("s31-ipc-path-listened", "an --ipc-path a live server listens on fails startup", "server/cli.py",
           "        if args.ipc_path is not None and _listened_on(args.ipc_path):", "        if False:",
           ("tests/test_server_ipc.py",)),
    Mutant("s31-flag-nan", "--lease-s and --batch-wait-ms refuse nan and inf", "server/cli.py",
           "        if not math.isfinite(value):", "        if False:",
           ("tests/test_server.py::test_cli_validation_errors",)),
    Mutant("s31-hello-label-printable", "a hello label with unprintable characters is refused", "server/service.py",
           "        if len(req.msg.client) > CLIENT_LABEL_CHARS or not req.msg.client.isprintable():",
           "        if len(req.msg.client) > CLIENT_LABEL_CHARS:", ("tests/test_server_sessions.py",)),
    Mutant("s31-loop-drops-ended", "connections whose session ended are let go", "server/loop.py",
           "c.session is None or not store.is_open(c.session) or 0 < self.lease_s < now - c.last_seen)]",
           "c.session is None or 0 < self.lease_s < now - c.last_seen)]", ("tests/test_server_sessions.py",)),
    Mutant("s31-pool-never-fits", "rows longer than the whole pool drop nothing stored", "server/state.py",
           "        if blocks > pool.num_blocks:", "        if False:",
           ("tests/test_server_state_machine.py::test_rows_longer_than_the_whole_pool_drop_nothing_stored",)),
    Mutant("s31-free-behind-ingests", "a free goes out behind the deferred ingests queued before it",
           "transport/client.py", "        if not queued and not self.sender.idle:", "        if False:",
           (TC + "::test_a_free_never_overtakes_the_deferred_ingest_of_its_request",)),
    Mutant("s31-rearmed-still-freed", "a request the link re-armed is freed when it leaves", "transport/book.py",
           "                rec.sent = rec.sent and rec.epoch == self.epoch", "                rec.sent = False",
           (TF + "::test_a_request_the_link_rearmed_is_freed_when_it_leaves",)),
    Mutant("s31-lost-rows-known", "a new request whose rows came while the hello was in flight drafts later",
           "transport/client.py", "            self.book.resolve(ids)\n", "",
           (TF + "::test_a_new_request_whose_rows_came_while_the_hello_was_in_flight_drafts_once_the_link_is_up",)),
    Mutant("s31-resync-from-row-zero", "a re-armed request whose rows start at 0 stops asking for its history",
           "transport/attach.py", "        for i in order[plan.starts[order] == 0].tolist():",
           "        for i in order[plan.starts[order] < 0].tolist():",
           (TF + "::test_a_rearmed_request_that_starts_over_from_its_first_row_stops_asking_for_its_history",)),
    Mutant("s31-reconnect-behind-ingests", "a prefix-cache hit's reconnect goes behind the deferred ingests "
           "queued before it", "transport/client.py", "        if self.sender.idle:\n", "        if True:\n",
           ("tests/test_transport_hidden.py::test_a_prefix_hit_never_overtakes_the_deferred_rows_it_attaches_to",)),
    Mutant("s31-anchor-before-rows", "a request whose anchor lies before its rows sits the step out alone",
           "transport/attach.py", "order[plan.starts[order] < 0]", "order[plan.starts[order] < -(1 << 40)]",
           (TC + "::test_an_anchor_before_its_own_rows_costs_that_request_only",)),
)
