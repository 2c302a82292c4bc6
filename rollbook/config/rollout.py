"""Configuration of what generates: the rollout worker (``RolloutConfig``, the ``[rollout]`` section
of ``rollbook run``; ``WorkerConfig``, ``rollbook rollout``), your own data and its rewards
(``DatasetConfig``, ``FieldMap``, ``RewardConfig``: rollbook/datasets.py and rollbook/rewards.py read
them) and the OpenAI-compatible proxy (``ProxyConfig``, ``rollbook proxy``: every field is a flag)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, field_validator, model_validator

from rollbook.config.language_model import Dtype, ModelConfig, device_field, dtype_field

# ---- your own data ---------------------------------------------------------------------------------

Format = Literal["auto", "jsonl", "parquet", "csv"]


class FieldMap(BaseModel):
    """Which column of a row holds each field."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field("prompt", description="Column of a plain-text prompt (used as it is).")
    messages: str = Field(
        "messages",
        description="Column of a chat prompt: a list of {role, content} (JSON text in "
        "CSV); goes through the tokenizer's chat template. A row has a prompt or messages.",
    )
    answer: str = Field("answer", description="Column of the reference answer (math, exact, regex rewards).")
    tests: str = Field(
        "tests",
        description="Column of the tests (code reward): a list of Python statements, or a JSON list / one block of code as text.",
    )
    domain: str = Field("domain", description="Column naming the row's domain (which reward scores it).")
    task_id: str = Field("task_id", description="Column of a stable task id (else one is made from a hash of the prompt).")


class DatasetConfig(BaseModel):
    """Where the rows come from and how they are read."""

    model_config = ConfigDict(extra="forbid")

    train_files: list[str] = Field(min_length=1, description="Training files (.jsonl, .parquet, .csv; local paths).")
    heldout_files: list[str] = Field(
        default_factory=list,
        description="Held-out files; empty = split the training files by a stable hash of the task id (heldout_fraction).",
    )
    format: Format = Field("auto", description="File format; 'auto' goes by the file suffix (.jsonl/.json, .parquet, .csv).")
    fields: FieldMap = Field(default_factory=FieldMap, description="Column names of the fields.")
    default_domain: str | None = Field(None, description="Domain of rows without a domain column (None: such a row is bad).")
    heldout_fraction: float = Field(
        0.1, ge=0, lt=1, description="Without heldout_files: the share of rows held out, by a stable hash of the task id."
    )
    shuffle: bool = Field(True, description="Visit the training rows in a seeded random order, a new order every epoch.")
    seed: int = Field(0, description="Shuffling seed.")
    epochs: int = Field(
        0,
        ge=0,
        description="Passes over the training rows; 0 = no end (the run's num_steps bounds it). "
        "When the epochs are done the worker stops producing.",
    )
    on_bad_row: Literal["skip", "fail"] = Field(
        "skip",
        description="A bad row (missing field, wrong type, undecodable "
        "text, invalid JSON line): 'skip' reports it as file:line and goes on; "
        "'fail' refuses the dataset at load time, naming every bad row.",
    )
    max_rows: int | None = Field(None, ge=1, description="Read at most this many rows per file (None = all).")


# The reward kinds rollbook/rewards.py builds itself; any other kind names a user's function.
BUILTIN_REWARD_KINDS = ("math", "code", "exact", "regex")


