"""onepass engine: GGUF models, reference and GPU decode paths, batching."""
