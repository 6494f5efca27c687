"""The names of the files in a vault directory (docs/vault-format.md).

A vault is a directory:
    manifest.json          written last: a directory without it is not a vault
    experts.bin            one record per (MoE layer, expert), each at a 16 KiB-aligned offset
    backbone.safetensors   every non-expert weight, mlx-lm naming
    config.json            the mlx-lm-ready config (with its "quantization" entry)
    tokenizer files, generation_config.json, source_config.json
    stats/                 per-vault statistics kept by the engine
Every vault module reads these names from here, the lowest of them, so none imports another
only for a file name.
"""

MANIFEST = "manifest.json"
EXPERTS_FILE = "experts.bin"
BACKBONE_FILE = "backbone.safetensors"
CONFIG_FILE = "config.json"
STATS_DIR = "stats"