class RewardConfig(BaseModel):
    """One domain's verifier."""

    model_config = ConfigDict(extra="forbid")

    kind: str = Field(
        description="'math' (math-verify), 'code' (sandboxed tests), 'exact', 'regex', or "
        "'package.module:function' (your own f(completion, row) -> float)."
    )
    pattern: str | None = Field(
        None,
        description="regex: the pattern searched in the completion (group 1, if any, is "
        "the extracted answer compared with the row's reference).",
    )
    case_sensitive: bool = Field(True, description="exact / regex: compare case-sensitively.")
    code_reward: str = Field(
        "all",
        pattern="^(all|fraction)$",
        description="code: 'all' = 1.0 only when every test "
        "passes (the fraction is still recorded), 'fraction' = the fraction of tests passed.",
    )
    timeout_s: float = Field(
        10.0, gt=0, le=600, description="code: wall-clock limit of one program run (the process group is killed after it)."
    )
    cpu_s: int = Field(5, ge=1, le=600, description="code: CPU-seconds limit (RLIMIT_CPU).")
    memory_mb: int = Field(512, ge=64, le=65536, description="code: address-space limit (RLIMIT_AS / RLIMIT_DATA).")
    max_file_mb: int = Field(
        16, ge=1, le=4096, description="code: largest file (and captured output) the program may write (RLIMIT_FSIZE)."
    )
    max_files: int = Field(
        32,
        ge=1,
        le=100000,
        description="code: most files the program may open for writing (with max_file_mb, a bound on what it can write to disk).",
    )
    network_namespace: bool = Field(
        True,
        description="code: run in fresh user/network/PID namespaces (unshare) "
        "where the platform allows; socket use is refused in-process either way.",
    )

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, kind: str) -> str:
        if kind not in BUILTIN_REWARD_KINDS and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", kind):
            raise ValueError(
                f"reward kind must be one of {list(BUILTIN_REWARD_KINDS)} or 'package.module:function', got {kind!r}"
            )
        return kind


# ---- the rollout worker ----------------------------------------------------------------------------


