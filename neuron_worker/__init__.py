"""Device worker: model, KV cache, continuous-batching engine and the compiled masked sampler."""
