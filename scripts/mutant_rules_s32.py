"""Rule mutants of the thirty-second session: one for each rule its fixes made (the TP ranks'
agreement on the DMA threshold, the crossover cache's temporary file, DSpark layouts as vLLM 0.33
judges them, doctor's verdicts as vLLM's, the draft TP hook, the loop's silent connections, frees
lost with the link, a taken HTTP port, reply versions). Each names the tests that must notice."""
from __future__ import annotations

from mutant import Mutant

DOC = "tests/test_doctor.py"
V33 = ".venv-vllm033"
S32_MUTANTS = (
    Mutant("s32-threshold-compared-exactly", "ranks agree on the exact DMA threshold, not its printed form",
           "comm/build.py", "            self.threshold, self.max_bytes, self.world,",
           "            str(self.threshold), self.max_bytes, self.world,", ("tests/test_comm_consensus.py",)),
    Mutant("s32-crossover-tmp-removed", "a crossover cache write that fails leaves no temporary file",
           "comm/crossover.py", "                    os.unlink(tmp)", "                    pass",
           ("tests/test_comm_router.py",)),
    Mutant("s32-nested-anchor-false-served", "dflash_config.sample_from_anchor false is served, as vLLM serves it",
           "server/engines/dflash/dspark_config.py", '    if dflash.pop("sample_from_anchor", False):',
           '    if "sample_from_anchor" in dflash:', ("tests/test_dspark_rules.py",)),
    Mutant("s32-doctor-ngram-defaults", "doctor takes ngram sizes left out as vLLM's 5/5", "doctor.py",
           "        lo = hi = 5", "        pass", (DOC,)),
    Mutant("s32-doctor-dflash-renamed", "doctor gates a dflash draft under vLLM's DFlash{arch} name",
           "vllm/spec_decode/methods.py", '    if method == "dflash":\n        return [',
           '    if method == "dflash-no":\n        return [', (DOC,)),
    Mutant("s32-doctor-draft-tp-refused", "doctor fails a draft TP vLLM refuses", "doctor.py",
           "    if draft_tp not in (1, tensor_parallel_size):", "    if False:", (DOC,)),
    Mutant("s32-doctor-curve-checked", "doctor refuses CURVE keys that cannot serve, naming the flag", "doctor.py",
           "        _check_curve(args.curve_server_key, args.curve_client_key)", "        pass", (DOC,)),
    Mutant("s32-doctor-dspark-k-from-block", "doctor takes a dspark K left out from the draft's block size",
           "doctor.py", '            k = draft.get("block_size", draft.get("dspark_block_size"))', "            pass",
           ("tests/test_doctor_dspark.py",)),
    Mutant("s32-draft-tp-only-when-remote", "draft TP 1 is forced only for a draft the server drafts",
           "vllm/spec_decode/hooks.py", " and _has_address(self) and not stays_local(spec):",
           " and _has_address(self):", ("tests/test_vllm_rules.py",)),
    Mutant("s32-loop-forgets-silent-conns", "a connection silent for the lease is forgotten", "server/loop.py",
           " or not store.is_open(c.session) or 0 < self.lease_s < now - c.last_seen)]:",
           " or not store.is_open(c.session))]:", ("tests/test_server_sessions.py",)),
    Mutant("s32-free-lost-with-link-resent", "a free lost with the link is sent again once it is back",
           "transport/client.py", "p.Free(handles, retain), lost=lambda: self.book.hold_frees(handles, retain))",
           "p.Free(handles, retain))", ("tests/test_transport_faults.py",)),
    Mutant("s32-http-port-taken", "a taken --http-port is a startup error naming the flag", "server/cli.py",
           "    except OSError as exc:\n        raise StartupError(f\"cannot serve http",
           "    except ZeroDivisionError as exc:\n        raise StartupError(f\"cannot serve http",
           ("tests/test_server_ipc.py",)),
    Mutant("s32-cli-numbers-in-range", "a probe timeout below 1 is a usage error naming the flag", "cli.py",
           'probe.add_argument("--timeout-ms", type=int_in(1), default=5000)',
           'probe.add_argument("--timeout-ms", type=int, default=5000)', (DOC,)),
    Mutant("s32-tp-ranks-agree", "remote drafting is on on every TP rank or on none", "vllm/spec_decode/v2.py",
           "        if not every_rank(self.disabled is None) and self.disabled is None:", "        if False:",
           ("tests/test_vllm_v2_tp.py",), V33),
    Mutant("s32-held-dropped-at-free", "rows held for a request are dropped at its free", "vllm/spec_decode/v2.py",
           "                    self.core.on_free = self.hold.drop", "                    pass",
           ("tests/test_vllm_v2_held.py",), V33),
    Mutant("s32-fewer-drafts-blanked", "columns past a step's K hold no drafts", "vllm/spec_decode/v2.py",
           "                self.drafts[:r, k:].fill_(-1)", "                pass",
           ("tests/test_vllm_v2_propose.py",), V33),
    Mutant("s32-reply-version-checked", "a reply of another version is BAD_VERSION even when it parses",
           "protocol/replies.py", "    if head.v != PROTOCOL_VERSION:", "    if False:", ("tests/test_protocol.py",)),
)