class RolloutConfig(BaseModel):
    """What a rollout worker samples and how."""

    model_config = ConfigDict(extra="forbid")

    domains: list[str] = Field(
        default_factory=lambda: ["arithmetic", "reverse"], description="Task domains to sample (see rollbook/tasks.py)."
    )
    num_digits: int = Field(2, ge=1, le=6, description="arithmetic: operand digits.")
    reverse_max_len: int = Field(4, ge=1, le=12, description="reverse: longest string.")
    reverse_per_char: bool = Field(
        False, description="reverse: graded reward, the fraction of characters in the right place (else 1/0 exact match)."
    )
    num_train_tasks: int = Field(400, ge=1, description="Training problems per domain.")
    num_eval_tasks: int = Field(40, ge=1, description="Held-out problems per domain for evaluation.")
    num_eval_samples: int = Field(
        8, ge=0, description="Sampled answers per held-out problem for eval/sampled_reward (0 = greedy only)."
    )
    eval_seed: int = Field(
        1234, description="Seed of the sampled evaluation: the same for every evaluation (common random numbers)."
    )
    group_size: int = Field(8, ge=1, description="Samples per prompt (one normalization group).")
    num_prompts: int = Field(8, ge=1, description="Prompts per rollout round.")
    max_new_tokens: int = Field(
        6,
        ge=1,
        description="Longest completion. With max_prompt_tokens it makes the longest request, which must fit the "
        "model's max_position_embeddings (checked before anything starts, one line, exit 2).",
    )
    max_prompt_tokens: int | None = Field(
        None,
        ge=1,
        description="Longest prompt in tokens (a dataset row's with its chat template and bos): a longer dataset "
        "row is a bad row (skipped, or refused under on_bad_row = 'fail'), a longer toy task is refused. "
        "max_prompt_tokens + max_new_tokens is each sequence's length in the native engine's KV cache "
        "(max_batch_size x that many positions per layer) and vLLM's max_model_len; it must fit the model's "
        "max_position_embeddings. None: 64 for the toy tasks (their longest prompt is 21 tokens), 256 with a dataset.",
    )
    max_batch_size: int | None = Field(
        None,
        ge=1,
        description="Sequences the native engine decodes at once (its KV cache's slots; more requests wait for "
        "a free one). None: one generate call of a round, group_size x num_prompts (x chunk_prompts instead "
        "of num_prompts when a dataset generates in chunks).",
    )
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (the trainer recomputes log-probs at the same one).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (1 = off).")
    top_k: int = Field(0, ge=-1, description="Top-k (0 or -1 = off).")
    max_staleness: int = Field(
        1,
        ge=0,
        description="Staleness gate eta: admit while (eta + version + 1) * batch > accepted + running. `rollbook rollout` replaces it with the max_staleness its trainer announces through the store.",
    )
    seed: int = Field(0, description="Task sampling seed.")
    worker_id: str = Field("worker-0", description="Recorded on every trajectory.")
    engine: Literal["native", "vllm"] = Field(
        "native",
        description="The engine that generates the rollouts (a rollout worker's, the colocated one): native "
        "(PyTorch, CPU or CUDA, rollout/engine.py) or vllm (rollout/vllm_engine.py: a GPU, the optional vllm "
        "package, and model.path, the directory vLLM loads; the trainer's weights replace its weights by "
        "version). The held-out evaluators beside a separated or ray trainer stay native.",
    )
    vllm_gpu_memory_utilization: float = Field(
        0.4,
        gt=0,
        le=1,
        description="engine vllm: the share of its GPU's memory vLLM takes for the model and its KV cache "
        "(vLLM's gpu_memory_utilization); leave the rest to a trainer on the same GPU (colocated, separated "
        "on one GPU, ray.colocate).",
    )
    device: str = device_field(
        "the rollout engine (a rollout worker's, the colocated one, the held-out evaluators; vLLM places itself on its GPU)"
    )
    dtype: Dtype = dtype_field(
        "the rollout engine",
        "The engine's copy of the student is held in it; the log-probs it records are float32 from its logits.",
    )
    dataset: DatasetConfig | None = Field(
        None,
        description="Your own data: train on these dataset rows instead of the "
        "built-in toy domains (which `domains` then does not name). See rollbook/datasets.py.",
    )
    rewards: dict[str, RewardConfig] = Field(
        default_factory=dict,
        description="With a dataset: the reward of each "
        "domain ([rollout.rewards.<domain>] kind = 'math' | 'code' | 'exact' | "
        "'regex' | 'module:function'). A row of a domain without one is a bad row.",
    )
    tokenizer: str | None = Field(
        None,
        description="With a dataset: local directory of a Hugging Face tokenizer "
        "(loaded with local_files_only). None: the model's directory when the model loads "
        "from one (model.path), else the toy tasks' character tokenizer.",
    )
    stop_strings: list[str] = Field(
        default_factory=list,
        description="With a dataset: strings that end a completion "
        "(besides the tokenizer's eos); the text is cut before them for scoring.",
    )
    stop_token_ids: list[NonNegativeInt] = Field(
        default_factory=list,
        description="Token ids that end a completion besides the tokenizer's eos. `rollbook run` and "
        "`rollbook rollout` add the model's own (the eos_token_id list of model.path's generation_config.json, "
        "as Qwen and Llama-3 instruct models list several; rollbook.language_models.stop_token_ids).",
    )
    reward_workers: int = Field(
        2,
        ge=0,
        le=64,
        description="With a dataset: processes that run the verifiers off the "
        "generation thread (0 = score in the worker's thread).",
    )
    reward_timeout_s: float = Field(
        300.0,
        gt=0,
        description="With a dataset: longest wait for one sample's verifier "
        "result; past it the sample is an error outcome (no reward).",
    )
    chunk_prompts: int = Field(
        0,
        ge=0,
        description="With a dataset: generate a round's prompts in chunks of this many, "
        "scoring each chunk while the next one generates (0 = one chunk).",
    )

    @model_validator(mode="after")
    def _dataset_fields(self) -> "RolloutConfig":
        if self.dataset is None:
            used = sorted(f for f in ("rewards", "tokenizer", "stop_strings") if f in self.model_fields_set and getattr(self, f))
            if used:
                raise ValueError(
                    f"rollout.{used[0]} applies to dataset rows: set [rollout.dataset] (the toy domains use "
                    "the character tokenizer and their own verifiers)"
                )
        elif not self.rewards:
            raise ValueError("rollout.dataset needs rewards: set [rollout.rewards.<domain>] kind = ... for each domain")
        return self


