"""Every Tandem setting, typed, in one place. Services and the CLI read settings from here.

Kernel settings live in `config_kernels.py` (importable from here), the host KV tier's in
`config_host_tier.py`; `config_options.py` makes a field a `--flag` and a TANDEM_* variable,
`stage_args.py` builds each stage's command line, `device.py` resolves the device and dtypes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

from tandem.config_host_tier import HostTierSettings
from tandem.config_kernels import ENGINE_FIELDS as KERNEL_ENGINE_FIELDS
from tandem.config_kernels import KernelConfig
from tandem.config_kernels import kernel_config as kernel_config  # re-exported: the settings API
from tandem.config_kernels import set_kernel_config as set_kernel_config
from tandem.config_options import parse_value
from tandem.tenants import parse_tenant_quotas

DTYPES = ("float32", "float16", "bfloat16")


@dataclass
class EngineConfig(HostTierSettings):
    """Settings of one engine (in-process `LLM`, a prefill worker or a decode worker)."""

    model: str | None = None  # None: the embedded default (SmolLM2-135M-Instruct GGUF)
    device: str = "auto"  # "auto": cuda when available, else cpu
    dtype: str = "auto"  # "auto": bfloat16 on cuda, float32 on cpu
    block_size: int = 16
    # The KV pool (tandem/kv/sizing.py): num_blocks, else kv_cache_memory_gb, else 1 GiB on a
    # CPU; on a GPU, what this worker's gpu_memory_utilization share of the device leaves.
    num_blocks: int | None = None
    kv_cache_memory_gb: float | None = field(
        default=None, metadata={"default_help": "1 on a CPU; on a GPU, --gpu-memory-utilization"}
    )
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_queued_seqs: int = 1024  # waiting sequences; more are refused (RESOURCE_EXHAUSTED)
    max_model_len: int | None = None  # None: the model's context length
    # KV cache storage: "auto" (the model dtype), "fp8" (e4m3) or "int8" (scale per block, head).
    kv_dtype: str = "auto"
    # Linear weights: "auto" (as the checkpoint stores them: a `tandem quantize` output loads
    # quantized; a GGUF file keeps its Q4_1 / Q8_0 codes on CPU, the embedding and LM head too,
    # and is dequantized to float on CUDA), "int4" (GGUF Q4_1 tensors load natively as INT4 g32,
    # float weights are quantized at load to INT4 g128 by round-to-nearest) or "none" (all float).
    quantization: str = "auto"
    # CUDA only: captured CUDA graphs for decode batches up to max_num_seqs (not FP8/INT8 KV).
    cuda_graphs: bool = True
    # Launch step t+1 before reading step t's sampled tokens, so the GPU never waits for Python
    # (plain decode batches without logprobs or repetition penalty; others run step by step).
    # Finished sequences are noticed one step late and the extra token dropped. None: on for a
    # CUDA device; off on CPU, where Python waits for each step and there is nothing to overlap.
    async_scheduling: bool | None = field(
        default=None, metadata={"default_help": "on for a CUDA device, off on CPU"}
    )
    # Prefix caching: full KV blocks are kept by content after their sequence ends and shared by
    # later sequences with the same prefix (which compute only the rest); LRU-evicted when full.
    enable_prefix_cache: bool = True
    # Most prompt tokens one sequence computes per step (chunked prefill: longer prompts take
    # several steps, mixed with decodes); None: the step budget, max_num_batched_tokens.
    prefill_chunk: int | None = None
    # Time-per-output-token target in ms: while sequences decode, a step takes only as many
    # tokens (prompt chunks, joining sequences) as the measured step time says fit. None: off.
    tpot_slo_ms: float | None = None
    # Tenant KV quotas (tandem/tenants.py), "NAME=FRACTION" items (the flag repeats; commas also
    # separate them): a tenant's running sequences, leases and cached prefix blocks hold at most
    # that fraction of the pool; "NAME" alone: an equal share of what the fractions leave. Other
    # tenants are refused; cached blocks are evicted LRU-2 per tenant. None: one pool, plain LRU.
    tenant_quota: str | None = field(default=None, metadata={"repeatable": True})
    # Structured output: compiled grammars are cached by content, LRU-evicted past this many MiB
    # (one that alone compiles larger is refused); each compiles off the engine's thread, for at
    # most this many seconds (then its request fails naming the setting; others go on). The
    # default is under the 30 s prefill lease TTL, which a decode worker's compile counts against.
    # A sequence whose grammar takes longer than grammar_token_budget_ms for one token (its mask
    # or its advance; ambiguous grammars grow without bound) fails naming it: its batch waits.
    grammar_cache_mb: int = 256
    grammar_compile_timeout_s: float = 20.0
    grammar_token_budget_ms: float = 30.0

    def tenant_quotas(self) -> dict[str, float]:
        """{tenant: fraction of the KV pool} from tenant_quota ({} when unset)."""
        return parse_tenant_quotas([self.tenant_quota]) if self.tenant_quota else {}

    # Kernel settings (see KernelConfig; they hold for the whole process). Multi-token attention
    # on CUDA: "auto", "triton" or "sdpa".
    prefill_attention: str = "auto"
    # Bit-reproducible steps: the one-row INT4 GEMVs sum their K split in a fixed order instead
    # of adding into a float32 row with float atomics (slower on the H200).
    deterministic: bool = False
    # Programmatic dependent launch of the decode kernels (Hopper and later GPUs).
    pdl: bool = True

    def kernel_config(self) -> KernelConfig:
        """The kernel settings of this engine."""
        return KernelConfig(**{name: getattr(self, name) for name in KERNEL_ENGINE_FIELDS})

    def validate(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_queued_seqs"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if not 0 < (u := self.gpu_memory_utilization) <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {u!r}")
        if self.prefill_chunk is not None and (
            not isinstance(self.prefill_chunk, int) or self.prefill_chunk < 1
        ):
            raise ValueError(
                f"prefill_chunk must be a positive integer, got {self.prefill_chunk!r}"
            )
        for name in ("tpot_slo_ms", "grammar_compile_timeout_s", "grammar_token_budget_ms"):
            if (v := getattr(self, name)) is not None and not v > 0:
                raise ValueError(f"{name} must be > 0, got {v!r}")
        if not isinstance(self.grammar_cache_mb, int) or self.grammar_cache_mb < 1:
            raise ValueError(
                f"grammar_cache_mb must be a positive integer, got {self.grammar_cache_mb!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.kv_dtype not in ("auto", "fp8", "int8"):
            raise ValueError(f"kv_dtype must be one of auto, fp8, int8; got {self.kv_dtype!r}")
        if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be auto, cpu, cuda, cuda:N or mps; got {self.device!r}")
        self.tenant_quotas()  # raises naming what is wrong
        self.validate_host_tier()
        if self.quantization not in ("auto", "int4", "none"):
            raise ValueError(f"quantization must be auto, int4 or none; got {self.quantization!r}")
        self.kernel_config().validate()

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        """Build from keyword options, then TANDEM_* environment variables for those not given."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        cfg = cls(**options)
        for name, f in known.items():
            env = os.environ.get(f"TANDEM_{name.upper()}")
            if env is None or name in options:
                continue
            setattr(cfg, name, parse_value(env, f.type, name))
        cfg.validate()
        return cfg


