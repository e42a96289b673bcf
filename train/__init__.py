"""selfspec training: data, target features, losses and the accelerate training loop for drafters (training proper);
the applications built on it (benchmark, serving, demo, experiments) live in train/apps/, which it never imports."""
