"""Every user-facing failure, each with its own message (upstream's text wherever one exists).

The guide's troubleshooting table quotes these templates; tests trigger each one and compare.
"""

from __future__ import annotations


class UserError(Exception):
    """A failure the user can fix; the CLI prints the message alone and exits with status 2."""


class LoaderConfigError(UserError):
    pass


class PreloadConfigError(UserError):
    pass


class DeviceError(UserError):
    NO_CUDA = "--device cuda was requested but torch sees no CUDA device; use --device cpu, or auto to take what there is"


class EngineWorldError(UserError):
    TEMPLATE = ("Engine rank {rank} cannot form the engine's world at {init_method}: {error}. Is --master-port "
                "taken? Give the engine a free one")

    def __init__(self, rank: int, init_method: str, error: str):
        super().__init__(self.TEMPLATE.format(rank=rank, init_method=init_method, error=error))


class ParallelConfigError(UserError):
    """A parallel layout or speculative config that cannot run (texts in core/ranks.py, core/speculative.py)."""


class UnsupportedQuantForIPCError(UserError):
    # Upstream's text, then why the method cannot be cached and what to do instead.
    TEMPLATE = ("UnsupportedQuantForIPCError: quantization method '{method}' does not support pre-processed "
                "weights, so the weight cache cannot serve it: {reason}")
    REPACKED = ("its kernels repack the checkpoint's weights after loading (vLLM refuses {method} for its weight "
                "cache too), and wcache has no {method} kernels to load it from disk either: serve this "
                "checkpoint without a weight cache, with an engine that runs {method}")

    def __init__(self, method: str, reason: str | None = None):
        super().__init__(self.TEMPLATE.format(method=method, reason=reason or self.REPACKED.format(method=method)))


class QuantizationError(UserError):
    """A quantization method or quantized checkpoint the engine cannot run (model/quant.py)."""

    UNKNOWN = "Unknown quantization method {name!r}; supported: {supported}"
    # vLLM's ModelConfig text when --quantization and config.json's quantization_config disagree.
    MISMATCH = ("Quantization method specified in the model config ({config}) does not match the quantization "
                "method specified in the `quantization` argument ({arg}).")
    NOT_IMPLEMENTED = ("Quantization method '{method}' ({what}) is not implemented in wcache: it runs unquantized, "
                       "int8 and fp8 weights (block-wise FP8 checkpoints, or --quantization fp8 on an unquantized "
                       "checkpoint)")
    NO_KERNELS = ("Quantization method '{method}' needs {method} kernels, which wcache does not have: serve this "
                  "checkpoint with an engine that runs {method}")
    OLD_GPTQ = ("; wcache's load-time grouped int4 method, formerly called 'gptq', was removed: use "
                "--quantization int8 or fp8 on an unquantized checkpoint")
    BLOCK_WITHOUT_FP8 = "--weight-block-size applies to `wcache make-checkpoint --quantization fp8` only"
    BLOCK_NOT_SERVED = ("--weight-block-size {block} makes a checkpoint that wcache cannot serve: {why}")
    FP8_FIELD = "FP8 checkpoint {path}: quantization_config.{field} is {value}; {why}"
    FP8_WHY = {
        "activation_scheme": "wcache quantizes activations dynamically only (\"dynamic\")",
        "weight_block_size": "wcache reads block-wise FP8 checkpoints: two positive integers, e.g. [128, 128]",
        "scale_fmt": "wcache reads float32 block scales only (\"float\")",
    }
    # vLLM's texts (validate_fp8_block_shape) behind which tensor and which split.
    BLOCK_SPLIT_OUT = ("Cannot split {tensor} over {tp} tensor-parallel ranks: Weight output_partition_size = "
                       "{size} is not divisible by weight quantization block_n = {block}.")
    BLOCK_SPLIT_IN = ("Cannot split {tensor} over {tp} tensor-parallel ranks: Weight input_size_per_partition = "
                      "{size} is not divisible by weight quantization block_k = {block}.")
    BLOCK_FUSED = ("Cannot fuse {tensor} into {fused}: its {size} output channels are not a multiple of the weight "
                   "quantization block_n = {block}, so the fused block grid would not line up")
    PARTLY_CONVERTED = ("Detected some but not all shards of {prefix} are quantized. All shards of fused layers "
                        "to have the same precision.")
    MISSING_SCALE = ("FP8 checkpoint {path} lacks {name}: quantization_config says {tensor} is stored block-wise "
                     "in FP8 (list it in modules_to_not_convert if it is not)")
    FP8_SCALE_DTYPE = "FP8 checkpoint {model}: {tensor} in {file} is {what}; block scales must be float32 (F32)"
    FP8_WEIGHT_DTYPE = ("FP8 checkpoint {model}: {tensor} in {file} is {what}; a weight with a block scale must be "
                        "float8_e4m3fn (F8_E4M3)")
    FP8_SCALE_VALUE = ("FP8 checkpoint {model}: {tensor} in {file} holds {what}; block scales must be finite and "
                       "positive")
    SCALE_SHAPE = ("FP8 checkpoint {path}: {name} is {shape}, but a {weight} weight with blocks of {block} needs "
                   "scales of {expected}")


