"""selfspec training: data, target features, losses and the accelerate training loop for drafters."""