class WorkerConfig(BaseModel):
    """Configuration of ``rollbook rollout``."""

    model_config = ConfigDict(extra="forbid")

    server: str = Field("127.0.0.1:50551", description="Store address HOST:PORT.")
    weights: str = Field(
        description="Weight channel: 'shm:NAME' (shared memory, one host), 'grpc:HOST:PORT' (network), "
        "'ray:BOARD' (Ray's object store, inside a Ray job: the ray placement) or 'cuda-ipc:NAME' (the "
        "trainer's GPU buffer through CUDA IPC, one GPU host: copied device to device)."
    )
    model_id: str = Field("tiny", description="Model id the trajectories are recorded under.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Architecture to build before the first weights arrive.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    batch_size: int = Field(
        64,
        ge=1,
        description="The trainer's samples per version (the staleness gate's batch); "
        "replaced by the trainer's num_samples once it announces it through the store.",
    )
    version_share: float = Field(
        1.0,
        gt=0,
        le=1,
        description="This worker's share of each version's samples when several workers feed one trainer: the gate "
        "admits ceil(version_share x the trainer's num_samples) per version (at least one group). The ray placement "
        "sets 1/num_workers; 1 = this worker alone may fill a batch.",
    )
    spool_dir: str = Field("runs/default/spool", description="Local spool for trajectories while the store is unreachable.")
    spool_max_bytes: int = Field(256 << 20, ge=1 << 16, description="Spool bound; admission stops when it is full.")
    first_weights_timeout_s: float = Field(300.0, gt=0, description="How long to wait for the first published weights.")
    announcement_wait_s: float = Field(
        5.0,
        ge=0,
        description="At start, how long to wait for the trainer's staleness announcement (its max_staleness and "
        "samples_per_version) before the first round; without one the worker runs on its own rollout.max_staleness.",
    )
    max_rounds: int = Field(0, ge=0, description="Stop after this many rollout rounds (0 = until signalled).")
    max_idle_s: float = Field(
        600.0,
        ge=0,
        description="Stop when no round could run for this long (the staleness gate "
        "closed and no newer weights, e.g. the trainer has exited); 0 = wait until signalled.",
    )
    log_every: int = Field(10, ge=1, description="Log one progress line every N rounds.")


# ---- the proxy ------------------------------------------------------------------------------------