class UnsupportedPlatformForIPCError(UserError):
    TEMPLATE = "UnsupportedPlatformForIPCError: the weight cache needs Linux (memfd or CUDA IPC); this is {platform}"

    def __init__(self, platform: str):
        super().__init__(self.TEMPLATE.format(platform=platform))


class SocketSecurityError(UserError):
    SYMLINK_DIR = "Refusing to use symlinked socket directory {dir}"
    NOT_A_DIR = "Socket directory {dir} is not a directory"
    NOT_OWNED_DIR = "Socket directory {dir} is not owned by the current user"
    OPEN_DIR = "Socket directory {dir} is group/world accessible"


class DaemonLockError(UserError):
    TEMPLATE = "Another weight cache daemon already owns {path}"
    SYMLINK = "Refusing to use the lock file {path}: it is a symbolic link"
    CANNOT_OPEN = "Cannot open the lock file {path}: {error}"
    LIVE_SOCKET = ("A weight cache daemon still serves {path} although its lock file was removed; "
                   "stop that daemon first (this one leaves its socket alone)")
    UNSURE_SOCKET = ("A process may still serve {path} although its lock file was removed: connecting to it gave "
                     "'{error}', and only a refused connection proves a socket stale; stop that daemon first "
                     "(this one leaves its socket alone)")

    def __init__(self, path, template: str | None = None, **fields):
        super().__init__((template or self.TEMPLATE).format(path=path, **fields))


STALE_SOCKET_REMOVED = "Removing stale socket {path} left by a previous daemon"


class WeightCacheTimeoutError(UserError):
    TEMPLATE = "Weight cache daemon did not become ready within {timeout}s: {reason}"

    def __init__(self, timeout: float, reason: str):
        super().__init__(self.TEMPLATE.format(timeout=timeout, reason=reason))


class WeightCacheError(UserError):
    """The cache answered but cannot be used, and fallback is off."""


class ExternalWeightsExceedBudgetError(UserError):
    # Upstream's text on a GPU; on CPU the capacity is --cpu-memory-capacity, and the text says so.
    TEMPLATE = ("Externally held weights ({external}) exceed the desired {memory} utilization "
                "({utilization} x {capacity} = {budget}); {fix}")
    MEMORY = {"cuda": "GPU memory", "cpu": "CPU memory"}
    FIX_RAISE = ("raise --gpu-memory-utilization to at least {needed} for the weights alone (activations and the "
                 "KV cache need more: the next start names the least share that holds them all)")
    FIX_SMALL = ("they exceed the device's capacity: give each rank a smaller share of the model "
                 "(more tensor or pipeline parallelism)")

    def __init__(self, **fields):
        super().__init__(self.TEMPLATE.format(**fields))


class ServeAddressError(UserError):
    """`wcache serve` cannot listen on --host/--port (most often: the port is taken)."""
    IN_USE = ("Cannot serve on {host}:{port}: the port is already in use. Stop the process that listens "
              "there, or start wcache serve with another --port")
    OTHER = "Cannot serve on {host}:{port}: {error}"


class RespawnError(UserError):
    """`wcache serve --respawn` (engine/respawn/respawn.py): what it cannot do, and why its supervisor gave up."""
    ONE_RANK = ("--respawn supports an engine of one rank; this one has {world} ({layout}). Drop --respawn "
                "and restart the engine from outside (docs/respawn.md)")
    GAVE_UP = ("--respawn gives up: the engine worker died {deaths} times in a row, each within {stable:g} s of "
               "being ready or before it (last: {cause}); exit status 1")
    STREAM_CUT = ("The engine worker serving this stream (pid {pid}) died ({cause}) after the stream had begun; "
                  "the stream ends here. Send the request again")
    CONFIG = ("--respawn stops: engine worker pid {pid} exited with status 2 before it was ready, a configuration "
              "error that a new worker would repeat (its error is above)")


class MultiprocessingEnvError(UserError):
    """`wcache serve`'s process layout (engine/api_server/front.py): a value it cannot read is not taken as either."""
    VALUE = ("WCACHE_ENABLE_V1_MULTIPROCESSING must be 1 (the default: a front process and an engine core) or 0 "
             "(one process), not {value!r}")


