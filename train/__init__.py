"""Training: data, target features, losses and the one accelerate loop (see DESIGN.md)."""
