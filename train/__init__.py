"""Training: data, target features, losses and the one accelerate loop (docs/architecture.md#training)."""
