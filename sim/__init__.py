"""kvsim: a discrete-event simulator of vLLM KV-cache CPU offloading."""