class KVCacheBudgetError(UserError):
    """The budget leaves too little for the KV cache. The {fix} names the way out that works here
    (memory.kv_fix): a higher utilization only where the device can hold it; --max-model-len where
    the activation peak (measured over --max-model-len tokens) or the sequence itself is too long."""
    NO_ROOM = "No memory left for the KV cache: {split}. {fix}"
    TOO_LONG = "--max-model-len {length} needs {length} KV cache tokens but the memory budget holds {tokens}: {split}. {fix}"
    FIX_RAISE = {"cuda": ("Raise --gpu-memory-utilization to at least {needed} (the GPU must have that much free: "
                          "memory other processes hold is not counted)"),
                 "cpu": "Raise --gpu-memory-utilization to at least {needed}, or --cpu-memory-capacity"}
    OR_SHORTER = ", or lower --max-model-len to at most {tokens}"
    OR_SHORTER_PEAK = (", or lower --max-model-len (the activation peak, {peak}, is measured over {length} tokens "
                       "and shrinks with them)")
    FIX_PEAK = ("No utilization fits: the weights, the activation peak over {length} tokens ({peak}) and one "
                "sequence of {length} tokens need {need} of the device's {capacity}. Lower --max-model-len")
    FIX_SMALL = ("The weights alone need {weights} of the device's {capacity}: give each rank a smaller share of "
                 "the model (more tensor or pipeline parallelism)")


class AutotuneFailedError(UserError):
    TEMPLATE = "Autotune pass failed: {error}. Fix the cause or start with --no-enable-autotune"

    def __init__(self, error):
        super().__init__(self.TEMPLATE.format(error=error))


class SeedConfigError(UserError):
    LISTEN_WITHOUT_TOKEN = ("--weight-cache-seed-listen needs --weight-cache-seed-token (or WCACHE_SEED_TOKEN): "
                            "refusing to serve the autotune cache without a token")
    BAD_ADDRESS = "{flag} expects HOST:PORT with a port of 1-65535, got {value!r}"
    COUNT = ("--weight-cache-seed lists {given} address(es) but this launcher runs {ranks} local rank(s); "
             "give one HOST:PORT per local rank, in local rank order")
    SEED_WITHOUT_TOKEN = ("--weight-cache-seed needs --weight-cache-seed-token (or WCACHE_SEED_TOKEN): "
                          "the seed daemon answers only requests that carry its token")
    SHORT_TOKEN = "--weight-cache-seed-token must be at least {min} characters"
    PORT_IN_USE = "Cannot listen for seeding on {address}: {error}"
    BAD_SECONDS = "{flag} must be a number of seconds from 0 to 3600, got {value}"
    BAD_ROUND_REPLICAS = "--weight-cache-seed-round-replicas must be from 1 to {max} (replicas a round serves), got {value}"


class BenchError(UserError):
    """`wcache bench` could not take a measurement; the failed process's last log lines are printed above."""

    FAILED = "wcache bench: {what} failed (exit status {code}); the {who}'s last {lines} log lines are above"
    WAITED = "wcache bench: {what} did not come within {seconds:g} s; the {who}'s last {lines} log lines are above"


class WaitError(UserError):
    """`wcache wait` (wait.py): what it was still waiting for when it gave up."""
    TIMEOUT = "Not ready after {timeout:g}s: still waiting for {what}"
    EXITED = "Process {pid} exited before it was ready: still waiting for {what}"
    NOTHING = "wcache wait needs something to wait for: --health URL or --log FILE"
    BAD_TIMEOUT = "--timeout must be a positive number of seconds, got {timeout:g}"


# Why pulling the autotune cache from a seed daemon failed; each is logged, then the daemon tunes
# locally (SEED_FALLBACK).
SEED_REASONS = {
    "unreachable": "Cannot reach the weight cache seed at {address}: {error}",
    "token": "The weight cache seed at {address} rejected the token (--weight-cache-seed-token must match the seed's)",
    "mismatch": "The weight cache seed at {address} was tuned for another configuration (fields: {fields})",
    "no_cache": "The weight cache seed at {address} has no autotune cache (it runs with --no-enable-autotune)",
    "rate_limited": "The weight cache seed at {address} refuses this host for now: too many bad tokens",
    "protocol": "Bad reply from the weight cache seed at {address}: {detail}",
}
SEED_BUSY = "the seed daemon is serving {max} connections; retry shortly"
SEED_FALLBACK = "{reason}; tuning locally"
SEEDED = "Seeded the autotune cache from {address}: {n} configs"


# Reasons the weight cache is unusable. Each cause has its own kind and text; with fallback on the
# engine logs FALLBACK.format(reason=...) and loads from disk.
FALLBACK = "Weight cache unusable ({reason}); falling back to disk loading"
WAITING = "Waiting up to {timeout}s for the weight cache daemon to start"
MAPPED = "Mapped {count} tensors from the weight cache daemon ({mode} mode)"

