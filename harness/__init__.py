"""onepass harness: Hydra composes a run, the engine runs it, MLflow records it, pandas reports it."""
