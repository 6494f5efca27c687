"""What a conversation file's KV arrays are checked against before they are read
(smoe.engine.conversation_file.kv_widths, issue 49) is what mlx-lm's caches hold."""

from __future__ import annotations


def test_the_layout_checked_is_mlx_lms_cache_for_every_architecture():
    """kv_widths (what a file's KV arrays are checked against) is what mlx-lm's cache of
    each architecture S-MoE streams holds after a pass: a wrong width would refuse every
    file that model saves."""
    import importlib

    import mlx.core as mx
    import transformers
    from mlx_lm.models.cache import make_prompt_cache

    from smoe.engine.conversation_file import kv_widths
    from smoe.models.registry import ARCHITECTURES
    from smoe.models.topology import normalize_config
    from tests.conftest import _COMMON, HF_ARCHS

    assert set(HF_ARCHS) == set(ARCHITECTURES)
    for arch, (config_class, _, extra) in HF_ARCHS.items():
        config = getattr(transformers, config_class)(**{**_COMMON, **extra}).to_dict()
        config = normalize_config(config)
        if ARCHITECTURES[arch].config_fixup is not None:
            ARCHITECTURES[arch].config_fixup(config)
        module = importlib.import_module(f"mlx_lm.models.{arch}")
        model = module.Model(module.ModelArgs.from_dict(config))
        cache = make_prompt_cache(model)
        model(mx.array([[1, 2, 3]]), cache=cache)
        (hk, wk), (hv, wv) = kv_widths(config)
        for c in cache:
            keys, values = c.state[:2]
            assert (keys.shape[:2], keys.shape[3]) == ((1, hk), wk), arch
            assert (values.shape[:2], values.shape[3]) == ((1, hv), wv), arch