REASONS = {
    "no_socket": "no daemon socket at {path}",
    "refused": "Cannot connect to weight cache daemon at {path}: {error}",
    "unsafe_socket": "Weight cache socket {path} is unavailable: {error}",
    "untrusted_peer": ("Refusing the weight cache socket {path}: the process listening there (pid {pid}) runs as "
                       "uid {uid}, but the socket belongs to uid {owner} and this engine trusts only uid {own}"),
    "rejected": "Rejecting weight cache connection from uid {uid}",
    "mismatch": "WeightCacheKey mismatch on fields: {fields}",
    "released": "Weights were released",
    "timeout": "no reply from the weight cache daemon at {path} within {timeout}s",
    "protocol": "protocol error from the weight cache daemon: {detail}",
    "device": "Daemon GPU {daemon} != engine GPU {engine}; check the socket path / GPU mapping",
    "map": "Cannot map the weight cache daemon's memory: {error}",
    "transport": "The weight cache daemon serves a {served} arena but the loader requires transport {wanted}",
    "busy": "The weight cache daemon at {path} is busy: {detail}",
    "fds_in_flight": "The weight cache daemon at {path} cannot pass its memory to this engine: {detail}",
    "lost": ("The weight cache daemon at {path} closed the connection without answering ({error}); "
             "it may have crashed or been stopped: see its log"),
}

# Kinds worth waiting for when fallback is off: the daemon may still be starting, have too many
# connections for now, be restarting after a crash, or wait for another process of the user to
# take its descriptors out of flight.
RETRYABLE = {"no_socket", "refused", "busy", "lost", "fds_in_flight"}

# Handing the arena back to a restarted daemon (handback.py). The engine's log lines:
LEASE_LOST = ("The weight cache daemon at {path} went away; this engine keeps serving from the weights it maps "
              "and offers them to the next daemon at {offer}")
NO_OFFER = "The weight cache daemon at {path} went away; this engine keeps its weights but cannot offer them: {error}"
HANDED_BACK = "Handed the weight arena back to a restarted daemon (pid {pid})"
LEASED_AGAIN = "Leased the weights again from the restarted weight cache daemon at {path} (same arena)"
OTHER_COPY = ("The restarted weight cache daemon at {path} did not take this engine's weights ({why}); this engine "
              "keeps serving from the memory it maps, and frees it when it exits")
OWN_COPY = "it loaded its own copy"
# The daemon's log lines.
ADOPTED = ("Rank {rank} adopted the arena of a running engine (pid {pid}): {n} tensors ({mib:.1f} MiB) in {seconds:.2f} s, "
           "without reading the checkpoint")
OFFER_SKIPPED = "Rank {rank} did not adopt the arena offered at {offer}: {why}"
STALE_OFFER = "Removed stale hand-back socket {offer}: no engine listens there"
ARENA_NOT_RECORDED = "it is not the arena this daemon's cache packed and recorded"
ARENA_RECORD_UNSAFE = "Hand-back disabled: {dir} is not a private directory of this user: {why}"
RECORD_NOT_USABLE = "Rank {rank} adopts no handed-back arena: {why}"
ARENA_RECORDED = "Rank {rank} recorded its {kind} arena for a restarted daemon to adopt ({seconds:.2f} s)"
ARENA_VERIFIED = ("Rank {rank} checked the handed-back arena against the keyed hash recorded when it was packed: "
                  "{mib:.1f} MiB in {seconds:.2f} s")
NO_OFFER_AFTER_TAKEOVER = ("Rank {rank} took over from a stopped daemon, but no engine offered the arena it recorded "
                           "within {seconds:.1f} s; loading from disk")

# A standby daemon (`wcache preload --weight-cache-standby`, daemon/launcher.py): its launcher's lines.
STANDING_BY = ("Standing by: the weight cache daemon that owns {path} is running; this daemon takes over when it "
               "stops")
TAKING_OVER = "Taking over: the weight cache daemon that owned {path} stopped"
STANDBY_STOPPED = "Standby stopped by {signal} before taking over"

# What a daemon rank answers when it refuses a request ({"ok": false, "error": KIND, "message": ...}),
# besides the REASONS texts it sends for "rejected", "mismatch" and "released". The last two are
# the "protocol" kind's texts for a well-formed frame that is not a valid request (malformed frames
# get the protocol module's own texts). The daemon also logs each refusal (daemon.REFUSED_LOG).
DAEMON_ERRORS = {
    "busy": "the daemon is serving {max} connections; retry shortly",
    "in_use": "release refused: {n} engine(s) still map the weights in zero_copy mode",
    "release_failed": "release failed: {error}",
    "bad_get_state": "get_state needs a key object and a mode of {modes}",
    "unknown_op": "unknown request {op!r}; expected get_state, get_memory or release",
    "busy_bytes": "the daemon holds {held} of {limit} bytes of requests in flight; retry shortly",
    "unread": "this connection has not read the daemon's last answer, which carries a descriptor; closing it",
    # sendmsg's ETOOMANYREFS: the kernel counts the descriptors that all processes of one user have
    # sent over Unix sockets and nobody has received yet, and refuses more beyond the sender's
    # RLIMIT_NOFILE (root is exempt). Nothing was sent: the stream is at a frame boundary still.
    "fds_in_flight": ("too many file descriptors in flight for this user (ETOOMANYREFS): the kernel refused to "
                      "pass the arena's descriptor, because processes of uid {uid} hold more than {limit} "
                      "descriptors sent over Unix sockets and not yet received; see the daemon's log"),
}


