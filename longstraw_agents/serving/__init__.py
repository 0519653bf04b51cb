"""An OpenAI-compatible server over ``TorchSampler`` (completions and chat completions): what the official ``openai``
client and vLLM-style token-id clients (``OpenAISampler``) use.

It exists so that ``OpenAISampler`` can be tested end to end on one machine, and to serve a local policy to tools
that speak the OpenAI API (``longstraw serve`` starts one from a run or a model directory). Bind it to loopback
only; it serves one model, and no request can take it down (see "Requests in flight" below).

    server = CompletionServer(TorchSampler(model, stop_token_ids=[eos]), tokenizer=load_tokenizer())
    server.start()          # serves http://127.0.0.1:<server.port>/v1/completions and /v1/models
    OpenAI(base_url=server.url + "/v1", api_key="unused").completions.create(model="default", prompt="Hi", n=3)
    server.stop()

What is served (``POST /v1/completions``, ``GET /v1/models``, ``GET /v1/models/{id}``):

- Responses carry ``id``, ``object``, ``created``, ``model``, ``choices`` and ``usage`` (with ``total_tokens``).
- ``prompt``: token ids, or text when the server has a tokenizer; a list of either is a batch of prompts.
- ``n`` choices per prompt, decoded together; choice k of prompt p draws with its own seed, derived from (request
  seed, p·n + k), so a seeded request repeats and its choices differ. A null or missing ``seed`` is a random one.
- ``stream=True``: server-sent events in OpenAI's format, one chunk per generated token of each choice (the chunk
  of a choice's last token carries its ``finish_reason``), a usage chunk when ``stream_options.include_usage``,
  then ``data: [DONE]``. Streamed and non-streamed requests with one seed draw the same tokens.
- Null sampling fields (``temperature``, ``top_p``, ``max_tokens``, ``n``, ``seed``, ...) mean their defaults
  (1, 1, 16, 1, random), as in the OpenAI API.
- ``text`` is decoded with the server's tokenizer (``tokenizer=``, e.g. ``load_tokenizer()``): special tokens are
  skipped unless ``skip_special_tokens`` is false, and a final stop token is left out of the text unless
  ``include_stop_str_in_output``. Without a tokenizer ``text`` is always ``""``, text prompts are refused and the
  logprob tokens are ids.
- vLLM's extensions: ``stop_token_ids`` (default: the sampler's), ``return_tokens_as_token_ids`` (logprob tokens
  as ``"token_id:N"``), ``skip_special_tokens``, ``include_stop_str_in_output``.
- ``logprobs`` (any integer) returns each sampled token's log-probability under the temperature-scaled
  distribution; ``top_logprobs`` is always null (the sampler keeps no alternatives).

Weights and versions (SGLang's protocol, what ``weight_sync.DiskWeightSync`` pushes to):

- ``POST /update_weights_from_disk`` with ``{"model_path": DIR, "weight_version": "N"}`` loads a ``save_pretrained``
  directory into the served model in place (``weight_sync.load_weights``) between requests, and answers
  ``{"success": true, "message": ..., "weight_version": "N"}``. Without ``weight_version`` the version goes up by
  one. A missing directory, another architecture (the message names what differs) or a version that is not a
  number is a 400 with ``"success": false``, and the served weights and version stay as they were.
- The policy version served (0 at start) is ``metadata.weight_version`` of every completion (as SGLang's) and of
  ``GET /model_info`` (also ``/get_model_info``) and ``GET /get_weight_version``; SGLang's ``return_token_ids``
  adds each choice's sampled ids as ``token_ids``.

Refused with a 400 that names the field: stop strings (``stop``), ``echo``, ``suffix``, ``best_of`` other than
``n``, non-zero penalties and ``logit_bias`` — the sampler cannot honour them, and ignoring them would silently
change what the client asked for. Requests are checked as OpenAI checks them: ``model`` is required (missing or
null: a 400), a field the API does not have is refused with a 400 that names it, and the body must be
``application/json`` (else a 415) of at most ``MAX_BODY_BYTES`` (else a 413). A request for another model than
``model_name`` is a 404, as with vLLM.

Requests in flight (``limits``; what a vLLM or SGLang user expects of one server over one engine):

- Each request is served by a thread of its own, its choices decoded as one batch (one forward per step). The
  requests in flight take turns on the engine a step at a time, first come first served (``Turns``), and a long
  prompt is captured a chunk per turn, so a long request shares the engine but never holds it: a short request
  beside a 100,000-token one is answered after its own few steps. (vLLM and SGLang batch all the requests in flight
  into one forward per step, continuous batching; here each request's step is its own forward: the same
  interleaving and fairness, less throughput for many small requests.)
- A request whose client disconnects is cancelled before its next step: streamed, when a chunk cannot be written
  or the connection is seen closed; not streamed, when the connection is seen closed between steps.
- ``max_tokens`` (chat: ``max_completion_tokens``) is at most the context minus the prompt (a 400 with code
  ``context_length_exceeded``) and at most ``ServingLimits.max_tokens`` (``longstraw serve --max-tokens``; a 400
  naming it). A default one is lowered to both instead.
- Memory is reserved as decoding proceeds (the decoder's buffers double), never ``max_tokens`` positions up front.
  A request is counted at the most it can hold (``request_bytes``, from the model's ``state_size`` per token), and
  the requests in flight hold at most ``ServingLimits.memory_budget`` together (default: half the memory free on
  the device at start). One that could never fit is a 400; one that does not fit now waits, first come first
  served, up to ``queue_timeout_s``, then gets a 503 with ``Retry-After`` — as does one arriving while
  ``max_waiting`` requests wait already.
- An allocation that fails anyway (``torch.OutOfMemoryError``, ``MemoryError``, an allocator's ``RuntimeError``),
  or anything else that goes wrong in a request, is a 500 with a JSON error body (in a stream that has begun: an
  ``error`` event, then ``[DONE]``); the request's memory is freed and the server goes on serving.
- Loading new weights (``/update_weights_from_disk``) waits, in line with the requests, until those in flight have
  ended, so that every completion is sampled by one version.

Chat (``POST /v1/chat/completions``, with a ``chat_template``; without one it is a 400):

- The messages (OpenAI's shape: text content or text parts, ``developer`` read as ``system``, an assistant's
  ``tool_calls``, tool results) and ``tools`` are checked one by one — a 400 names e.g. ``messages[2].content`` —
  and rendered to prompt ids by the template; the prompt is then completed as a ``/v1/completions`` request would be:
  ``n``, ``seed``, ``temperature``, ``top_p``, ``stop_token_ids`` and the usage counts are the same. The reply keeps
  special tokens (the template reads its tags), all but a final stop token.
- ``max_completion_tokens`` (or ``max_tokens``) defaults to the sampler's ``max_new_tokens``: a turn as long as in
  training, not the completions endpoint's 16.
- With ``tools`` (and ``tool_choice`` null, "auto" or "none"), the template reads the reply's tool calls: they come
  back as ``message.tool_calls`` (arguments as a JSON string, content null when nothing else was said) with
  ``finish_reason: "tool_calls"``. ``tool_choice: "none"`` leaves the reply as text.
- ``logprobs: true`` gives ``choices[i].logprobs.content``: one entry per sampled token (the stop token too, as the
  trainer scores it) with its ``bytes`` and an empty ``top_logprobs``.
- ``stream=True``: ``chat.completion.chunk`` events, first each choice's role, then one chunk per generated token with
  the content it adds; content that may still turn out to be a tool call (from ``<tool_call>`` on) is held back, and
  the last chunk of a choice carries the rest of the content, its ``tool_calls`` and its ``finish_reason``. The
  deltas add up to the non-streamed reply of the same seed.
- Refused with a 400: what completions refuse (``stop``, penalties, ``logit_bias``), a ``tool_choice`` that forces a
  call, ``parallel_tool_calls: false``, ``top_logprobs`` above 0, ``skip_special_tokens: true`` and a
  ``response_format`` other than text.

One concern a module: ``protocol`` (the requests and replies, OpenAI's errors; no torch), ``jobs`` (a request's
decoding and its response or stream), ``server`` (``CompletionServer``), ``http_handler`` (routes and the wire, the
tally of answers), ``limits`` (``ServingLimits``, the memory budget and the engine's turns). ``jobs`` and
``http_handler`` know the server only as the protocol each needs of it (``JobServer``, ``Completions``), so neither
imports ``server``.
"""

