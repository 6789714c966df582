"""vLLM engines on this machine: tiny models, a CPU copy worker and the engine runner, run
under the vLLM environment by the demo, the benchmarks, the e2e scenarios and the vLLM tests;
never in a vLLM pod (the plug-in payload leaves them out)."""