class CacheUnusable(Exception):
    """Why one attempt to get weights from the daemon failed (internal; mapped to logs/errors)."""

    def __init__(self, kind: str, **fields):
        self.kind = kind
        self.fields = fields
        super().__init__(REASONS[kind].format(**fields))


class UnsupportedCheckpointError(UserError):
    """config.json asks for a model that the engine would compute differently from transformers'
    LlamaForCausalLM: refused at start with the field named, never served silently wrong."""

    TEMPLATE = "Unsupported checkpoint {path}: {field} is {value}; {why}"
    # Why each field (or kind of value) is refused; docs/configuration.md's table is generated from it.
    WHY = {
        "architectures": "wcache serves LlamaForCausalLM, Qwen3ForCausalLM and Qwen2ForCausalLM only",
        "model_type": "wcache serves model_type llama, qwen3 and qwen2 only",
        "attention_bias": "wcache's attention projections have no bias",
        "mlp_bias": "wcache's MLP projections have no bias",
        "sliding_window": "wcache computes full causal attention, not a sliding window",
        "hidden_act": "wcache's MLP computes silu only",
        "rope_type": "wcache computes the default, linear and llama3 RoPE types only",
        "rope_field": "the {rope_type} RoPE type needs {needs}",
        "partial_rotary_factor": "wcache rotates every dimension of a head",
        "rope_nested": "wcache computes one RoPE for every layer",
        "dtype": "wcache computes in bfloat16, float16 or float32: choose one with --dtype",
        "head_dim": "RoPE rotates pairs of dimensions, so head_dim must be even",
        "num_key_value_heads": "num_attention_heads must be a multiple of it",
        "required": "config.json must give it as a positive integer",
    }

    def __init__(self, path, field: str, value: str, why: str, **fields):
        super().__init__(self.TEMPLATE.format(path=path, field=field, value=value,
                                              why=self.WHY[why].format(**fields)))


# -- the engine's HTTP API (engine/openai/openai_api.py, engine/api_server/http_front.py, engine/api_server/server.py) ---------------
# vLLM's texts (vllm/entrypoints/openai): an unknown model, and a chat request to a model whose
# tokenizer has no chat template.
MODEL_NOT_FOUND = "The model `{model}` does not exist."
NO_CHAT_TEMPLATE = ("As of transformers v4.44, default chat template is no longer allowed, so you must provide "
                    "a chat template if the tokenizer does not define one. Start wcache serve with --chat-template "
                    "FILE, or give the model directory a chat_template.jinja")
# vLLM's, for a --chat-template value that is neither a readable file nor template text.
CHAT_TEMPLATE_FILE = ("The supplied chat template ({value}) looks like a file path, but it failed to be opened. "
                      "Reason: {reason}")
# vLLM's (its input validation), for a prompt that leaves no room for a single token.
PROMPT_TOO_LONG = ("This model's maximum context length is {max_model_len} tokens. However, your request has "
                   "{prompt_tokens} input tokens. Please reduce the length of the input messages.")
TOKEN_OUT_OF_VOCAB = "Token id {id} is out of vocabulary"
# Ours, each naming the field.
CHAT_TEMPLATE_SYNTAX = "The chat template from {source} is not valid Jinja (line {line}): {error}"
CHAT_TEMPLATE_CONFIG = "Cannot read the chat template of {path}: {why}"
CHAT_TEMPLATE_RENDER = "The chat template could not render these messages: {error}"
CHAT_TEMPLATE_KWARGS = "'chat_template_kwargs' must be an object whose keys are not {reserved}"
MESSAGES_REQUIRED = "'messages' is required and must be a non-empty list of messages"
MESSAGE_SHAPE = ("'messages[{index}]' must be an object with a non-empty string 'role', a 'content' and, if "
                 "any, a string 'name'")
MESSAGE_FIELD = "Unknown field 'messages[{index}].{field}': wcache serve reads a message's role, content and name only"
MESSAGE_CONTENT = ("'messages[{index}].content' must be a string, null, or a list of text parts "
                   "({{\"type\": \"text\", \"text\": \"...\"}})")
MESSAGE_PART = "'messages[{index}].content[{part}]' is not a text part: wcache serve reads text only"
BOOLEAN_FIELD = "'{field}' must be true or false"
PROMPT_LIST_TOO_LONG = "'prompt' lists {n} prompts; wcache serve takes at most {max} in one request"
API_KEY_MISSING = "Unauthorized: this server needs an API key, sent as 'Authorization: Bearer KEY'"
API_KEY_WRONG = "Unauthorized: the API key sent is not one this server accepts"
API_KEY_EMPTY = "--api-key must not be empty: give the key, or leave the flag out to serve without one"
SERVED_NAME_EMPTY = "--served-model-name needs non-empty names"
NOT_JSON = "Request body is not valid JSON: {error}"
NOT_AN_OBJECT = "Request body must be a JSON object"
UNKNOWN_FIELD = "Unknown field '{field}': wcache serve does not support it (see the serve reference)"
REFUSED_FIELD = "'{field}' is not supported by wcache serve: {why}"
PROMPT_REQUIRED = ("'prompt' is required and must be a non-empty string, a list of them, a list of token ids "
                   "or a list of such lists")
