"""The named workloads: load shapes `servelm bench --dataset-name NAME` and harness/compare.py both run.

Each is a request shape (prompt and output sizes, a shared system prompt, conversations, a response format,
best_of, embeddings) and a default concurrency and request count. `ban_eos` workloads generate exactly max_tokens:
harness/compare.py bans the model's end tokens with logit_bias, `servelm bench` asks for `ignore_eos`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from importlib import resources
from typing import Any

from servelm.bench.loadgen import EmbeddingSpec, RequestSpec, build_prompt

# What a workload's requests go to: the chat model, or the sentence-embedding model (a process of its own).
CHAT, EMBEDDING = "chat", "embedding"


@dataclass(frozen=True)
class Workload:
    """One load shape. Add entries to WORKLOADS to extend the comparison."""

    name: str
    description: str
    concurrency: int
    prompt_tokens: int = 97  # user message; SmolLM2's chat template brings the prompt to about 135 tokens
    max_tokens: int = 64
    ban_eos: bool = True
    system_prompt: str | None = None
    unique_prompts: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict, hash=False)  # merged into every request body
    requests: int | None = None  # default: 2 x concurrency, at least 4
    servers: tuple[str, ...] | None = None  # the only servers it runs against (default: every server)
    prompt_set: str | None = None  # workloads naming the same set send the same prompts (default: own name)
    warmup: int = 0  # uncounted requests of its own before it (e.g. to compile a schema once)
    temperature: float = 0.0
    stream: bool = True  # False: one JSON answer per request; no TTFT/ITL, tokens from usage
    # Per server: RequestSpec fields that replace this workload's there (e.g. another extra_body when a peer
    # asks for the same work in its own words).
    server_overrides: dict[str, dict[str, Any]] = field(default_factory=dict, hash=False)
    model: str = CHAT  # CHAT, or EMBEDDING: the servers are started on the embedding model for it
    embed_inputs: int = 32  # EMBEDDING: sentences per /v1/embeddings request
    turns: int = 1  # > 1: each request is a conversation of this many turns (RequestSpec.turns)
    prompts: tuple[str, ...] = ()  # the user messages, by request index (cycled), instead of built ones

    def runs_on(self, server: str) -> bool:
        return self.servers is None or server in self.servers

    def request_spec(self, server: str, ban_ids: tuple[int, ...], attempt: int = 0) -> RequestSpec | EmbeddingSpec:
        """The requests of this workload on `server`; a retry gets fresh prompts, so no server has them cached."""
        salt = self.prompt_set or self.name
        salt = salt if attempt == 0 else f"{salt}-retry{attempt}"
        spec: RequestSpec | EmbeddingSpec
        if self.model == EMBEDDING:
            spec = EmbeddingSpec(inputs=self.embed_inputs, prompt_salt=salt, extra_body=dict(self.extra_body))
        else:
            spec = RequestSpec(max_tokens=self.max_tokens, prompt_tokens=self.prompt_tokens,
                               temperature=self.temperature, ban_token_ids=ban_ids if self.ban_eos else (),
                               system_prompt=self.system_prompt, unique_prompts=self.unique_prompts,
                               prompt_salt=salt, extra_body=dict(self.extra_body), stream=self.stream,
                               turns=self.turns, prompts=tuple(f"({salt}) {p}" for p in self.prompts))
        return replace(spec, **self.server_overrides.get(server, {}))


# Structured output: a long inventory object. minItems 40 cannot be reached in 128 tokens, so the grammar
# never allows EOS and a constrained request generates max_tokens like an unconstrained one.
INVENTORY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 40,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "qty": {"type": "integer", "minimum": 0, "maximum": 999},
                },
                "required": ["name", "qty"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["items"],
    "additionalProperties": False,
}
JSON_SYSTEM_PROMPT = ('Answer only with a JSON object listing the things named in the text as a shop inventory: '
                      '{"items": [{"name": "...", "qty": 0}, ...]}.')
JSON_RESPONSE_FORMAT: dict[str, Any] = {
    "type": "json_schema",
    "json_schema": {"name": "inventory", "schema": INVENTORY_SCHEMA, "strict": True},
}

def _passage(first: int, words: int) -> str:
    text = resources.files("servelm.bench").joinpath("data/passage.txt").read_text().split()
    return " ".join(text[first : first + words])


# Issue 21's echo-heavy shape: answers that copy most of their prompt (a rewrite with small edits, fields
# extracted from a document), where a draft from the prompt holds. A record to extract from:
_RECORD = ("Shipment record 4471-B. Sender: Harbour Bakery, 12 Quay Street, Westhaven. Recipient: Lighthouse "
           "Keepers' Trust, Cliff Road, North Point. Dispatched on 3 March by the morning ferry; expected on 5 March. "
           "Contents: forty loaves of rye bread, twelve jars of plum jam, one crate of candles and a repaired "
           "bicycle chain. Declared weight: 38 kilograms. Declared value: 112 pounds. Insurance: none. Handling: "
           "keep dry, do not stack more than three crates high. Contact on arrival: Mrs Elin Marsh, telephone "
           "0441 339 208. Notes: the recipient pays the harbour fee; the crate of candles travels in the cabin.")
ECHO_PROMPTS: tuple[str, ...] = (
    "Rewrite the passage below, word for word, with one change: write 'boat' wherever it says 'ferry'.\n\n"
    + _passage(0, 300),
    "Extract the fields of this record as a JSON object with the keys record, sender, sender_address, recipient, "
    "recipient_address, dispatched, expected, contents, weight, value, insurance, handling, contact, telephone "
    "and notes, copying each value from the record as it is written.\n\n" + _RECORD,
    "Rewrite the passage below, word for word, with one change: write 'village' wherever it says 'island'.\n\n"
    + _passage(300, 300),
    "Copy the record below as a JSON object whose keys are the field names (Sender, Recipient, Dispatched, "
    "Contents, ...) and whose values are the text after each name, exactly as written.\n\n" + _RECORD,
)

WORKLOADS: list[Workload] = [
    Workload("1-stream", "1 client; ~135-token prompt, 64 output tokens, EOS banned", concurrency=1),
    Workload("16-streams", "16 concurrent clients; same requests as 1-stream", concurrency=16),
    Workload("json-8", "8 concurrent clients; json_schema response_format (inventory), 128 output tokens, "
             "EOS banned", concurrency=8, max_tokens=128, system_prompt=JSON_SYSTEM_PROMPT,
             extra_body={"response_format": JSON_RESPONSE_FORMAT}, servers=("servelm",), prompt_set="json-8",
             warmup=1),
    Workload("json-8-free", "json-8's requests and prompts without response_format", concurrency=8,
             max_tokens=128, system_prompt=JSON_SYSTEM_PROMPT, servers=("servelm",), prompt_set="json-8"),
    # 4 clients x 4 sampled sequences = 16 sequences, the 16 slots. llama-server has no best_of (its chat
    # endpoint ignores the field), but runs n sequences on one prompt read (n_cmpl: the prompt's state is copied
    # to the children): n=4 is the same work, minus picking the best (servelm: by cumulative logprob). Its
    # usage counts one choice only.
    Workload("best-of-4", "4 concurrent clients; best_of 4 (n 1), temperature 0.8, 64 output tokens each, EOS "
             "banned, not streamed; llama-server: n 4", concurrency=4, temperature=0.8, stream=False,
             extra_body={"n": 1, "best_of": 4}, servers=("llama-server", "servelm"),
             server_overrides={"llama-server": {"extra_body": {"n": 4}, "usage_per_choice": True}}),
    Workload("beam-4", "4 concurrent clients; beam search, 4 beams (best_of 4, n 1), temperature 0, 64 output "
             "tokens, EOS banned, not streamed", concurrency=4, stream=False,
             extra_body={"n": 1, "best_of": 4, "use_beam_search": True}, servers=("servelm",)),
    # Issue 6's shapes: a long shared system prompt (prefix caching: first-token latency), and long prompts
    # arriving while others decode (chunked prefill: inter-token latency).
    Workload("shared-prefix-4", "4 concurrent clients; a ~650-token system prompt shared by every request, a "
             "short unique question, 32 output tokens, EOS banned", concurrency=4, requests=16, prompt_tokens=24,
             max_tokens=32, system_prompt=build_prompt(640, "shared-system-prompt")),
    Workload("long-prompts-4", "4 concurrent clients; ~1,235-token prompts, each new, 32 output tokens, EOS banned",
             concurrency=4, requests=12, prompt_tokens=1200, max_tokens=32),
    # Issue 14's: the workload a prefix cache exists for. Each turn resends the whole conversation.
    Workload("multi-turn-4", "4 concurrent users, each in 4-turn conversations (2 each): every turn resends the "
             "history and adds a ~40-token question; 48 output tokens a turn, EOS banned", concurrency=4,
             requests=8, prompt_tokens=40, max_tokens=48, turns=4),
    # The shape of the independent load generator issue 14 quotes: a new ~133-token prompt each request,
    # temperature 0.7, 64 tokens out, EOS banned.
    Workload("1-stream-t07", "1-stream at temperature 0.7 (its own new prompts)", concurrency=1, temperature=0.7),
    Workload("16-streams-t07", "16-streams at temperature 0.7 (its own new prompts)", concurrency=16,
             temperature=0.7),
    # Issue 21's: speculative decoding's workload (prompt lookup), and its counterpart under load is 16-streams.
    Workload("echo-1", "1 client; rewrite a 300-word passage with one small edit, or extract a record's fields as "
             "JSON (each answer copies most of its prompt); up to 400 output tokens, EOS allowed, greedy",
             concurrency=1, requests=4, max_tokens=400, ban_eos=False, prompts=ECHO_PROMPTS),
    Workload("embed-32", "2 concurrent clients; /v1/embeddings with 32 fresh sentences of 10-20 words each",
             concurrency=2, requests=16, model=EMBEDDING, embed_inputs=32, servers=("llama-server", "servelm")),
]


def named(name: str) -> Workload:
    """The workload of that name; KeyError lists the names."""
    for w in WORKLOADS:
        if w.name == name:
            return w
    raise KeyError(f"no workload {name!r}; the named ones are {', '.join(w.name for w in WORKLOADS)}")
