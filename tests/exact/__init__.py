"""Exactness against references no one here wrote (mlx-lm in memory, transformers on the original weights): a failure here means the engine computes other bits."""