PROMPT_SURROGATE = "'prompt' contains a lone surrogate: it is not valid Unicode text"
MAX_TOKENS_TYPE = "'{field}' must be an integer"
MAX_TOKENS_RANGE = ("'{field}' must be between 1 and {limit} for this prompt (max model length {max_model_len}, "
                    "prompt {prompt_tokens} tokens)")
MODEL_TYPE = "'model' must be a string"
TEMPERATURE = "'temperature' must be a number from 0 to 2, got {value}"
TOP_P = "'top_p' must be a number in (0, 1], got {value}"
SEED = "'seed' must be an integer from 0 to 2**63-1, got {value}"
STOP = "'stop' must be a string or a list of at most 4 non-empty strings"
STREAM = "'stream' must be true or false"
STREAM_OPTIONS = "'stream_options' must be an object with 'include_usage' (true or false), and only with 'stream': true"
# vLLM's sampling parameters beyond temperature and top_p (engine/openai/sampling_fields.py), in vLLM's words
# where vLLM has them (its SamplingParams and OpenAI protocol validators).
NUMBER_FIELD = "'{field}' must be a number, got {value}"
INTEGER_FIELD = "'{field}' must be an integer, got {value}"
TOP_K = "top_k must be 0 (disable), or at least 1, got {value}."
MIN_P = "min_p must be in [0, 1], got {value}."
PRESENCE_PENALTY = "presence_penalty must be in [-2, 2], got {value}."
FREQUENCY_PENALTY = "frequency_penalty must be in [-2, 2], got {value}."
REPETITION_PENALTY = "repetition_penalty must be greater than zero, got {value}."
MIN_TOKENS = "min_tokens must be greater than or equal to 0, got {value}."
MIN_TOKENS_OVER_MAX = "min_tokens must be less than or equal to max_tokens={max_tokens}, got {value}."
N_RANGE = "n must be at least 1, got {value}."
N_TOO_MANY = ("'n' of {n} for {prompts} prompt(s) asks for {total} choices; wcache serve makes at most {max} in "
              "one request")
LOGPROBS_NEGATIVE = "`logprobs` must be a positive value."
TOP_LOGPROBS_NEGATIVE = "`top_logprobs` must be a positive value or -1."
TOP_LOGPROBS_WITHOUT_LOGPROBS = "when using `top_logprobs`, `logprobs` must be set to true."
PROMPT_LOGPROBS_NEGATIVE = "`prompt_logprobs` must be a positive value or -1."
PROMPT_LOGPROBS_STREAM = "`prompt_logprobs` are not available when `stream=True`."
LOGPROBS_TOO_MANY = "Requested sample logprobs of {n}, which is greater than max allowed: {max}"
PROMPT_LOGPROBS_TOO_MANY = "Requested prompt logprobs of {n}, which is greater than max allowed: {max}"
LOGIT_BIAS_SHAPE = "'logit_bias' must be an object mapping token ids to numbers"
LOGIT_BIAS_KEY = ("Found token_id `{key}` in logit_bias but token_id must be an integer or string representing an "
                  "integer")
LOGIT_BIAS_VOCAB = ("token_id(s) {ids} in logit_bias contain out-of-vocab token ids. Vocabulary size: {vocab}")
STOP_TOKEN_IDS = "'stop_token_ids' must be a list of token ids"
DRAFT_SAMPLING_FIELD = ("'{field}' is not available on this engine: with --speculative-config it decodes greedily "
                        "(draft then verify), from logits no setting changes")
SAMPLING_WITH_DRAFT = ("'temperature' must be 0 on this engine: with --speculative-config it decodes greedily "
                       "(draft then verify)")
BUSY_MESSAGE = "The server is handling {max} connections; retry shortly"
# Logged when every waiting connection is taken and one idle (or the slowest to send its request) is
# closed for a newcomer.
ROOM_MADE = "Closed a connection {state} for {seconds:.1f} s to make room for a new one ({max} in use)"
TIMED_OUT = ("The request did not arrive in time: {deadline:g} s from its first byte for the request line, "
             "headers and body, at most {read:g} s between reads")
BOTH_FRAMINGS = "A request must not carry both Transfer-Encoding and Content-Length (RFC 9112, section 6.1)"
MANY_LENGTHS = "A request must carry at most one Content-Length header (RFC 9112, section 6.3)"
NO_LENGTH = "A Content-Length header is required"
BAD_LENGTH = "Content-Length must be a number of bytes, got {value!r}"
TOO_LARGE = "Request body of {length} bytes exceeds the limit of {max} bytes"
LOADING = "The engine is still loading its weights"
# Continuous batching (engine/core/scheduler.py, engine/core/engine.py)
QUEUE_FULL = "The engine has {waiting} requests waiting, its limit (--max-waiting-requests {max}); retry shortly"
# The engine loop failed for good (a lost peer, a device error): the server stops answering /health 200
# and exits 1, so that --respawn's supervisor or the kubelet starts a new engine (vLLM's API server
# shuts down when its engine core is dead, for the same reason).
ENGINE_DEAD = ("The engine loop failed ({error}): /health answered 503 and the server exits with status 1 "
               "so that its supervisor (--respawn, Kubernetes) starts a new engine")
