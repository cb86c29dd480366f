"""onepass: batched LLM decode for GGUF models (engine), its kernels (kernels) and the experiment harness (harness).

The three rooms live under one package so that installing onepass adds a single top-level name: `engine`,
`kernels` and `harness` alone would shadow (or be shadowed by) PyPI packages of the same names, Hugging Face's
`kernels` among them, which transformers imports."""