@dataclass
class GatewayConfig:
    """Limits and security settings of the public gateway."""

    # Requests with no first token yet, and in progress (RESOURCE_EXHAUSTED beyond): a burst of
    # max_inflight sent at once is admitted whole, as one decode worker holds more.
    max_waiting: int = 1024
    max_inflight: int = 1024
    max_prompt_tokens: int | None = None  # None: the model's context minus one
    max_tokens_limit: int | None = None  # largest accepted max_tokens; None: the model's context
    max_stop_strings: int = 16
    max_stop_length: int = 256  # characters per stop string
    max_messages: int = 512
    max_prompt_chars: int = 1_000_000
    # Bytes of a structured-output grammar (a JSON schema's text, a regex, an EBNF grammar, the
    # choices, a forced tool call's schema): larger ones are refused (HTTP 400).
    max_grammar_bytes: int = 131_072
    # Streams per gRPC connection: past it clients get streams refused (UNAVAILABLE), not queued.
    max_concurrent_streams: int = 1024
    # When set, clients must send `authorization: Bearer <key>`. A credential (this and the
    # fields below marked so): an empty TANDEM_* variable for it is an error, not "unset".
    api_key: str | None = field(default=None, metadata={"credential": True})
    # The API key read from a file (its first line): no command line shows it (nor the variable).
    api_key_file: str | None = field(default=None, metadata={"credential": True})
    # Several API keys, each naming a tenant: a file of `TENANT KEY` lines. The key that
    # authenticates a request names its tenant (api_key, when also set, is tenant `default`).
    # Without keys the tenant comes from the client: `X-Tenant` / gRPC metadata `x-tenant`.
    api_keys: str | None = field(default=None, metadata={"credential": True})
    tls_cert: str | None = None  # PEM files: TLS on the public gRPC and HTTP ports
    tls_key: str | None = None
    # The HTTP listener (services/gateway/http_limits.py): connections at most (503 beyond), per
    # client address (429 beyond; by default all: behind a proxy every client has its address),
    # and seconds for a request's headers, its body, a keep-alive connection's idle wait, and a
    # client to take any of a response (then it is closed; gRPC streams: grpc_write_timeout_s).
    http_max_connections: int = 1024
    http_max_connections_per_client: int = 1024
    http_header_timeout_s: float = 10.0
    http_body_timeout_s: float = 30.0
    http_keepalive_timeout_s: float = 75.0
    http_write_timeout_s: float = 60.0
    grpc_write_timeout_s: float = 60.0
    # Conditional disaggregation: a prompt whose part not cached on its decode worker is shorter
    # than this many tokens is prefilled there; longer ones, and all with 0, on a prefill worker.
    disagg_threshold: int = 128
    # Time-to-first-token target in ms, estimated at arrival (prompt tokens queued, prefill
    # speed); with shed_load a request that cannot meet it is refused (RESOURCE_EXHAUSTED).
    ttft_slo_ms: float | None = None
    shed_load: bool = False
    # Seconds a stream whose decode worker died may wait for a live (or restarted) one to resume
    # it from the prompt and the tokens streamed (the client sees a pause); past it, or 0: error.
    resume_budget_s: float = 60.0
    # Seconds a worker may take to answer a health check (every half second) before it is taken
    # for stopped: no request is routed to it, its streams resume elsewhere, until it answers.
    stage_health_timeout_s: float = 2.0
    # Responses kept for `previous_response_id` (the latest, LRU; not those with `store: false`):
    # at most this many, holding at most responses_store_mb MiB of conversation text in all.
    responses_store_size: int = 1024
    responses_store_mb: int = 256
    # Web pages of these origins (scheme://host[:port], comma-separated or the flag repeated;
    # `*`: any) may call the HTTP API from a browser (CORS). None: no CORS headers are sent.
    cors_allowed_origins: str | None = field(default=None, metadata={"repeatable": True})

    @property
    def cors_origins(self) -> frozenset[str]:
        """The origins of cors_allowed_origins, without a trailing slash."""
        entries = (self.cors_allowed_origins or "").split(",")
        return frozenset(o.strip().rstrip("/") for o in entries if o.strip())

    def validate(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "disagg_threshold":
                if not isinstance(v, int) or v < 0:
                    raise ValueError(f"disagg_threshold must be an integer >= 0, got {v!r}")
                continue
            if isinstance(v, int) and not isinstance(v, bool) and v < 1:
                raise ValueError(f"{f.name} must be >= 1, got {v}")
        if self.ttft_slo_ms is not None and not self.ttft_slo_ms > 0:
            raise ValueError(f"ttft_slo_ms must be > 0, got {self.ttft_slo_ms!r}")
        if not self.resume_budget_s >= 0:
            raise ValueError(f"resume_budget_s must be >= 0, got {self.resume_budget_s!r}")
        for name in [f.name for f in fields(self) if f.name.endswith("_timeout_s")]:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.shed_load and self.ttft_slo_ms is None:
            raise ValueError("shed_load needs a time-to-first-token target: set ttft_slo_ms")
        if self.api_key is not None and not self.api_key.strip():
            # An empty key would turn authentication off: refuse it rather than serve openly.
            raise ValueError(
                "api_key (--api-key or TANDEM_API_KEY) is set but empty: give a key, or unset it "
                "to serve without one"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")
        for o in self.cors_origins:
            if o != "*" and not o.startswith(("http://", "https://")):
                raise ValueError(
                    f"cors_allowed_origins: {o!r} is not an origin (scheme://host[:port], or *)"
                )
        for name in ("tls_cert", "tls_key"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{name} file {path!r} does not exist")


@dataclass
class StageAuthConfig:
    """The credentials of the ports between stages (prefill, decode, draft gRPC), by role.

    The stage secret is the workers' (prefill, decode, draft): a worker given it requires it, in
    gRPC metadata, on every call but grpc.health.v1, sends it to the workers it calls, and
    derives its KV lease keys from it. The gateway secret is the gateway's: the gateway sends it,
    and a worker given it too takes it for the calls that route a request (Prefill.Run and
    Release, Decode.Session, Draft.Admit, Stats) and nothing else (tandem.rpc.auth). The gateway,
    facing the internet, never holds the stage secret. Each is read from a file or its TANDEM_*
    variable, never a command line (`ps` shows those). No stage secret: the stage ports are open
    to anyone who reaches them, as on a loopback-only host.
    """

    # A file whose first line is the stage secret (workers only).
    stage_secret_file: str | None = field(default=None, metadata={"credential": True})
    # Only from the environment (TANDEM_STAGE_SECRET): no flag is made for it.
    stage_secret: str | None = field(default=None, metadata={"env_only": True, "credential": True})
    # A file whose first line is the gateway secret (the gateway, and every worker).
    gateway_secret_file: str | None = field(default=None, metadata={"credential": True})
    # Only from the environment (TANDEM_GATEWAY_SECRET).
    gateway_secret: str | None = field(
        default=None, metadata={"env_only": True, "credential": True}
    )


@dataclass
class MetricsAuthConfig:
    """The credential of the Prometheus `/metrics` endpoint every process serves. Given, a scrape
    must carry it (`Authorization: Bearer <token>`; any other is answered 401); unset, `/metrics`
    is open to whoever reaches its port. Read from a file (its first line) or TANDEM_METRICS_TOKEN,
    never from a command line."""

    # A file whose first line is the metrics token.
    metrics_token_file: str | None = field(default=None, metadata={"credential": True})
    # Only from the environment (TANDEM_METRICS_TOKEN).
    metrics_token: str | None = field(default=None, metadata={"env_only": True, "credential": True})


@dataclass
class StageTlsConfig:
    """TLS on the ports between stages (prefill, decode, draft gRPC) and on the calls to them.

    A worker given a certificate and its key serves its stage port over TLS only. A process given
    a CA bundle calls every stage over TLS and checks that the stage's certificate names the host
    part of the address it dials (`prefill`, `decode`, `draft` as Kubernetes Services; `127.0.0.1`
    or `localhost` on one host): certificates carry those names as SANs. The stage secret still
    authenticates callers; TLS keeps it, and prompts, tokens and KV bytes, from the network.
    Unset: plaintext. Each is a PEM file; an empty TANDEM_* variable is an error, as for a
    credential, rather than TLS silently off.

    Mutual TLS (`stage_mtls`): a worker's port then takes only callers presenting a certificate
    signed by its CA bundle (others are refused at the handshake), and every process presents one
    on its calls to stages: its client certificate, else a worker's own stage certificate (which
    must then allow client use, as one without an extended key usage does). The gateway, which
    serves no stage port, needs a client certificate.
    """

    # This worker's certificate chain and its (unencrypted) private key: given together.
    stage_tls_cert: str | None = field(default=None, metadata={"credential": True})
    stage_tls_key: str | None = field(default=None, metadata={"credential": True})
    # The CA bundle vouching for the stages called (and, with stage_mtls, this port's callers).
    stage_tls_ca: str | None = field(default=None, metadata={"credential": True})
    # The certificate chain and (unencrypted) private key this process presents to the stages
    # it calls: given together, with stage_tls_ca.
    stage_tls_client_cert: str | None = field(default=None, metadata={"credential": True})
    stage_tls_client_key: str | None = field(default=None, metadata={"credential": True})
    # Mutual TLS between stages (see above).
    stage_mtls: bool = False


def host_group() -> str | None:
    """TANDEM_HOST_ID: the name of processes that share memory though their hostnames differ
    (containers of one IPC namespace), used in place of the hostname; None when unset or empty."""
    return os.environ.get("TANDEM_HOST_ID") or None


def cache_dir() -> str | None:
    """Where Tandem keeps what it derives from a model and may reuse at the next start (the
    tokenizer built from a GGUF file): TANDEM_CACHE_DIR, else $XDG_CACHE_HOME/tandem, else
    ~/.cache/tandem. TANDEM_CACHE_DIR=none turns the cache off."""
    value = os.environ.get("TANDEM_CACHE_DIR")
    if value is not None:
        return None if value.strip().lower() in ("", "none", "off") else os.path.expanduser(value)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "tandem")