STREAM_OVERFLOW = ("A request fell {limit} tokens behind the engine (its client stopped reading its stream); "
                   "the engine ended it")
NO_ROUTE = "No route for {method} {path}"
# The health lane (engine/api_server/http_front.py): /health, /metrics and /version, outside the completion limit.
LANE_BUSY = "The server is answering {max} health, metrics and version requests; retry shortly"
NOT_ALLOWED = "Method {method} is not allowed on {path}: use GET or HEAD"
NO_METRICS = "No metrics are exported by this engine"
# A SIGTERM's drain (engine/api_server/drain.py): what a request still running at the deadline is ended with.
SHUTTING_DOWN = ("The server is shutting down: the request did not finish within the {timeout:g} s drain "
                 "deadline (--shutdown-timeout); retry on another replica")
DRAIN_STARTED = ("Received {signal}, shutting down: /health answers 503; accepting for {delay:g} s more (--shutdown-delay), "
                 "then draining in-flight requests for up to {timeout:g} s (--shutdown-timeout)")
DRAINING = "Stopped accepting; draining {n} in-flight request(s) for up to {timeout:g} s"
DRAIN_CUT = "Drain deadline of {timeout:g} s passed: ending {n} request(s) with an error"
DRAINED = "Drained in {seconds:.1f} s"
# -- `wcache serve` as a front and an engine core (engine/api_server/front.py, engine/core_*.py) ------------------
CORE_EXITED = ("The engine core (pid {pid}) exited with status {code}; the requests in flight fail and /health "
               "answers 503")
CORE_FAILED = "the engine core exited (status {code})"  # each request in flight: "the engine failed: ..."
# `wcache serve --respawn` as a front and engine cores (engine/api_server/front_failover.py)
CORE_PROMOTED = ("Engine core pid {pid} promoted {ms:.1f} ms after engine core pid {dead} died ({cause}); the "
                 "requests in flight resume on it")
CORE_HUNG = ("Engine core pid {pid} hung: no frame for {seconds:.1f} s with requests in flight "
             "(--respawn-heartbeat-timeout {timeout:g}); killing it with SIGKILL")
CORE_SPARE_READY = "Spare engine core pid {pid} ready"
CORE_SPARE_PREPARED = ("Spare engine core pid {pid} prepared in {seconds:.2f} s: weights from {source}, warm-up forward "
                       "run; no KV cache until its promotion")
CORE_SPARE_PROMOTED = "Spare engine core pid {pid} promoted: sizing and allocating its KV cache"
CORE_SPARE_FAILED = "Spare engine core pid {pid} exited before it was ready ({cause}); {n} in a row (giving up at {limit})"
CORE_GAVE_UP = ("Engine core pid {pid} died ({cause}): {n} deaths in a row, each within {stable:g} s of the "
                "promotion before it; giving up")
FRONT_GONE = "The front process is gone (its channel closed): the engine core stops"
FRAME_MALFORMED = "malformed frame on the engine core channel: {error}"
FRAME_TOO_BIG = "frame of {size} bytes on the engine core channel; the limit is {limit}"
# -- the checkpoint's tokenizer and stop ids (model/tokenizer.py, model/generation_config.py) ---------
NO_TOKENIZER = ("No tokenizer in {dir}: it has no tokenizer.json. Give the directory of the model's tokenizer "
                "with --tokenizer DIR, or serve token ids only with --skip-tokenizer-init")
TOKENIZER_UNREADABLE = "Cannot read the tokenizer file {path}: {why}"
GENERATION_CONFIG_EOS = "{path}: eos_token_id must be a token id or a list of token ids, got {value}"
# vLLM's, for a text prompt (or a chat request) to an engine started with --skip-tokenizer-init.
TEXT_WITHOUT_TOKENIZER = ("You cannot pass text prompts when `skip_tokenizer_init` is True: this server was "
                          "started with --skip-tokenizer-init, so send 'prompt' as token ids")
STOP_WITHOUT_TOKENIZER = "'stop' strings need the tokenizer: this server was started with --skip-tokenizer-init"


class FreeMemoryError(UserError):
    """The engine's start check on a GPU: the device's free memory cannot hold what the engine's plan will
    still allocate, because other processes (or a fallen-back daemon's weights) hold it."""
    # Upstream's first sentence and advice, measured against what this engine still needs (memory.py).
    TEMPLATE = ("Free memory on device ({free}/{total} GiB) on startup is less than this engine still needs "
                "({needed} GiB for its KV cache, CUDA graphs and activations, within GPU memory utilization "
                "{utilization}, {budget} GiB). Decrease GPU memory utilization or reduce GPU memory used by other "
                "processes. {fix}")
    FIX_LOWER = "--gpu-memory-utilization {fits} fits what is free now"
    FIX_NONE = "no utilization fits what is free now: stop the processes that hold the GPU's memory (nvidia-smi lists them)"


