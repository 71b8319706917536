"""Rule mutants of the settings reader (``config.py``), the server's metrics (``server/metrics.py``),
the runner-independent step (``vllm/spec_decode/core.py``) and the host fence
(``vllm/spec_decode/fence.py``) (twenty-second session, second helper). Each is written from a rule
a user or operator relies on (additional_config wins over the environment; an address names a real
port; an empty variable means unset; a bad switch is refused naming its key; the metrics count what
happened; a one-token request is skipped; a fence releases the step it was signalled for), not from
the tests; each names the tests that must notice."""
from __future__ import annotations

from mutant import Mutant

S22B_MUTANTS = (
    # ------------------------------------------------------------- config.py
    Mutant("s22b-config-env-wins", "additional_config wins over the environment", "config.py",
           "        if setting.field in section:\n            key, raw = f\"additional_config.k3_accel.{setting.field}\", "
           "section[setting.field]\n        elif setting.env and env.get(setting.env, \"\").strip():      # exported but blank: "
           "unset\n            key, raw = setting.env, env[setting.env]",
           "        if setting.env and env.get(setting.env, \"\").strip():\n            key, raw = setting.env, env[setting.env]\n"
           "        elif setting.field in section:\n            key, raw = f\"additional_config.k3_accel.{setting.field}\", "
           "section[setting.field]",
           ("tests/test_config.py", "tests/test_comm_config.py")),
    Mutant("s22b-config-port-zero-accepted", "a draft address's port is 1..65535 (port 0 is a ConfigError naming the key)",
           "config.py", "0 < int(port) < 65536", "0 <= int(port) < 65536",
           ("tests/test_rules_config_s22.py::test_an_address_whose_port_is_not_1_to_65535_is_refused_naming_its_key",
            "tests/test_config.py", "tests/test_transport_settings.py")),
    Mutant("s22b-config-blank-is-set", "an empty or blank string setting means unset (an empty address: stock vLLM)",
           "config.py", "        return value.strip() or None", "        return value.strip()",
           ("tests/test_rules_config_s22.py::test_an_empty_or_blank_setting_means_unset",
            "tests/test_config.py", "tests/test_comm_config.py", "tests/test_transport_settings.py")),
    Mutant("s22b-config-switch-garbage-is-off", "a switch that is not on/off (true/false, 1/0) is a ConfigError naming its key",
           "config.py", '        if isinstance(value, bool) or text in ("1", "0", "true", "false", "on", "off", "yes", "no"):',
           "        if True:",
           ("tests/test_config.py",)),
    # ------------------------------------------------------------- server/metrics.py
    Mutant("s22b-metrics-errors-counted-once", "the stats op's errors count every error returned, per code",
           "server/metrics.py", "        self.errors[code] += 1", "        self.errors[code] = 1",
           ("tests/test_rules_config_s22.py::test_the_stats_errors_count_every_error_returned_per_code",
            "tests/test_server_metrics.py", "tests/test_server_hostile.py")),
    # ------------------------------------------------------------- vllm/spec_decode/core.py
    Mutant("s22b-core-skip-rule-strict", "a request that emits at most one token (max_tokens <= 1) is skipped",
           "vllm/spec_decode/core.py", "    return np.asarray(max_tokens, dtype=np.int64) <= 1",
           "    return np.asarray(max_tokens, dtype=np.int64) < 1",
           ("tests/test_vllm_core.py",)),
    # ------------------------------------------------------------- vllm/spec_decode/fence.py
    Mutant("s22b-fence-wait-strict", "signal(seq) releases the wait for seq itself, not only later ones",
           "vllm/spec_decode/fence.py", "lambda: self._value >= seq", "lambda: self._value > seq",
           ("tests/test_vllm_rules.py",)),
)
