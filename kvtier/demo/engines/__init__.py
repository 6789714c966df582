"""The demo's vLLM engines: tiny models, a CPU copy worker and the engine runner, run under
the vLLM environment by the demo, the e2e scenarios and the vLLM tests; never in a vLLM pod."""