class DeviceOutOfMemoryError(UserError):
    """A CUDA out-of-memory while the engine sized or allocated its KV cache: memory outside the budget
    (CUDA contexts, other processes, the allocator's fragments) took more than the budget left."""
    TEMPLATE = ("CUDA out of memory while {phase} ({free}/{total} GiB free; budget {utilization} x {total} = "
                "{budget} GiB): memory outside the budget (CUDA contexts, other processes) took the rest. Lower "
                "--gpu-memory-utilization (a smaller KV cache), lower --max-model-len (a smaller activation peak), "
                "or reduce GPU memory used by other processes")
# A checkpoint file that cannot be read as it is (core/shard_header.py, core/checkpoint.py):
# `wcache serve`, `wcache preload` and wcache-verify-checkpoint stop with it.
CHECKPOINT_UNUSABLE = "Checkpoint {model} is not usable: {why}"


# Why seeding a replica's weights from a seed daemon failed (daemon/weight_pull.py). Nothing of a failed
# seed is served: the replica loads its own shards (SEED_WEIGHTS_FALLBACK) or, without shards, exits 2
# (SEED_WEIGHTS_FATAL).
SEED_WEIGHTS_REASONS = {
    "unreachable": "Cannot reach the weight cache seed at {address} for the weights: {error}",
    "token": ("The weight cache seed at {address} rejected the token for the weights (--weight-cache-seed-token must "
              "match the seed's)"),
    "mismatch": "The weight cache seed at {address} holds weights of another cache key (fields: {fields})",
    "released": "The weight cache seed at {address} has released its weights (an engine copied them and asked)",
    "rate_limited": ("The weight cache seed at {address} refuses this host's weight requests for now: too many bad "
                     "tokens"),
    "busy": "The weight cache seed at {address} is busy: {detail}",
    "protocol": "Bad reply from the weight cache seed at {address} while seeding weights: {detail}",
    "oversize": "The weight cache seed at {address} offers {size} bytes for a layout that needs {needed}",
    "stalled": "The weight cache seed at {address} sent nothing for {seconds:g} s ({got} of {size} bytes received)",
    "closed": "The weight cache seed at {address} closed the connection after {got} of {size} bytes",
    "oversent": "The weight cache seed at {address} sent more than the {size} bytes its layout needs",
    "digest": "Weights seeded from {address} do not match the seed's digests (chunks {chunks} of {total})",
    "round": "The seeding round with {address} failed: {error}",
}
SEED_WEIGHTS_FALLBACK = "{reason}; loading the weights from the checkpoint's shards instead"
SEED_WEIGHTS_FATAL = ("{reason}; this replica has no checkpoint shards to fall back on (give it the shards, or "
                      "start it once the seed daemon serves)")
SEEDED_WEIGHTS = ("Rank {rank} weights: seeded from {address} ({tensors} tensors, {mib:.1f} MiB in {seconds:.2f} s, "
                  "{how}, {sent} bytes sent by this daemon), digests checked")
# header: dialling, the request, the source's answer and its checks; then allocate, receive, verify, pack
SEEDING_PHASES = "Rank {rank} seeding phases (s): {phases}"
WEIGHTS_FROM_DISK = "Rank {rank} weights: read from the checkpoint's shards ({why})"
SEED_ROUND_DONE = ("Seeding round {round}: {replicas} replica(s) of rank {rank} served by {how} in {seconds:.2f} s; "
                   "{sent} bytes sent by this daemon for {size} bytes of arena")


class MaxModelLenError(UserError):
    # vLLM's text (ModelConfig's max length check), less its model_max_length alternative: wcache
    # reads no tokenizer maximum. The rotary tables stop at the model's positions, so, as vLLM
    # does, a longer user-set length is refused rather than lowered.
    TOO_LONG = ("User-specified max_model_len ({requested}) is greater than the derived max_model_len "
                "(max_position_embeddings={derived} in model's config.json). This may lead to incorrect model "
                "outputs or CUDA errors. Make sure the value is correct and within the model context size.")


class ModelArgumentError(UserError):
    """Where the model directory goes: `wcache serve DIR` or `--model DIR` (both, as vLLM's serve
    takes both), `wcache preload --model DIR` (the flag only, as upstream's preload)."""
    SERVE_MISSING = "wcache serve needs a model directory: wcache serve DIR, or wcache serve --model DIR"
    SERVE_TWICE = "wcache serve was given two models, {positional!r} and --model {flag!r}: give one"
    PRELOAD_MISSING = "wcache preload needs the model as a flag: wcache preload --model DIR"
    PRELOAD_POSITIONAL = ("wcache preload takes the model as a flag, not as a positional argument: "
                          "wcache preload --model {positional} (wcache serve takes either)")
