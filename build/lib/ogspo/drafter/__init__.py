"""EAGLE-3-style draft head: model (`head`), runtime drafter (`runtime`), data, training, measurement."""
