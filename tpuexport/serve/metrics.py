"""The server's Prometheus metrics, in a registry of its own (several servers may share a process in tests)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Request latencies from a fraction of a millisecond (a small model on CPU) to tens of seconds.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# The model label of requests for a model or version that is not served: labels name served models
# only, since request-chosen names would grow the metrics without bound.
UNKNOWN_MODEL = "(not served)"


class Metrics:
    """Counters and histograms of one server.

    Attributes:
      registry: the CollectorRegistry they live in.
      requests: requests by model, version, api ("rest"/"grpc") and outcome ("ok", "bad_request",
        "not_found", "error", "unavailable").
      latency: seconds from a request's arrival to its answer, by model, version and api.
      batch_rows: rows in each executed batch (after dynamic batching, before padding).
      bucket_hits: executions per bucket.
      padded_rows: rows of padding run (waste), by model and version.
      rows: real rows run.
      decode_rows: rows generating in each decode step of a text-generation model (continuous
        batching: the requests sharing the step).
      generated_tokens: tokens generated, by model and version.
      prompt_tokens: prompt tokens prefilled (admitted requests' prompts).
      time_to_first_token: seconds from a generate request's arrival to its first token.
      inter_token_latency: seconds between a request's consecutive steps.
      e2e_latency: seconds from a generate request's arrival to its end.
      queue_time: seconds a generate request waited for cache slots.
      requests_running, requests_waiting: generate requests holding cache slots, and waiting for them.
      cache_slots_used: KV cache slots holding a generating row (a paged cache: rows of the step).
      kv_cache_pages_used: a paged cache's pages holding a running row's positions.
      kv_cache_pages_free: a paged cache's pages no running row holds or has reserved (what
        admission takes from; serve/paged_steps.py).
      step_tokens: tokens a paged cache's steps ran, by kind ("prefill" chunks, "decode").
      kv_cache_pages_cached: a paged cache's pages that no running row holds and that keep a prefix for
        the next row that begins with it (prefix caching; handed out for writing when no other page is free).
      prefix_cache_queries, prefix_cache_hits: prompt tokens looked up in the prefix cache, and those
        found there (not prefilled), in tokens as vLLM's vllm:prefix_cache_queries / _hits.
      compilations_at_start: XLA compilations while a model version's runner opened (0 unless it
        was compiled here with --allow-recompile; runtime/compilations.py).
    The generation ones are vLLM's (vllm:time_to_first_token_seconds, ...) under tpuexport_ names.
    """

    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("tpuexport_requests", "Requests by outcome.", ["model", "version", "api", "outcome"],
                                registry=self.registry)
        self.latency = Histogram("tpuexport_request_latency_seconds", "Request latency.", ["model", "version", "api"],
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.batch_rows = Histogram("tpuexport_batch_rows", "Rows per executed batch (dynamic batching).", ["model", "version"],
                                    buckets=BATCH_BUCKETS, registry=self.registry)
        self.bucket_hits = Counter("tpuexport_bucket_hits", "Executions per compiled bucket.", ["model", "version", "bucket"],
                                   registry=self.registry)
        self.padded_rows = Counter("tpuexport_padded_rows", "Rows of padding executed (waste).", ["model", "version"],
                                   registry=self.registry)
        self.rows = Counter("tpuexport_rows", "Real rows executed.", ["model", "version"], registry=self.registry)
        self.decode_rows = Histogram("tpuexport_decode_rows", "Rows generating per decode step (continuous batching).",
                                     ["model", "version"], buckets=BATCH_BUCKETS, registry=self.registry)
        self.generated_tokens = Counter("tpuexport_generated_tokens", "Tokens generated.", ["model", "version"], registry=self.registry)
        self.prompt_tokens = Counter("tpuexport_prompt_tokens", "Prompt tokens prefilled.", ["model", "version"], registry=self.registry)
        labels = ["model", "version"]
        self.time_to_first_token = Histogram("tpuexport_time_to_first_token_seconds", "Time from a generate request's arrival to its first "
                                             "token.", labels, buckets=LATENCY_BUCKETS, registry=self.registry)
        self.inter_token_latency = Histogram("tpuexport_inter_token_latency_seconds", "Time between a generate request's consecutive "
                                             "tokens.", labels, buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e_latency = Histogram("tpuexport_e2e_request_latency_seconds", "Time from a generate request's arrival to its end.", labels,
                                     buckets=LATENCY_BUCKETS, registry=self.registry)
        self.queue_time = Histogram("tpuexport_request_queue_time_seconds", "Time a generate request waited for KV cache slots.", labels,
                                    buckets=LATENCY_BUCKETS, registry=self.registry)
        self.requests_running = Gauge("tpuexport_num_requests_running", "Generate requests holding KV cache slots.", labels,
                                      registry=self.registry)
        self.requests_waiting = Gauge("tpuexport_num_requests_waiting", "Generate requests waiting for KV cache slots.", labels,
                                      registry=self.registry)
        self.cache_slots_used = Gauge("tpuexport_kv_cache_slots_used", "KV cache slots holding a generating row.", labels,
                                      registry=self.registry)
        self.kv_cache_pages_used = Gauge("tpuexport_kv_cache_pages_used", "Paged KV cache pages holding a running row's positions.",
                                         labels, registry=self.registry)
        self.kv_cache_pages_free = Gauge("tpuexport_kv_cache_pages_free", "Paged KV cache pages no running row holds or has reserved.",
                                         labels, registry=self.registry)
        self.kv_cache_pages_cached = Gauge("tpuexport_kv_cache_pages_cached", "Paged KV cache pages no running row holds that keep a "
                                           "prefix for reuse (prefix caching).", labels, registry=self.registry)
        self.prefix_cache_queries = Counter("tpuexport_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", labels,
                                            registry=self.registry)
        self.prefix_cache_hits = Counter("tpuexport_prefix_cache_hits", "Prompt tokens found in the prefix cache (not prefilled).", labels,
                                         registry=self.registry)
        self.step_tokens = Counter("tpuexport_step_tokens", "Tokens run by a paged cache's steps, by kind (prefill, decode).",
                                   [*labels, "kind"], registry=self.registry)
        self.compilations_at_start = Gauge("tpuexport_compilations_at_start", "XLA compilations while the model's executables were "
                                           "loaded and its weights placed.", labels, registry=self.registry)

    def exposition(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return generate_latest(self.registry)
