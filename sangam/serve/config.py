"""Server options: one frozen dataclass, one ``--kebab-case`` flag per field (as EngineConfig)."""

from __future__ import annotations

import argparse
import functools
import json
import os
from dataclasses import dataclass, field

from sangam.config import add_config_flags, config_from_args, flag_meta
from sangam.models.tokenizer import load_chat_template
from sangam.serve.tool_calls import TOOL_CALL_PARSERS, make_tool_parser

DEMO_MODEL_NAME = "sangam-demo"


@dataclass(frozen=True)
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata=flag_meta("Address to listen on"))
    port: int = field(default=8000, metadata=flag_meta("Port to listen on"))
    api_key: str | None = field(default=None, metadata=flag_meta(
        "Require 'Authorization: Bearer KEY' on /v1/* requests"))
    allowed_origins: str | None = field(default=None, metadata=flag_meta(
        "Web origins whose browser pages may call the API (CORS): comma-separated, or a JSON "
        "list as vLLM's; '*' for any. Default: none"))
    ssl_keyfile: str | None = field(default=None, metadata=flag_meta(
        "Serve HTTPS with this private key (PEM; with --ssl-certfile)"))
    ssl_certfile: str | None = field(default=None, metadata=flag_meta(
        "Serve HTTPS with this certificate chain (PEM; it may hold the key too)"))
    ssl_ca_certs: str | None = field(default=None, metadata=flag_meta(
        "CA certificates (PEM) that client certificates are checked against, with "
        "--ssl-cert-reqs"))
    ssl_cert_reqs: int = field(default=0, metadata=flag_meta(
        "Client certificates: 0 not asked for, 1 optional, 2 required (Python's ssl.CERT_*)",
        choices=(0, 1, 2)))
    enable_request_id_headers: bool = field(default=False, metadata=flag_meta(
        "Send each completion's request id back as an X-Request-Id header, as vLLM's (a "
        "request's own X-Request-Id header, if any, is its id)"))
    max_request_body_bytes: int = field(default=2 * 2**20, metadata=flag_meta(
        "Largest request body accepted; a larger one is refused with 413. 2 MiB holds a "
        "prompt of 131K tokens as ids, and keeps the work one request brings (tokenizing, "
        "JSON) short enough that /health answers within 100 ms meanwhile"))
    served_model_name: str | None = field(default=None, metadata=flag_meta(
        "Model name in the API (default: the --model path, or 'sangam-demo')"))
    chat_template: str | None = field(default=None, metadata=flag_meta(
        "Chat template replacing the tokenizer's: a Jinja file, or the template itself "
        "(as vLLM's --chat-template)"))
    enable_auto_tool_choice: bool = field(default=False, metadata=flag_meta(
        "Turn the tool calls the model writes in chat responses into OpenAI tool_calls when a "
        "request offers tools (tool_choice auto), with --tool-call-parser, as vLLM's"))
    tool_call_parser: str | None = field(default=None, metadata=flag_meta(
        "How the model writes tool calls: hermes (<tool_call>JSON</tool_call>: Hermes, Qwen2.5, "
        "Dream)", choices=TOOL_CALL_PARSERS))
    responses_store_size: int = field(default=0, metadata=flag_meta(
        "Keep the newest N /v1/responses responses that ask to be stored (store: true, "
        "OpenAI's default) in memory, for previous_response_id and GET/DELETE "
        "/v1/responses/{id}; 0 (default, as vLLM): none"))
    profiler_dir: str | None = field(default=None, metadata=flag_meta(
        "Serve POST /start_profile and /stop_profile (vLLM's), which write torch.profiler "
        "traces of the engine loop to this directory; off by default"))
    enable_rollout_routes: bool = field(default=False, metadata=flag_meta(
        "Serve the RL-rollout routes (SGLang's): /update_weights_from_disk, "
        "/update_weights_from_tensor, /init_weights_update_group, "
        "/update_weights_from_distributed, /get_weight_version, /flush_cache, "
        "/release_memory_occupation, /resume_memory_occupation, /pause_generation, "
        "/continue_generation; off by default (any client with the key could change the "
        "weights)"))
    shutdown_grace: float = field(default=5.0, metadata=flag_meta(
        "On SIGINT/SIGTERM, seconds in-flight requests may take to finish before they are "
        "aborted"))
    log_level: str = field(default="info", metadata=flag_meta(
        "Log level", choices=("critical", "error", "warning", "info", "debug"),
        aliases=("--uvicorn-log-level",)))
    log_stats_interval: float = field(default=10.0, metadata=flag_meta(
        "Seconds between log lines of engine stats (throughput, queue, KV pool use); 0: none"))
    enable_log_requests: bool = field(default=False, metadata=flag_meta(
        "Log a line when each request is received (prompt length, sampling parameters) and "
        "when it ends (reason, tokens, forwards, seconds), as vLLM's --enable-log-requests"))

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"ServerConfig: port must be in [0, 65536), got {self.port}")
        if self.max_request_body_bytes < 1:
            raise ValueError("ServerConfig: max_request_body_bytes must be >= 1")
        if self.responses_store_size < 0:
            raise ValueError("ServerConfig: responses_store_size must be >= 0")
        if self.shutdown_grace < 0:
            raise ValueError("ServerConfig: shutdown_grace must be >= 0")
        if self.log_stats_interval < 0:
            raise ValueError("ServerConfig: log_stats_interval must be >= 0")
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ValueError(f"ServerConfig: ssl_cert_reqs must be 0, 1 or 2, got "
                             f"{self.ssl_cert_reqs}")
        if self.ssl_keyfile is not None and self.ssl_certfile is None:
            raise ValueError("ServerConfig: ssl_keyfile needs ssl_certfile")
        if (self.ssl_ca_certs is not None or self.ssl_cert_reqs) and self.ssl_certfile is None:
            raise ValueError("ServerConfig: client certificates (ssl_ca_certs, ssl_cert_reqs) "
                             "need HTTPS: give ssl_certfile")
        for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"ServerConfig: {name}: no such file: {path}")
        self.origins()  # raises ValueError for a malformed list, at startup
        _ = self.chat_template_text  # read now: a missing file or broken template raises
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("ServerConfig: enable_auto_tool_choice needs tool_call_parser")
        if self.tool_call_parser is not None:
            make_tool_parser(self.tool_call_parser)

    @functools.cached_property
    def chat_template_text(self) -> str | None:
        """The --chat-template's Jinja text (read from its file, if it names one), once."""
        return None if self.chat_template is None else load_chat_template(self.chat_template)

    def origins(self) -> tuple[str, ...]:
        """``allowed_origins`` as a tuple (empty: no CORS)."""
        given = (self.allowed_origins or "").strip()
        if given.startswith("["):
            try:
                origins = json.loads(given)
            except json.JSONDecodeError as e:
                raise ValueError(f"ServerConfig: allowed_origins is not a JSON list: {e}") from None
        else:
            origins = [o.strip() for o in given.split(",")] if given else []
        if not isinstance(origins, list) or not all(isinstance(o, str) and o for o in origins):
            raise ValueError(f"ServerConfig: allowed_origins must list non-empty origins, got "
                             f"{self.allowed_origins!r}")
        return tuple(origins)

    def model_name(self, model_path: str | None) -> str:
        return self.served_model_name or model_path or DEMO_MODEL_NAME

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_config_flags(cls, parser)
        parser.add_argument("--disable-log-stats", dest="log_stats_interval",
                            action="store_const", const=0.0,
                            help="No periodic stats lines: --log-stats-interval 0 (vLLM's flag)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerConfig:
        return config_from_args(cls, args)
