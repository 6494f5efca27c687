"""What S-MoE knows per model architecture: ``registry`` (one table of per-architecture
facts), ``topology`` (reading and normalising a checkpoint's config; the typed ``Topology``
the manifest loads), ``checkpoint`` (opening a source checkpoint lazily through mlx-lm) and
``dtypes`` (which dtype each float tensor is kept, and so computed, in)."""
