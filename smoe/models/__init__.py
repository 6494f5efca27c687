"""What S-MoE knows per model architecture: ``registry`` (one table of per-architecture
facts), ``topology`` (reading and normalising a checkpoint's config; the typed ``Topology``
the manifest loads) and ``checkpoint`` (opening a source checkpoint lazily through mlx-lm)."""
