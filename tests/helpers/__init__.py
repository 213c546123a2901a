"""Code the tests share that is larger than a fixture: the Hugging Face sweep's harness and its registries of
tiny-config builders (``sweep``, ``hf_*``), and loading a benchmark script by its path (``benchmarks``)."""