from longstraw_agents.serving.http_handler import CLIENT_TIMEOUT_S, MAX_BODY_BYTES, ServerStats
from longstraw_agents.serving.limits import Busy, MemoryBudget, ServingLimits, Turns
from longstraw_agents.serving.protocol import (
    DEFAULT_MAX_TOKENS,
    MAX_CHOICES,
    ChatCompletionRequest,
    ChatMessage,
    ChatTemplate,
    CompletionRequest,
    FunctionCall,
    Reply,
    RequestError,
    StreamOptions,
    UpdateWeightsRequest,
    chat_messages,
    chat_tools,
    error_payload,
    parse_chat_request,
    parse_request,
)
from longstraw_agents.serving.server import CompletionServer

__all__ = [
    "CLIENT_TIMEOUT_S",
    "DEFAULT_MAX_TOKENS",
    "MAX_BODY_BYTES",
    "MAX_CHOICES",
    "Busy",
    "ChatCompletionRequest",
    "ChatMessage",
    "ChatTemplate",
    "CompletionRequest",
    "CompletionServer",
    "FunctionCall",
    "MemoryBudget",
    "Reply",
    "RequestError",
    "ServerStats",
    "ServingLimits",
    "StreamOptions",
    "Turns",
    "UpdateWeightsRequest",
    "chat_messages",
    "chat_tools",
    "error_payload",
    "parse_chat_request",
    "parse_request",
]
