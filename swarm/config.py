"""Every SWARM_* setting, typed, with its default. Read here and nowhere else.

``Settings.from_env()`` fails loudly, naming the variable, when a value cannot be used.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import platformdirs

from swarm.errors import ConfigError

APP_NAME = "swarm"


def default_data_dir(role: str) -> Path:
    """Where a leader or fellow keeps its state when --data-dir is not given (platformdirs' user data dir)."""
    return Path(platformdirs.user_data_dir(APP_NAME)) / role


@dataclasses.dataclass(frozen=True)
class Settings:
    # --- where to find a leader (CLI commands that talk to one) ---
    leader_url: str | None = None  # SWARM_LEADER
    token: str | None = None  # SWARM_TOKEN
    data_dir: Path | None = None  # SWARM_DATA_DIR

    # --- serving (fellow side) ---
    serve_port: int = 5559  # SWARM_SERVE_PORT: where a stage listens for its previous stage (0 = any free port)
    serve_host: str = "0.0.0.0"  # SWARM_SERVE_HOST: the address that port listens on (127.0.0.1: this machine only)
    serve_prefill_chunk: int = 256  # SWARM_SERVE_PREFILL_CHUNK: prompt tokens per pass through the ring
    model_idle_unload_s: float = 900.0  # SWARM_MODEL_IDLE_UNLOAD_S (0 keeps a model loaded)
    # SWARM_SERVE_MEMORY_GB: the most memory (GB) this fellow lends to the stages it holds, all models together; 0: all
    # it has free
    serve_memory_gb: float = 0.0
    heartbeat_s: float = 5.0  # SWARM_HEARTBEAT_S: fellow -> leader hardware report period
    device: str = "auto"  # SWARM_DEVICE: auto, cpu, cuda, cuda:N
    serve_max_batch: int = 16  # SWARM_SERVE_MAX_BATCH: requests one pass of a stage takes at most (1: no batching)
    threads: int = 0  # SWARM_THREADS: torch threads of a fellow (0: torch's choice, the machine's cores)
    calibrate: bool = True  # SWARM_CALIBRATE: time a decoder layer on this fellow's device for the planner (0: off)
    # SWARM_CALIBRATE_CPU_S: the CPU time (all its threads) that calibration may spend; past it, each figure still to
    # come is timed once. It runs at the lowest priority and is cached per machine and hardware, so it is paid once.
    calibrate_cpu_s: float = 15.0
    # SWARM_INT4_KERNEL: int4-fast layers on CPU computed by swarm's own kernel, compiled for this CPU on first use
    # (needs a C compiler); 0: torch's int4 kernel, as nf4
    int4_kernel: bool = True

    # --- serving (leader side) ---
    pipeline_transport: str = "auto"  # SWARM_PIPELINE_TRANSPORT: auto (direct, relay on failure), direct, relay
    # SWARM_SERVE_CONTEXT_TOKENS: a cap on every model's served context -- the longest conversation (prompt and reply)
    # it takes, which its stages budget KV cache for. Unset: each model's own (its config's max_position_embeddings);
    # a load may cap one model lower (context_tokens on the load call, --context-tokens)
    serve_context_tokens: int | None = None
    # SWARM_SERVE_KV_CACHE: how stages hold keys and values unless a load says (swarm.kv_kinds): auto (the compute
    # dtype), f32, f16, or q8 (8 bits with a scale per 32 values: about half of f16)
    serve_kv_cache: str = "auto"
    serve_typical_tokens: int = 1024  # SWARM_SERVE_TYPICAL_TOKENS
    # SWARM_SERVE_PREFIX_CACHE_TOKENS: prompt tokens whose KV each stage keeps for later prompts that start the same
    # way (0: no prefix cache); unset: what the model's KV budget leaves free beside its running requests
    serve_prefix_cache_tokens: int | None = None
    max_tokens_limit: int = 4096  # SWARM_MAX_TOKENS_LIMIT: the most tokens one reply may ask for (max_tokens)
    rendezvous_port: int | None = None  # SWARM_RENDEZVOUS_PORT: UDP port telling fellows their public address
    direct_connect_timeout_s: float = 3.0  # SWARM_DIRECT_CONNECT_TIMEOUT_S
    request_stall_s: float = 120.0  # SWARM_REQUEST_STALL_S: a request with no new token for this long has failed
    serve_failover_wait_s: float = 300.0  # SWARM_SERVE_FAILOVER_WAIT_S: how long a lost stage may take to re-place
    # SWARM_LEAVE_WAIT_S: how long a fellow that leaves (`swarm leave`, SIGTERM, Drain) waits for its stages to be
    # handed over before it goes anyway (SIGTERM, --force) or stays (`swarm leave`); a service manager's stop timeout
    # (systemd: 90 s) must be longer
    leave_wait_s: float = 60.0
    serve_hot_cover: bool = False  # SWARM_SERVE_HOT_COVER: standbys keep loaded copies of stages (also an admin switch)
    # SWARM_SERVE_AUTO_LOAD: a request for a model that is imported but not loaded loads it when its pool has room (the
    # request waits meanwhile); 0: it gets a 503 (also an admin switch, which overrides this once used)
    serve_auto_load: bool = True
    # SWARM_SERVE_EVICT_IDLE: when the pool has no room for such a load, the least recently used model that no request
    # uses is unloaded first (also an admin switch, which overrides this once used)
    serve_evict_idle: bool = False
    # SWARM_SERVE_VERIFY: the chance that a pass of a stage is recomputed by another fellow holding the same layers and
    # compared (0: off; 0.02 checks one pass in 50); also an admin switch. Standbys hold the checkers (hot covers).
    serve_verify: float = 0.0
    serve_queue_timeout_s: float = 900.0  # SWARM_SERVE_QUEUE_TIMEOUT_S: a request waits this long to start (503)
    serve_queue_limit: int = 256  # SWARM_SERVE_QUEUE_LIMIT: requests waiting per model; more are refused (429)
    # SWARM_SERVE_REQUEST_REPLIES: replies one API request may ask for (prompts x n); more are refused (400
    # too_many_replies), so that one request cannot fill the queue
    serve_request_replies: int = 64
    # SWARM_SERVE_SPECULATIVE: drafting ahead, up to N tokens guessed per pass by prompt lookup, for models loaded from
    # now on (0: off); only while a model has no more chats than stages, on rings whose fellows all support it
    serve_speculative: int = 0
    # SWARM_SERVE_DRAFT_MODEL: with SWARM_SERVE_SPECULATIVE, the last stage of a model over several fellows also guesses
    # with a small model of its family it holds whole: auto (the smallest imported model of the pool with the same
    # tokenizer) or a model's name; unset: prompt lookup alone
    serve_draft_model: str | None = None
    # SWARM_SERVE_REBALANCE: live moves (swarm.leader.serving.rebalance) -- off; propose (a stage move or a re-layout
    # the planner predicts at least 1.3x faster is shown on GET /api/v1/rebalance); auto (and applied: load beside,
    # switch at a token boundary, unload the old stages)
    serve_rebalance: str = "propose"
    serving_history_days: float = 7.0  # SWARM_SERVING_HISTORY_DAYS: how long the leader keeps finished requests
    # SWARM_METRICS_TOKEN: a bearer token that may read GET /metrics (for a Prometheus server); admins always may
    metrics_token: str | None = None
    # SWARM_API_TOKENS_PER_USER: API tokens one user may keep; creating one more is refused (409) until some are deleted
    api_tokens_per_user: int = 100
    # SWARM_DATABASE_URL: the leader's store on PostgreSQL (postgresql://user:password@host/db); unset, a SQLite file
    # in its data dir (leader.db). `swarm admin migrate-db --to URL` copies a SQLite leader over.
    database_url: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        values: dict[str, Any] = {}  # each parsed to its field's type by _parse
        names = cls.variables()
        for field in dataclasses.fields(cls):
            name = names[field.name]
            raw = env.get(name)
            if raw is None or raw == "":
                continue
            values[field.name] = _parse(name, raw, field.type)
        settings = cls(**values)
        settings.validate()
        return settings

    @classmethod
    def variables(cls) -> dict[str, str]:
        """Each setting's field name -> the SWARM_* variable it is read from (the README's settings table)."""
        return {f.name: "SWARM_LEADER" if f.name == "leader_url" else "SWARM_" + f.name.upper()
                for f in dataclasses.fields(cls)}

    def validate(self) -> None:
        if self.pipeline_transport not in ("auto", "direct", "relay"):
            raise ConfigError(
                f"SWARM_PIPELINE_TRANSPORT is {self.pipeline_transport!r}; use auto, direct or relay."
            )
        if self.serve_rebalance not in ("off", "propose", "auto"):
            raise ConfigError(f"SWARM_SERVE_REBALANCE is {self.serve_rebalance!r}; use off, propose or auto.")
        if not 0 <= self.serve_port <= 65535:
            raise ConfigError(f"SWARM_SERVE_PORT is {self.serve_port}; use a port number from 0 to 65535.")
        if self.serve_prefill_chunk < 1:
            raise ConfigError("SWARM_SERVE_PREFILL_CHUNK must be at least 1 token.")
        if self.serve_max_batch < 1:
            raise ConfigError("SWARM_SERVE_MAX_BATCH must be at least 1 request.")
        if self.serve_queue_limit < 1:
            raise ConfigError("SWARM_SERVE_QUEUE_LIMIT must be at least 1 request.")
        if self.serve_request_replies < 1:
            raise ConfigError("SWARM_SERVE_REQUEST_REPLIES must be at least 1 reply per request.")
        if self.serving_history_days <= 0:
            raise ConfigError("SWARM_SERVING_HISTORY_DAYS must be more than 0 days (the 15-minute view needs them).")
        if self.database_url is not None and not self.database_url.lower().startswith(("postgresql://",
                                                                                        "postgres://")):
            raise ConfigError("SWARM_DATABASE_URL must be a postgresql:// URL (postgresql://user:password@host/db); "
                              "unset it to keep the leader's store in its data dir.")
        if not 0 <= self.serve_speculative <= 16:
            raise ConfigError(f"SWARM_SERVE_SPECULATIVE is {self.serve_speculative}; use 0 (off) to 16 tokens guessed "
                              "per pass (2 to 4 is typical).")
        if self.serve_draft_model is not None and self.serve_speculative <= 0:
            raise ConfigError(f"SWARM_SERVE_DRAFT_MODEL is {self.serve_draft_model!r}, but drafting ahead is off: the "
                              "draft model guesses the tokens SWARM_SERVE_SPECULATIVE=N asks for. Set "
                              "SWARM_SERVE_SPECULATIVE=2 (to 4) as well, or unset SWARM_SERVE_DRAFT_MODEL.")
        if self.api_tokens_per_user < 1:
            raise ConfigError(f"SWARM_API_TOKENS_PER_USER is {self.api_tokens_per_user}; use at least 1 (the default "
                              "is 100).")
        if self.calibrate_cpu_s <= 0:
            raise ConfigError(f"SWARM_CALIBRATE_CPU_S is {self.calibrate_cpu_s:g}; use more than 0 seconds (15 is the "
                              "default), or SWARM_CALIBRATE=0 to skip the calibration.")
        if self.serve_memory_gb < 0:
            raise ConfigError(f"SWARM_SERVE_MEMORY_GB is {self.serve_memory_gb:g}; use 0 (all free memory) or the GB "
                              "this fellow lends to its stages.")
        if self.serve_context_tokens is not None and self.serve_context_tokens < 16:
            raise ConfigError(f"SWARM_SERVE_CONTEXT_TOKENS is {self.serve_context_tokens}; use at least 16 tokens, or "
                              "unset it to serve each model's own context.")
        if self.serve_kv_cache not in ("auto", "f32", "f16", "q8"):
            raise ConfigError(f"SWARM_SERVE_KV_CACHE is {self.serve_kv_cache!r}; use auto (the stages' compute "
                              "dtype), f32, f16 or q8.")
        if self.serve_prefix_cache_tokens is not None and self.serve_prefix_cache_tokens < 0:
            raise ConfigError(f"SWARM_SERVE_PREFIX_CACHE_TOKENS is {self.serve_prefix_cache_tokens}; use 0 (no prefix "
                              "cache) or more tokens, or unset it to use what the KV budget leaves free.")
        if not 0 <= self.serve_verify <= 1:
            raise ConfigError(f"SWARM_SERVE_VERIFY is {self.serve_verify:g}; use a fraction of the passes from 0 "
                              "(off) to 1 (every pass), such as 0.02.")


def _parse(name: str, raw: str, annotation: object) -> object:
    kind = str(annotation)
    if kind == "bool":
        if raw.strip().lower() in ("1", "true", "yes", "on"):
            return True
        if raw.strip().lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name}={raw!r} is not a valid switch; use 1 or 0.")
    try:
        if "int" in kind and "str" not in kind:
            return int(raw)
        if "float" in kind:
            return float(raw)
        if "Path" in kind:
            return Path(raw).expanduser()
        return raw
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a valid {kind.split()[0]}; fix or unset it.") from None