class ProxyConfig(BaseModel):
    """Configuration of ``rollbook proxy``."""

    model_config = ConfigDict(extra="forbid")

    server: str = Field("127.0.0.1:50551", description="Store address HOST:PORT (keys from ROLLBOOK_*_KEY, docs/security.md).")
    host: str = Field(
        "127.0.0.1", description="HTTP bind address; a non-loopback one needs ROLLBOOK_ADMIN_KEY and ROLLBOOK_WORKER_KEY."
    )
    port: int = Field(
        8000, ge=0, le=65535, description="HTTP port; 0 = any free one (printed as 'listening on http://HOST:PORT')."
    )
    model_id: str = Field("tiny", description="The model name clients ask for and the store records trajectories under.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The served model's architecture (or local path).")
    tokenizer: str | None = Field(
        None,
        description="Local directory of a Hugging Face tokenizer with a chat template; None: model.path's "
        "when set (a Hugging Face model directory), else the toy tasks' character tokenizer (docs/online.md).",
    )
    tool_parser: Literal["hermes"] | None = Field(
        "hermes",
        description="How tool calls are read from an HF model's output: 'hermes' (<tool_call>{json}</tool_call>, "
        "Hermes and Qwen 2.5/3 templates); None refuses requests with tools.",
    )
    engine: Literal["native", "vllm"] = Field(
        "native", description="native: the PyTorch engine (CPU or CUDA); vllm: VllmEngine on model.path (GPU, optional)."
    )
    engine_process: bool = Field(
        True,
        description="Run the native engine's decode loop in a process of its own (rollout/engine_process.py), so the "
        "HTTP side and the decode loop do not share one interpreter lock; False keeps it in the proxy's process.",
    )
    checkpoint: str | None = Field(
        None,
        description="A state dict file (.safetensors or torch .pt) loaded into the model at start; None keeps the built weights.",
    )
    version: int = Field(0, ge=0, description="The policy version of the starting weights (without a weight channel).")
    weights: str | None = Field(
        None,
        description="Follow a trainer's weight channel: 'shm:NAME' (one host), 'cuda-ipc:NAME' (one GPU host) or 'grpc:HOST:PORT'. "
        "Completions wait for its first version (the built weights are never served), and each newer "
        "version is installed as load_weights does.",
    )
    weights_poll_s: float = Field(0.5, gt=0, description="How often the weight channel is asked for a newer version.")
    seed: int = Field(0, description="Sampling seed of the engine.")
    device: str = device_field("the served model")
    dtype: Dtype = dtype_field("the served model", "The model is held in it; recorded log-probs are float32 from its logits.")
    max_batch_size: int = Field(
        64,
        ge=1,
        description="Sequences the native engine decodes at once (its KV cache's slots), at most max_concurrent x "
        "max_n (the most that can be in flight).",
    )
    max_context_tokens: int = Field(
        512,
        ge=2,
        description="Prompt plus max_tokens may not exceed this (400 context_length_exceeded). Each sequence's "
        "length in the native engine's KV cache and vLLM's max_model_len; it must fit the model's "
        "max_position_embeddings (checked at start, one line, exit 2).",
    )
    default_max_tokens: int = Field(16, ge=1, description="max_tokens when a request gives none.")
    max_tokens_limit: int = Field(256, ge=1, description="The largest max_tokens a request may ask for.")
    max_n: int = Field(8, ge=1, description="The largest n (choices per request).")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Larger request bodies are refused with 413.")
    max_concurrent: int = Field(32, ge=1, description="Completions generating at once (engine threads).")
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="PyTorch intra-op threads of the native engine. None: 1 for a model under 10M parameters "
        "(its per-token work is too small to split, and waking a second thread after an idle moment delays the "
        "first token by milliseconds), else up to 4 (the machine's cores).",
    )
    max_waiting: int = Field(
        256, ge=0, description="Completions waiting for admission beyond max_concurrent; more are refused with 429."
    )
    admission_wait_s: float = Field(
        60.0, gt=0, description="How long a completion waits while the engine is paused or loading weights before 503."
    )
    max_sessions: int = Field(100_000, ge=1, description="Sessions held at once (ended ones count until ended_session_ttl_s).")
    ended_session_ttl_s: float = Field(3600.0, gt=0, description="How long an ended session still takes rewards.")
    idle_session_ttl_s: float = Field(
        3600.0,
        gt=0,
        description="A session without any request (completion, reward, end, lookup) for this long, and "
        "nothing in flight, expires: what it delivered is submitted as consumed, and further completions "
        "and rewards get 409 session_expired. It is forgotten ended_session_ttl_s later.",
    )
    consume_settle_s: float = Field(
        60.0,
        gt=0,
        description="A delivered completion is submitted as consumed once the session "
        "moves on (its next call, a reward, the end) or after this long; a retry of its call "
        "before then shows it was not consumed (docs/online.md).",
    )
    submit_batch_size: int = Field(64, ge=1, description="Trajectories per Submit batch.")
    submit_linger_s: float = Field(
        0.2,
        ge=0,
        description="How long a Submit batch waits for more completions after its first: fewer, larger "
        "batches cost the store and the proxy less CPU per completion. No answer waits for it, and a "
        "reward or a session's end that waits for a completion's verdict sends the batch at once.",
    )
    spool_dir: str | None = Field(
        None,
        description="A local directory for the durable spool: every completion is written "
        "there (fsync'd) before the caller has it whole (the body, or a stream's finish events) and "
        "stays until the store answered it, so "
        "a proxy killed and restarted on the same directory submits what it had delivered, exactly "
        "once (docs/online.md). None: in memory only.",
    )
    spool_max_bytes: int = Field(256 << 20, ge=1 << 20, description="Bound of the spool; a full spool makes completions wait.")
    worker_id: str = Field("proxy", description="worker_id recorded on every trajectory.")

    @field_validator("weights")
    @classmethod
    def _channel(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("shm:", "grpc:", "cuda-ipc:")):
            raise ValueError(f"must be 'shm:NAME', 'cuda-ipc:NAME' or 'grpc:HOST:PORT', got {v!r}")
        return v
